"""The `tinyserve` command: the only place that parses arguments and environment variables."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tinyserve.bench.config import (DATASET_NAMES, DEFAULT_OUTPUT_LEN, PERCENTILE_METRICS, DatasetConfig,
                                    OfflineBenchConfig, ServeBenchConfig, SweepConfig)
from tinyserve.config import (DEFAULT_MODEL, DTYPES, GENERATION_CONFIG_SOURCES, LLAMA_CPP_SAMPLING_DEFAULTS,
                              QUANTIZATIONS, SAMPLING_DEFAULT_FIELDS, SPECULATIVE_METHODS, CacheConfig, EngineConfig,
                              SchedulerConfig, ServerConfig, SpeculativeConfig)

# Every default below is read from the config dataclasses (tinyserve/config.py, tinyserve/bench/config.py),
# so that the command line, tinyserve.LLM and the configs cannot drift apart.
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
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU compute threads of torch and our kernels (default: torch's, one per physical core)")
    g.add_argument("--quantization", default=EngineConfig.quantization, choices=QUANTIZATIONS,
                   help="weight-only quantization on CPU (bfloat16 activations): faster single-stream decode, "
                        "slower at large batches; see README 'Speed modes'")
    g.add_argument("--kv-cache-memory", type=float, default=CacheConfig.kv_cache_memory_gib, metavar="GIB",
                   help=f"KV cache budget in GiB (default: {CacheConfig.cpu_kv_cache_memory_gib:g} GiB on CPU, "
                        f"{CacheConfig.memory_fraction:.0%}% of the free memory on CUDA)")  # "%%": argparse %-formats help
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=SchedulerConfig.max_model_len)
    g.add_argument("--priority-aging", type=float, default=SchedulerConfig.priority_aging_s, metavar="S",
                   help="seconds of waiting worth one priority level: a request is overtaken or preempted by "
                        "better priorities for at most S x their gap (default %(default)g)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=EngineConfig.seed)
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
        # only `serve` has these flags: `generate` and `chat` take their sampling from their own flags
        generation_config=getattr(args, "generation_config", EngineConfig.generation_config),
        override_generation_config=getattr(args, "override_generation_config", {}),
        chat_template=_read_chat_template(getattr(args, "chat_template", None)),  # serve and chat have it
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, priority_aging_s=args.priority_aging),
        speculative=SpeculativeConfig(
            method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
            ngram_min=args.ngram_min, ngram_max=args.ngram_max,
            disable_by_batch_size=args.speculative_disable_batch_size, draft_model=args.draft_model,
            draft_quantization=args.draft_quantization),
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


def _bench_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    # the second name of a flag is vLLM's (`vllm bench serve`), so its command lines run unchanged
    g.add_argument("--dataset", "--dataset-name", default=DatasetConfig.name, choices=DATASET_NAMES,
                   type=lambda s: s.replace("_", "-"))  # vLLM spells prefix_repetition
    g.add_argument("--dataset-path", default=DatasetConfig.path, help="sharegpt: a JSON list of conversations")
    g.add_argument("--num-prompts", type=int, default=DatasetConfig.num_prompts)
    g.add_argument("--input-len", "--random-input-len", type=int, default=DatasetConfig.input_len,
                   help="tokens of the random part (random) or of each suffix (prefix-repetition)")
    g.add_argument("--output-len", "--random-output-len", type=int, default=DatasetConfig.output_len,
                   help=f"max_tokens per request (default {DEFAULT_OUTPUT_LEN}; sharegpt: the recorded reply's "
                        "length)")
    g.add_argument("--range-ratio", "--random-range-ratio", type=float, default=DatasetConfig.range_ratio,
                   help="lengths vary in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", "--random-prefix-len", type=int, default=DatasetConfig.prefix_len,
                   help="tokens of the shared prefix (of each prefix)")
    g.add_argument("--num-prefixes", type=int, default=DatasetConfig.num_prefixes,
                   help="prefix-repetition: distinct prefixes")
    g.add_argument("--tokenizer", default=None,
                   help="counts prompt tokens: alias, .gguf or HF folder (default: --model if local, else "
                        f"{DEFAULT_MODEL})")
    g.add_argument("--seed", type=int, default=DatasetConfig.seed, help="dataset and arrival times")
    c = parser.add_argument_group("client")
    c.add_argument("--endpoint", default=ServeBenchConfig.endpoint, help="/v1/completions or /v1/chat/completions")
    c.add_argument("--backend", choices=("http", "grpc", "openai", "vllm"), default=ServeBenchConfig.backend,
                   help="grpc: tinyserve's gRPC GenerateStream at --grpc-target (completions only); vLLM's openai / vllm mean http")
    c.add_argument("--grpc-target", default=ServeBenchConfig.grpc_target, metavar="HOST:PORT")
    c.add_argument("--model", default=ServeBenchConfig.model,
                   help="model name sent (default: the first of GET /v1/models)")
    c.add_argument("--request-rate", type=float, default=ServeBenchConfig.request_rate,
                   help=f"requests/s, Poisson (default {ServeBenchConfig.request_rate:g})")
    c.add_argument("--burstiness", type=float, default=ServeBenchConfig.burstiness,
                   help="gamma shape of arrivals; 1 is Poisson")
    c.add_argument("--num-warmups", type=int, default=ServeBenchConfig.num_warmups,
                   help="requests sent first and not measured")
    c.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    c.add_argument("--temperature", type=float, default=ServeBenchConfig.temperature)
    c.add_argument("--extra-body", type=json.loads, default=ServeBenchConfig.extra_body,
                   help="JSON merged into every request")
    c.add_argument("--timeout", type=float, default=ServeBenchConfig.timeout_s, help="seconds per request read")
    c.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    c.add_argument("--no-progress", "--disable-tqdm", action="store_true")
    c.add_argument("--result-file", type=Path, default=None, help="JSON result (default: bench-results/)")
    c.add_argument("--result-dir", type=Path, default=None, help="folder of the default result file (vLLM's)")
    c.add_argument("--save-result", action="store_true", help="accepted for vLLM: the result is always saved")
    c.add_argument("--percentile-metrics", type=_csv(str), default=PERCENTILE_METRICS, metavar="ttft,tpot,itl,e2el",
                   help="the metrics whose percentiles the summary shows (vLLM's)")
    c.add_argument("--metric-percentiles", type=_csv(float), default=(), metavar="50,95,99",
                   help="the percentiles shown (and p<q>_<metric>_ms in the JSON line); default median, P90, P99")
    c.add_argument("--plot", nargs="?", const="auto", default=None, metavar="PNG",
                   help="write a PNG (default: next to the result file); needs matplotlib")
    c.add_argument("--log-level", default="warning", choices=LOG_LEVELS)


def _csv(item_type):
    return lambda text: tuple(item_type(item) for item in text.split(",") if item.strip())


def _serve_bench_config(args: argparse.Namespace, base_url: str) -> ServeBenchConfig:
    from tinyserve.bench.datasets import tokenizer_for

    dataset = DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, seed=args.seed, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, path=args.dataset_path, tokenizer=args.tokenizer or tokenizer_for(args.model),
    )
    slos = {}
    for item in args.goodput:
        key, sep, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes KEY:MS pairs (ttft, tpot, e2el), got {item!r}") from None
    return ServeBenchConfig(
        base_url=base_url, endpoint=args.endpoint, backend="grpc" if args.backend == "grpc" else "http", grpc_target=args.grpc_target,
        model=args.model, dataset=dataset,
        max_concurrency=getattr(args, "max_concurrency", None), request_rate=args.request_rate,
        burstiness=args.burstiness, seed=args.seed, num_warmups=args.num_warmups, ignore_eos=args.ignore_eos,
        temperature=args.temperature, extra_body=args.extra_body, api_key=os.environ.get("OPENAI_API_KEY"),
        timeout_s=args.timeout, goodput_slos_ms=slos, show_progress=not args.no_progress,
        percentile_metrics=args.percentile_metrics, metric_percentiles=args.metric_percentiles,
    )


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tinyserve.bench.commands import bench_serve, default_result_file

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    result_file = args.result_file or (args.result_dir and default_result_file("serve", args.result_dir))
    return bench_serve(_serve_bench_config(args, base_url), result_file, args.plot)


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    from tinyserve.bench.commands import bench_sweep, default_result_file

    urls = args.base_url or [ServeBenchConfig.base_url]
    targets = tuple((u.partition("=")[0], u.partition("=")[2]) if "=" in u else (u, u) for u in urls)
    config = SweepConfig(_serve_bench_config(args, targets[0][1]), targets, tuple(args.concurrency), args.num_runs)
    result_file = args.result_file or (args.result_dir and default_result_file("sweep", args.result_dir))
    return bench_sweep(config, result_file, args.plot)


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from tinyserve.bench.commands import bench_offline

    config = OfflineBenchConfig(
        model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        num_prompts=args.num_prompts,
        input_len_range=tuple(args.input_len_range), output_len_range=tuple(args.output_len_range),
        seed=args.seed, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gib=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
    )
    return bench_offline(config, args.result_file)


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark a server (serve, sweep) or the engine alone (offline)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="load-test any OpenAI-compatible server with streamed requests")
    serve.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    serve.add_argument("--host", default="127.0.0.1", help="with --port, the server when --base-url is not given")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-concurrency", type=int, default=ServeBenchConfig.max_concurrency)
    _bench_workload_args(serve)
    serve.set_defaults(func=cmd_bench_serve)
    sweep = kinds.add_parser("sweep", help="one workload at several concurrencies: throughput vs latency")
    sweep.add_argument("--base-url", action="append", metavar="[LABEL=]URL",
                       help=f"a server to compare (repeat for several; default {ServeBenchConfig.base_url})")
    sweep.add_argument("--concurrency", type=int, nargs="+", default=list(SweepConfig.concurrencies))
    sweep.add_argument("--num-runs", type=int, default=SweepConfig.num_runs,
                       help="repeats; tables show median [min-max]")
    _bench_workload_args(sweep)
    sweep.set_defaults(func=cmd_bench_sweep)
    offline = kinds.add_parser("offline", help="the engine alone: random prompts, ignore_eos, all at once")
    add_engine_args(offline)
    offline.add_argument("--num-prompts", type=int, default=OfflineBenchConfig.num_prompts)
    offline.add_argument("--input-len-range", type=int, nargs=2, default=list(OfflineBenchConfig.input_len_range),
                         metavar=("MIN", "MAX"))
    offline.add_argument("--output-len-range", type=int, nargs=2,
                         default=list(OfflineBenchConfig.output_len_range), metavar=("MIN", "MAX"))
    offline.add_argument("--result-file", type=Path, default=None)
    offline.set_defaults(func=cmd_bench_offline, dtype=OfflineBenchConfig.dtype)


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
        api_key=api_key_from(args), max_queue=args.max_queue,
        request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
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
    from tinyserve.server.launcher import serve

    return serve(engine_config_from_args(args), server_config_from_args(args), args.log_level)


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
    _add_bench_parser(sub)
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
