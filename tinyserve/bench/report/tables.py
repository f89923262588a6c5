"""Human-readable summaries: one serve run, and the sweep's throughput-versus-latency table."""

from __future__ import annotations

import math

from tinyserve.bench.metrics import Distribution, ServeMetrics, Spread

WIDTH = 60


def _row(name: str, value) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<44}{value:>16}"


def _distribution_rows(name: str, d: Distribution) -> list[str]:
    """Mean and median, then the percentiles asked for (vLLM's --metric-percentiles), else P90 and P99."""
    rows = [_row(f"Mean {name} (ms):", d.mean), _row(f"Median {name} (ms):", d.median)]
    if d.percentiles:
        return rows + [_row(f"{key.upper()} {name} (ms):", value) for key, value in d.percentiles.items()]
    return rows + [_row(f"P90 {name} (ms):", d.p90), _row(f"P99 {name} (ms):", d.p99)]


def serve_summary(metrics: ServeMetrics, *, model: str, base_url: str, max_concurrency: int | None,
                  request_rate: float, client_cpu_s: float, client_cpu_share: float,
                  percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")) -> str:
    m = metrics
    failures = ", ".join(f"{reason}: {n}" for reason, n in sorted(m.failures.items())) or "-"
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:g}"
    lines = [
        " Serving benchmark ".center(WIDTH, "="),
        _row("Server:", base_url), _row("Model:", model),
        _row("Max concurrency:", max_concurrency or "none"), _row("Request rate (req/s):", rate),
        _row("Successful requests:", m.num_completed), _row("Failed requests:", m.num_failed),
        _row("Failures by reason:", failures),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input_tokens), _row("Total output tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_token_throughput),
        _row("Peak concurrent requests:", m.max_concurrent_requests),
    ]
    if m.goodput is not None:
        lines.append(_row("Goodput (req/s):", m.goodput))
    for title, name, d in (("Time to first token", "TTFT", m.ttft_ms),
                           ("Time per output token (excl. 1st)", "TPOT", m.tpot_ms),
                           ("Inter-token latency", "ITL", m.itl_ms), ("End-to-end latency", "E2EL", m.e2el_ms)):
        if name.lower() in percentile_metrics:
            lines += [f" {title} ".center(WIDTH, "-"), *_distribution_rows(name, d)]
    lines += [" Load generator ".center(WIDTH, "-"),
              _row("Client CPU (s):", client_cpu_s),
              _row("Client CPU share (of one core):", f"{100 * client_cpu_share:.1f}%"),
              "=" * WIDTH]
    return "\n".join(lines)


SWEEP_COLUMNS = (  # header, getter on ServeMetrics
    ("req/s", lambda m: m.request_throughput),
    ("out tok/s", lambda m: m.output_throughput),
    ("TTFT p50 ms", lambda m: m.ttft_ms.median),
    ("TTFT p99 ms", lambda m: m.ttft_ms.p99),
    ("TPOT p50 ms", lambda m: m.tpot_ms.median),
    ("TPOT p99 ms", lambda m: m.tpot_ms.p99),
    ("ITL p50 ms", lambda m: m.itl_ms.median),
    ("ITL p99 ms", lambda m: m.itl_ms.p99),  # what a running stream feels when a prefill shares its step
    ("E2EL p50 ms", lambda m: m.e2el_ms.median),
)


def sweep_rows(points: dict[tuple[str, int], list[ServeMetrics]]) -> list[dict]:
    """One row per (server, concurrency): each column's Spread over the repeated runs, and the failed
    requests of all runs together."""
    rows = []
    for (label, concurrency), runs in points.items():
        row = {"server": label, "concurrency": concurrency}
        row.update({header: Spread.of([get(m) for m in runs]) for header, get in SWEEP_COLUMNS})
        row["failed"] = sum(m.num_failed for m in runs)
        rows.append(row)
    return rows


def sweep_table(rows: list[dict]) -> str:
    """A Markdown table (it pastes into a README as is)."""
    headers = ["server", "concurrency", *(h for h, _ in SWEEP_COLUMNS), "failed"]
    cells = [[str(row[h]) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    fmt = lambda values: "| " + " | ".join(v.rjust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, cells)])
