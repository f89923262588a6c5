"""The flags of every subcommand that runs an engine (generate, chat, serve, bench offline) and the
EngineConfig built from them: cli.py and cli_bench.py both add them, so they live below both."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tinyserve.config import (DEFAULT_MODEL, DTYPES, GENERATION_CONFIG_SOURCES, KV_CACHE_DTYPES,
                              LLAMA_CPP_SAMPLING_DEFAULTS, QUANTIZATION_MODES, QUANTIZATIONS, SAMPLING_DEFAULT_FIELDS,
                              SPECULATIVE_METHODS,
                              CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig)

# Every default below is read from the config dataclasses (tinyserve/config.py), so that the command line,
# tinyserve.LLM and the configs cannot drift apart.

LOG_LEVELS = ["debug", "info", "warning", "error"]


def add_engine_args(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    g = parser.add_argument_group("engine")
    what = f"alias ({DEFAULT_MODEL}), path to a .gguf file, or a Hugging Face checkpoint folder"
    if several_models:
        g.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                       help=f"{what}; repeat it to serve several (each loaded at start-up, up to "
                            "--max-loaded-models), NAME being what requests send (default: MODEL)")
    else:
        g.add_argument("--model", default=EngineConfig.model, help=what)
    g.add_argument("--dtype", default=EngineConfig.dtype, choices=DTYPES)
    g.add_argument("--device", default=EngineConfig.device, help="auto, cpu, cuda, cuda:N")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly, without CUDA graphs (captured at start-up by default)")
    g.add_argument("--load-read-timeout", type=float, default=EngineConfig.load_read_timeout, metavar="S",
                   help="a model load fails when a read of its files gives no data for S seconds (a hung "
                        "mount); the models already serving go on (default %(default)g)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU compute threads of torch and our kernels (default: torch's, one per physical core)")
    g.add_argument("--quantization", default=EngineConfig.quantization, choices=QUANTIZATION_MODES,
                   help="the linears' weights on CPU: auto (default) runs a GGUF stored quantized through our "
                        "integer kernels (its own codes) and keeps a float checkpoint's dtype; none forces the "
                        "float path; int8 / int4 quantize any checkpoint; see README 'Speed modes'")
    g.add_argument("--kv-cache-memory", type=kv_cache_memory, default="auto", metavar="GIB|auto",
                   help=f"KV cache pool in GiB, or auto (default): on CPU what --max-num-seqs full contexts need, "
                        f"at most {CacheConfig.memory_fraction:.0%}% of the memory left after the weights (at least "
                        f"{CacheConfig.cpu_kv_cache_memory_gib:g} GiB where that much is left, at most "
                        f"{CacheConfig.cpu_kv_cache_max_gib:g} GiB; within "
                        f"--memory-budget's share, all of it), on CUDA {CacheConfig.memory_fraction:.0%}% of "
                        "the free memory; a model whose context needs more starts with the context that fits")  # "%%": argparse
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    g.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; int8: 8-bit K/V with a scale per token and head, ~1.9x the "
                        "tokens in the same budget (CPU; README 'Speed modes')")
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=SchedulerConfig.max_model_len)
    g.add_argument("--priority-aging", type=float, default=SchedulerConfig.priority_aging_s, metavar="S",
                   help="seconds of waiting worth one priority level: a request is overtaken or preempted by "
                        "better priorities for at most S x their gap (default %(default)g)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=EngineConfig.seed)
    p = parser.add_argument_group("tensor and pipeline parallel (README 'Parallel')")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=ParallelConfig.tensor_parallel_size,
                   metavar="T", help="split each layer's heads and MLP (and the vocabulary) between T ranks")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=ParallelConfig.pipeline_parallel_size,
                   metavar="P", help="split the layers between P stages; T x P ranks in all, started by this "
                                     "command on this machine, or by torchrun on several")
    p.add_argument("--distributed-timeout", type=float, default=ParallelConfig.timeout_s, metavar="S",
                   help="a step collective that waits this long for a rank fails the engine")
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    s = parser.add_argument_group("speculative decoding (lossless: the output is the model's own)")
    s.add_argument("--speculative-method", default=SpeculativeConfig.method, choices=SPECULATIVE_METHODS,
                   help="ngram: propose what followed the sequence's latest earlier n-gram (prompt lookup), "
                        "pays off when the output copies the input; draft: the greedy guesses of --draft-model "
                        "(default: off)")
    s.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens,
                   metavar="K", help="proposed tokens per sequence and step, at most")
    s.add_argument("--ngram-min", type=int, default=SpeculativeConfig.ngram_min)
    s.add_argument("--ngram-max", type=int, default=SpeculativeConfig.ngram_max)
    s.add_argument("--speculative-disable-batch-size", type=int, default=SpeculativeConfig.disable_by_batch_size,
                   metavar="N", help="no proposals in a step with more than N running sequences")
    s.add_argument("--draft-model", default=SpeculativeConfig.draft_model, metavar="MODEL",
                   help="for --speculative-method draft: a model with the same tokenizer (alias, .gguf, HF folder)")
    s.add_argument("--draft-quantization", default=SpeculativeConfig.draft_quantization, choices=QUANTIZATIONS,
                   help="the draft model's weight-only format (it then runs in bfloat16)")


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template to use instead of the model's own (which a base model's GGUF "
                             "lacks: without one, chat requests get 400); applies to every model served")


def _read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path!r} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None


def add_generation_config_args(parser: argparse.ArgumentParser) -> None:
    llama_cpp = ", ".join(f"{k} {v}" for k, v in LLAMA_CPP_SAMPLING_DEFAULTS.items())
    g = parser.add_argument_group("default sampling (for the fields a request leaves out; a request's own win)")
    g.add_argument("--generation-config", default=EngineConfig.generation_config, choices=GENERATION_CONFIG_SOURCES,
                   help="auto: the checkpoint's (a Hugging Face folder's generation_config.json; for a GGUF "
                        f"llama.cpp's defaults, {llama_cpp}, under the file's general.sampling.* metadata); "
                        "vllm: the neutral OpenAI values (temperature 1, no top-p/top-k/min-p cut)")
    g.add_argument("--override-generation-config", type=_json_object, default={}, metavar="JSON",
                   help=f"fields over those, e.g. '{{\"temperature\": 0.5}}' (known: {', '.join(SAMPLING_DEFAULT_FIELDS)}; "
                        "top_k -1, 0 or null: no cut)")


def kv_cache_memory(text: str) -> float | None:
    """--kv-cache-memory: "auto" (None: CacheConfig sizes the pool from free memory) or GiB > 0."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a number of GiB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be auto or a number of GiB > 0, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model = args.model if isinstance(args.model, str) else models_from_args(args)[0]  # serve: the first
    return EngineConfig(
        model=model, dtype=args.dtype, device=args.device, quantization=args.quantization, seed=args.seed,
        enforce_eager=args.enforce_eager, load_read_timeout=args.load_read_timeout,
        # only `serve` has these flags: `generate` and `chat` take their sampling from their own flags
        generation_config=getattr(args, "generation_config", EngineConfig.generation_config),
        override_generation_config=getattr(args, "override_generation_config", {}),
        chat_template=_read_chat_template(getattr(args, "chat_template", None)),  # serve and chat have it
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, priority_aging_s=args.priority_aging),
        speculative=SpeculativeConfig(
            method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
            ngram_min=args.ngram_min, ngram_max=args.ngram_max,
            disable_by_batch_size=args.speculative_disable_batch_size, draft_model=args.draft_model,
            draft_quantization=args.draft_quantization),
        parallel=parallel_config_from(args.tensor_parallel_size, args.pipeline_parallel_size,
                                      args.distributed_timeout, os.environ),
    )


