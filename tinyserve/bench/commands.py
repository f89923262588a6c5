"""What `tinyserve bench serve|sweep|offline` do once cli.py has built their configs: build the workload,
run it, print a human summary and one JSON line on stdout, write the JSON result file, plot on request.
Each returns the process exit status; a BenchError becomes one line on stderr and status 1.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from tinyserve.bench import BenchError
from tinyserve.bench.config import OfflineBenchConfig, ServeBenchConfig, SweepConfig

DEFAULT_RESULT_DIR = Path("bench-results")


def _reports_errors(command):
    @functools.wraps(command)
    def wrapper(*args, **kwargs) -> int:
        try:
            return command(*args, **kwargs)
        except BenchError as exc:
            print(f"tinyserve bench: error: {exc}", file=sys.stderr)
            return 1

    return wrapper


def default_result_file(kind: str, directory: Path = DEFAULT_RESULT_DIR) -> Path:
    return directory / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _plot_path(plot: str | None, result_file: Path) -> Path | None:
    """--plot alone puts the PNG next to the result file; --plot PATH puts it there."""
    if plot is None:
        return None
    return result_file.with_suffix(".png") if plot == "auto" else Path(plot)


def _write_json(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _require_httpx() -> None:
    try:
        import httpx  # noqa: F401
    except ImportError as exc:
        raise BenchError("the load generator needs httpx: pip install httpx (or 'tinyserve[bench]')") from exc


def _workload(config: ServeBenchConfig):
    from tinyserve.bench.datasets import build_requests, load_tokenizer

    tokenizer = load_tokenizer(config.dataset.tokenizer)
    requests = build_requests(config.dataset, tokenizer)
    lens = [r.prompt_len for r in requests]
    print(f"workload: {len(requests)} {config.dataset.name} prompts of {min(lens)}-{max(lens)} tokens "
          f"(counted by the {config.dataset.tokenizer} tokenizer)", file=sys.stderr)
    return requests, tokenizer


@_reports_errors
def bench_serve(config: ServeBenchConfig, result_file: Path | None = None, plot: str | None = None) -> int:
    _require_httpx()
    from tinyserve.bench.report.tables import serve_summary
    from tinyserve.bench.serve import run_record, run_serve, summary_line

    result_file = result_file or default_result_file("serve")
    plot_path = _plot_path(plot, result_file)
    if plot_path is not None:
        from tinyserve.bench.report.plot import pyplot

        pyplot()  # a missing matplotlib fails now, not after a long run
    requests, tokenizer = _workload(config)
    run = run_serve(config, requests, tokenizer)
    print(serve_summary(run.metrics, model=run.model, base_url=config.base_url,
                        max_concurrency=config.max_concurrency, request_rate=config.request_rate,
                        client_cpu_s=run.client_cpu_s, client_cpu_share=run.client_cpu_share,
                        percentile_metrics=config.percentile_metrics))
    _warn_if_client_bound(run.client_cpu_share)
    record = run_record(run)
    _write_json(record, result_file)
    line = summary_line(run) | {"result_file": str(result_file)}
    if plot_path is not None:
        from tinyserve.bench.report.plot import plot_serve

        line["plot"] = str(plot_serve(record, plot_path))
    print(json.dumps(line))
    return 0 if run.metrics.num_completed else 1


def _warn_if_client_bound(share: float) -> None:
    from tinyserve.bench.serve import CLIENT_BOTTLENECK_SHARE

    if share > CLIENT_BOTTLENECK_SHARE:
        print(f"warning: the load generator used {100 * share:.0f}% of a core: it may be the bottleneck",
              file=sys.stderr)


@_reports_errors
def bench_sweep(config: SweepConfig, result_file: Path | None = None, plot: str | None = None) -> int:
    _require_httpx()
    from tinyserve.bench.report.tables import sweep_rows, sweep_table
    from tinyserve.bench.sweep import run_sweep, sweep_metrics, sweep_record

    result_file = result_file or default_result_file("sweep")
    plot_path = _plot_path(plot, result_file)
    if plot_path is not None:
        from tinyserve.bench.report.plot import pyplot

        pyplot()
    from tinyserve.bench.datasets import build_requests

    first, tokenizer = _workload(config.serve)
    dataset = config.serve.dataset
    points = run_sweep(config, lambda run: first if run == 0 else build_requests(
        replace(dataset, seed=dataset.seed + run), tokenizer), tokenizer)
    rows = sweep_rows(sweep_metrics(points))
    print(sweep_table(rows))
    record = sweep_record(config, points)
    for runs in points.values():
        _warn_if_client_bound(max(run.client_cpu_share for run in runs))
    _write_json(record, result_file)
    line = {"bench": "sweep", "result_file": str(result_file), "num_runs": config.num_runs,
            "rows": [{"server": r["server"], "concurrency": r["concurrency"], "failed": r["failed"],
                      **{k: round(r[k].median, 2) for k in ("out tok/s", "TTFT p50 ms", "TPOT p50 ms")}}
                     for r in rows]}
    if plot_path is not None:
        from tinyserve.bench.report.plot import plot_sweep

        line["plot"] = str(plot_sweep(rows, plot_path))
    print(json.dumps(line))
    return 0


@_reports_errors
def bench_offline(config: OfflineBenchConfig, result_file: Path | None = None) -> int:
    from tinyserve.bench.offline import run_offline

    record = run_offline(config)
    print(f"tinyserve offline: {record['num_prompts']} prompts, {record['output_tokens']} output tokens in "
          f"{record['elapsed_s']:.1f}s = {record['output_tokens_per_s']:.1f} tok/s "
          f"(peak RSS {record['peak_rss_mib']:.0f} MiB)", file=sys.stderr)
    if result_file is not None:
        _write_json(record, result_file)
    print(json.dumps(record))
    return 0
