"""`tinyserve serve` on the tiny random model (reliability/conftest.py), as a process of its own, for the
shutdown tests: flags slow the loading or every step, and a file, once it exists, hangs the next step."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: so that `reliability` imports

from reliability.conftest import TINY_ENGINE, tiny_loaded_model  # noqa: E402

from tinyserve.config import ServerConfig  # noqa: E402
from tinyserve.engine.loop.llm_engine import LLMEngine  # noqa: E402
from tinyserve.loader.gguf.checkpoint import open_gguf  # noqa: E402
from tinyserve.loader.model_loader import resolve_model_path  # noqa: E402
from tinyserve.loader.tokenizer import Tokenizer  # noqa: E402
from tinyserve.server.launcher import serve  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--shutdown-timeout", type=float, default=1.0)
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--hang-file", default=None)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tokenizer = Tokenizer.from_gguf(open_gguf(resolve_model_path("smollm2-135m")))

    def build(engine_config):
        time.sleep(args.load_delay)
        engine = LLMEngine(engine_config, loaded=tiny_loaded_model(tokenizer))
        step = engine.step

        def faulty_step():
            if args.hang_file is not None and os.path.exists(args.hang_file):
                time.sleep(3600)
            time.sleep(args.step_delay)
            return step()

        engine.step = faulty_step
        return engine

    config = ServerConfig(port=args.port, shutdown_timeout=args.shutdown_timeout, warmup=False)
    return serve(TINY_ENGINE, config, "info", engine_factory=build)


if __name__ == "__main__":
    sys.exit(main())