def parallel_config_from(tp: int, pp: int, timeout: float, env) -> ParallelConfig:
    """The sizes from the flags; this rank and the rendezvous from a launcher's environment (torchrun's, or
    the one rank 0 gives the ranks it starts) when there is one."""
    world = int(env.get("WORLD_SIZE", "1"))
    if world == 1:
        return ParallelConfig(tp, pp, timeout_s=timeout)
    if world != tp * pp:
        raise ValueError(f"the launcher started {world} ranks, but --tensor-parallel-size {tp} x "
                         f"--pipeline-parallel-size {pp} is {tp * pp}")
    return ParallelConfig(tp, pp, master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
                          rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                          timeout_s=timeout)


def _named_model(text: str) -> tuple[str | None, str]:
    """NAME=MODEL -> (NAME, MODEL); a MODEL alone (or a path with a '=' in it) -> (None, MODEL)."""
    name, sep, model = text.partition("=")
    if not sep or not name or "/" in name or Path(text).exists():
        return None, text
    return name, model


def models_from_args(args: argparse.Namespace) -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """serve's --model list -> (the first model, its served names, (name, model) of the others)."""
    named = [_named_model(text) for text in (args.model or [EngineConfig.model])]
    first_name, first = named[0]
    names = tuple(args.served_model_name or ()) or ((first_name,) if first_name else ())
    return first, names, tuple((name or model, model) for name, model in named[1:])
