"""The `tinyserve` command: with cli_bench.py (the bench subcommands), the only place that parses arguments and
environment variables."""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
from pathlib import Path

from tinyserve.cli_bench import LOG_LEVELS, add_bench_parser
from tinyserve.config import (DEFAULT_MODEL, DTYPES, GENERATION_CONFIG_SOURCES, KV_CACHE_DTYPES,
                              LLAMA_CPP_SAMPLING_DEFAULTS, QUANTIZATION_MODES, QUANTIZATIONS, SAMPLING_DEFAULT_FIELDS,
                              SPECULATIVE_METHODS,
                              CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, ServerConfig,
                              SpeculativeConfig)

# Every default below is read from the config dataclasses (tinyserve/config.py, tinyserve/bench/config.py),
# so that the command line, tinyserve.LLM and the configs cannot drift apart.


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
                        f"{CacheConfig.cpu_kv_cache_memory_gib:g} GiB where that much is left; within "
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


def _chat_template_arg(parser: argparse.ArgumentParser) -> None:
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


def _generation_config_args(parser: argparse.ArgumentParser) -> None:
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
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        _stream(engine, "generate", engine.tokenizer.encode(args.prompt), params)
    finally:
        engine.close()  # tensor / pipeline parallel: send the other ranks home
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _engine(args)
    try:
        _chat_turns(args, engine)
    finally:
        engine.close()  # tensor / pipeline parallel: send the other ranks home
    return 0


