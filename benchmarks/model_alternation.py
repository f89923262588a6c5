"""Issue 44's bar for several models: two tiny models under --max-loaded-models 1, N requests alternating
between them at concurrency C. Every request must be a 200 (none 503 model_unloaded: a request that saw
its model's load finish is admitted before another load may evict it) and finish within 30 s.

Two random checkpoints (llama and qwen2, 2 layers, hidden 32) on SmolLM2's tokenizer, in a temporary folder,
served in-process (BackgroundServer). Prints one JSON line: statuses, error codes, latency p50 / max, loads.

    .venv/bin/python benchmarks/model_alternation.py [--requests 200] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
import transformers

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.loader.model_loader import resolve_model_path
from tinyserve.server.launcher import BackgroundServer


def _random_checkpoint(folder: Path, architecture: str, tokenizer, seed: int) -> str:
    model_class, config_class = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                                 "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[architecture]
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, max_position_embeddings=256,
                          tie_word_embeddings=True)
    torch.manual_seed(seed)
    model_class(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


async def _alternate(base_url: str, num_requests: int, concurrency: int) -> list[tuple[int, str | None, float]]:
    seats = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def one(i: int) -> tuple[int, str | None, float]:
            async with seats:
                start = time.monotonic()
                body = {"model": ("llama", "qwen")[i % 2], "prompt": "Once upon a time", "max_tokens": 8,
                        "temperature": 0, "ignore_eos": True}
                r = await client.post("/v1/completions", json=body)
                code = None if r.status_code == 200 else r.json()["error"]["code"]
                return r.status_code, code, time.monotonic() - start

        return await asyncio.gather(*(one(i) for i in range(num_requests)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    smollm2 = resolve_model_path("smollm2-135m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    with tempfile.TemporaryDirectory() as root:
        llama = _random_checkpoint(Path(root) / "llama", "llama", tokenizer, 1)
        qwen = _random_checkpoint(Path(root) / "qwen", "qwen2", tokenizer, 2)
        engine = EngineConfig(model=llama, dtype="float32", device="cpu", cache=CacheConfig(num_blocks=64),
                              scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=16))
        config = ServerConfig(port=0, warmup=False, served_model_names=("llama",), models=(("qwen", qwen),),
                              max_loaded_models=1)
        with BackgroundServer(engine, config) as srv:
            results = asyncio.run(_alternate(srv.base_url, args.requests, args.concurrency))
            loads = sum(float(line.split()[-1]) for line in httpx.get(srv.base_url + "/metrics").text.splitlines()
                        if line.startswith("tinyserve:model_loads_total{") and 'outcome="ok"' in line)
    latencies = [seconds for _, _, seconds in results]
    print(json.dumps({
        "requests": args.requests, "concurrency": args.concurrency,
        "statuses": dict(collections.Counter(status for status, _, _ in results)),
        "error_codes": dict(collections.Counter(code for _, code, _ in results if code is not None)),
        "latency_p50_s": round(statistics.median(latencies), 3), "latency_max_s": round(max(latencies), 3),
        "model_loads": loads,
    }))


if __name__ == "__main__":
    main()
