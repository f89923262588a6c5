"""The same workload at several concurrencies, against one or more servers, repeated: the points of a
throughput-versus-latency curve. Repeats are the outer loop, so slow drift on a shared machine spreads
over every point instead of landing on the last ones. Each server is warmed up once, before its first point.

Each repeat draws its own prompts (the dataset seed plus the repeat's index), the same for every server
and concurrency within it: with one fixed set, later repeats would find their prompts in the servers'
prefix caches (whichever cache is larger keeps more of them) and measure cache hits, not prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace

from tinyserve.bench.config import SweepConfig
from tinyserve.bench.datasets import SampleRequest
from tinyserve.bench.metrics import ServeMetrics
from tinyserve.bench.report.tables import sweep_rows
from tinyserve.bench.serve import ServeRun, jsonable, run_serve, summary_line


def run_sweep(config: SweepConfig, requests_for_run: Callable[[int], list[SampleRequest]],
              tokenizer=None) -> dict[tuple[str, int], list[ServeRun]]:
    points: dict[tuple[str, int], list[ServeRun]] = {(label, c): [] for label, _ in config.targets
                                                     for c in config.concurrencies}
    is_warm: set[str] = set()
    for run_index in range(config.num_runs):
        requests = requests_for_run(run_index)
        for label, base_url in config.targets:
            for concurrency in config.concurrencies:
                serve = replace(config.serve, base_url=base_url, max_concurrency=concurrency,
                                num_warmups=0 if label in is_warm else config.serve.num_warmups)
                name = f"{label} c={concurrency} run {run_index + 1}/{config.num_runs}"
                points[(label, concurrency)].append(run_serve(serve, requests, tokenizer, label=name))
                is_warm.add(label)
    return points


def sweep_metrics(points: dict[tuple[str, int], list[ServeRun]]) -> dict[tuple[str, int], list[ServeMetrics]]:
    return {key: [run.metrics for run in runs] for key, runs in points.items()}


def sweep_record(config: SweepConfig, points: dict[tuple[str, int], list[ServeRun]]) -> dict:
    rows = sweep_rows(sweep_metrics(points))
    serve_config = asdict(config.serve)
    serve_config.pop("api_key", None)
    return jsonable({
        "kind": "sweep",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "targets": [list(t) for t in config.targets],
        "concurrencies": list(config.concurrencies),
        "num_runs": config.num_runs,
        "workload": serve_config,
        "rows": [{k: asdict(v) if hasattr(v, "median") else v for k, v in row.items()} for row in rows],
        "runs": [summary_line(run) for runs in points.values() for run in runs],
    })