def _chat_turns(args: argparse.Namespace, engine) -> None:
    from tinyserve.types import SamplingParams

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


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key-file (its stripped contents), else $TINYSERVE_API_KEY, else None (no authentication).
    Never from the command line itself: arguments are visible to every user in `ps`."""
    if args.api_key is not None:
        raise ValueError("--api-key was removed (a key on the command line is visible in `ps`): "
                         "use --api-key-file PATH or $TINYSERVE_API_KEY")
    if args.api_key_file is None:
        return os.environ.get("TINYSERVE_API_KEY") or None
    path = Path(args.api_key_file)
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a pipe would block the start in read_text
            raise ValueError(f"api_key_file {str(path)!r} is not a regular file")
        key = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ValueError(f"api_key_file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}"
                         ) from None
    if not key:
        raise ValueError(f"api_key_file {str(path)!r} is empty")
    return key


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


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    _, names, models = models_from_args(args)
    return ServerConfig(
        host=args.host, port=args.port, grpc_port=args.grpc_port, served_model_names=names,
        models=models, models_dir=args.models_dir, max_loaded_models=args.max_loaded_models,
        memory_budget_gib=args.memory_budget, idle_unload=args.idle_unload, drain_timeout=args.drain_timeout,
        api_key=api_key_from(args), enable_admin_api=args.enable_admin_api, max_queue=args.max_queue,
        max_n=args.max_n, request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes, allowed_origins=tuple(args.allowed_origins or ()),
        stall_timeout=args.stall_timeout, warmup=not args.no_warmup,
        max_prompts_per_request=args.max_prompts_per_request, max_messages=args.max_messages,
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        allow_unknown_fields=args.allow_unknown_fields,
        stream_write_timeout=args.stream_write_timeout, body_read_timeout=args.body_read_timeout,
        max_connections=args.max_connections, keep_alive_timeout=args.keep_alive_timeout,
        admission=args.admission, target_ttft=None if args.target_ttft is None else args.target_ttft / 1000,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    engine_config = engine_config_from_args(args)
    if engine_config.parallel.rank != 0:  # torchrun started this rank: it computes, rank 0 serves
        from tinyserve.engine.worker import run_worker

        return run_worker(engine_config)
    from tinyserve.server.launcher import serve

    return serve(engine_config, server_config_from_args(args), args.log_level)


def cmd_worker(args: argparse.Namespace) -> int:
    """A rank that `tinyserve serve` (or tinyserve.LLM) started: its engine config and its place in the
    group come in its environment."""
    from dataclasses import replace

    from tinyserve.engine.rank_setup import CONFIG_ENV, config_from_json
    from tinyserve.engine.worker import run_worker

    config = config_from_json(os.environ[CONFIG_ENV])
    parallel = config.parallel
    return run_worker(replace(config, parallel=parallel_config_from(
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.timeout_s, os.environ)))


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                           description="Exit codes: 0 after SIGTERM / SIGINT and a drain (also while the model "
                           "is still loading), 1 if the model or a setting is bad, 3 if the port cannot be "
                           "bound, 128+N when a second signal N cut the drain short.")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default=ServerConfig.host, help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=ServerConfig.port)
    g.add_argument("--grpc-port", type=int, default=ServerConfig.grpc_port, metavar="PORT",
                   help="also serve the gRPC API (README 'gRPC') on --host:PORT, 0 for any free port (default: off)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: --model); the first is reported")
    g.add_argument("--enable-admin-api", action="store_true",
                   help="serve /admin/models/* (load, unload, swap to a path on this machine; README 'Several "
                        "models'); refused without an API key unless --host is loopback (default: off, 404)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer KEY' on the API routes, KEY being this file's stripped "
                        "contents (default: $TINYSERVE_API_KEY; /health, /metrics and /version stay open)")
    # the old flag put the key in `ps`; kept hidden only to refuse it clearly (and so that argparse does not
    # take it as an abbreviation of --api-key-file)
    g.add_argument("--api-key", default=None, help=argparse.SUPPRESS)
    g.add_argument("--max-queue", type=lambda s: None if s.lower() == "none" else int(s),
                   default=ServerConfig.max_queue, metavar="N",
                   help="waiting sequences beyond which new requests get 503 ('none': no limit); "
                        "a request of more samples (prompts x n) than this gets 400")
    g.add_argument("--max-n", type=int, default=ServerConfig.max_n, metavar="N",
                   help="the largest n (samples of each prompt) one request may ask for; more is a 400 "
                        "(default: half of --max-num-seqs, so that one request cannot take every seat)")
    g.add_argument("--admission", choices=("fixed", "adaptive"), default=ServerConfig.admission,
                   help="fixed: up to --max-queue sequences wait; adaptive: the limit follows measured TTFT "
                        "to hold --target-ttft (README 'Admission')")
    g.add_argument("--target-ttft", type=float, default=None, metavar="MS",
                   help="adaptive admission's time-to-first-token target, in milliseconds")
    g.add_argument("--request-timeout", type=float, default=ServerConfig.request_timeout, metavar="S",
                   help="end a request this many seconds after its arrival (finish_reason timeout); caps a "
                        "request's own `timeout` field (default: never)")
    g.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout, metavar="S",
                   help="on SIGTERM/SIGINT, in-flight requests get this long to finish before being aborted; "
                        "a second signal aborts them at once")
    g.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help="larger request bodies get 413")
    g.add_argument("--allowed-origins", nargs="*", default=None, metavar="ORIGIN",
                   help="enable CORS for these origins ('*' for any); off by default")
    g.add_argument("--stall-timeout", type=float, default=ServerConfig.stall_timeout, metavar="S",
                   help="/health is 503 when work is pending and no step has finished for this long")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation before ready")
    m = serve.add_argument_group("several models (README 'Several models')")
    m.add_argument("--models-dir", default=None, metavar="DIR",
                   help="also serve each .gguf file and Hugging Face folder in DIR (by its name), loaded on "
                        "the first request that names it")
    m.add_argument("--max-loaded-models", type=int, default=ServerConfig.max_loaded_models, metavar="N",
                   help="at most N models loaded; loading another unloads the least recently used (default: no limit)")
    m.add_argument("--memory-budget", type=float, default=ServerConfig.memory_budget_gib, metavar="GIB",
                   help="weights + KV pools of the loaded models; each model's KV pool is its share "
                        "(GIB / --max-loaded-models) minus its weights (default: no budget)")
    m.add_argument("--idle-unload", type=float, default=ServerConfig.idle_unload, metavar="S",
                   help="unload a model no request has used for S seconds (default: never)")
    m.add_argument("--drain-timeout", type=float, default=ServerConfig.drain_timeout, metavar="S",
                   help="swap / unload: in-flight requests get this long to finish on the old weights, "
                        "then end with finish_reason abort")
    g.add_argument("--allow-unknown-fields", action="store_true",
                   help="ignore request fields this server does not implement (default: a 400 naming the "
                        "field, code unknown_parameter), for clients that send other servers' extras")
    limits = serve.add_argument_group("request and connection limits")
    limits.add_argument("--max-prompts-per-request", type=int, default=ServerConfig.max_prompts_per_request,
                        metavar="N",
                        help="prompts in one completion request; more get 400")
    limits.add_argument("--max-messages", type=int, default=ServerConfig.max_messages, metavar="N",
                        help="messages in one chat request; more get 400")
    limits.add_argument("--allow-special-tokens-in-messages", action="store_true",
                        help="render special-token text in chat messages (e.g. '<|im_start|>') as control "
                             "tokens instead of plain text: trusted clients only, it lets a message forge turns")
    limits.add_argument("--stream-write-timeout", type=float, default=ServerConfig.stream_write_timeout,
                        metavar="S",
                        help="a stream whose client reads nothing for this long is aborted")
    limits.add_argument("--body-read-timeout", type=float, default=ServerConfig.body_read_timeout, metavar="S",
                        help="a request's headers, and then its body, must arrive within this long (else the "
                             "connection is closed; a late body gets 408)")
    limits.add_argument("--max-connections", type=int, default=ServerConfig.max_connections, metavar="N",
                        help="concurrent connections; requests beyond it get 503")
    limits.add_argument("--keep-alive-timeout", type=float, default=ServerConfig.keep_alive_timeout, metavar="S",
                        help="close a connection that has sent nothing for this long between requests")
    add_engine_args(serve, several_models=True)
    _chat_template_arg(serve)
    _generation_config_args(serve)
    serve.set_defaults(func=cmd_serve, log_level="info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyserve", description="An LLM inference server from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="complete one prompt and print it as it streams")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    _chat_template_arg(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    add_bench_parser(sub)
    worker = sub.add_parser("worker", help="(internal) a tensor / pipeline parallel rank that `serve` starts")
    worker.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    worker.set_defaults(func=cmd_worker)
    return parser


def _set_threads(threads: int | None) -> None:
    """One process-wide setting: our kernels run on torch's OpenMP pool (they are linked against it)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tinyserve.loader.errors import ModelLoadError

    try:
        _set_threads(getattr(args, "threads", None))
        return args.func(args)
    except (ModelLoadError, ValueError) as exc:  # bad model file or setting: one clear line, no traceback
        print(f"tinyserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
