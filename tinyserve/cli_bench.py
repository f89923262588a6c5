"""The `tinyserve bench` subcommands' arguments (cli.py adds them): the load generator, sweeps, offline runs."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tinyserve.bench.config import (DATASET_NAMES, DEFAULT_OUTPUT_LEN, PERCENTILE_METRICS, DatasetConfig,
                                    OFFLINE_DTYPE, OfflineBenchConfig, ServeBenchConfig, SweepConfig)
from tinyserve.cli_engine import LOG_LEVELS, add_engine_args, engine_config_from_args
from tinyserve.config import DEFAULT_MODEL


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
        engine_config_from_args(args), num_prompts=args.num_prompts,
        input_len_range=tuple(args.input_len_range), output_len_range=tuple(args.output_len_range),
        seed=args.seed,
    )
    return bench_offline(config, args.result_file)


def add_bench_parser(sub) -> None:
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
    offline.set_defaults(func=cmd_bench_offline, dtype=OFFLINE_DTYPE)


