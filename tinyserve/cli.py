"""The `tinyserve` command: the only place that parses arguments and environment variables."""

from __future__ import annotations

import argparse
import logging
import sys

from tinyserve.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias ({DEFAULT_MODEL}), path to a .gguf file, or a Hugging Face checkpoint folder")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache budget in GiB (default: 1 GiB on CPU, half the free memory on CUDA)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len),
    )


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)


def _engine(args: argparse.Namespace):
    from tinyserve.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config_from_args(args))


def _stream(engine, request_id: str, prompt_ids: list[int], params) -> str:
    """Run one request to the end, printing text as it comes; returns the whole text."""
    engine.add_request(request_id, prompt_ids, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            text += out.new_text
    print()
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyserve.types import SamplingParams

    engine = _engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    prompt_ids = engine.tokenizer.encode(args.prompt)
    _stream(engine, "generate", prompt_ids, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tinyserve.types import SamplingParams

    engine = _engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("tinyserve chat: type a message, an empty line or Ctrl-D to quit.")
    for turn in range(10**9):
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        reply = _stream(engine, f"chat-{turn}", prompt_ids, params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyserve", description="An LLM inference server from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print it as it streams")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tinyserve.loader.errors import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as exc:  # bad model file or setting: one clear line, no traceback
        print(f"tinyserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
