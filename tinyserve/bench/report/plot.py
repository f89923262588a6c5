"""PNG plots of benchmark results, drawn from the JSON records (so a saved run can be re-plotted).

matplotlib is optional (the `bench` extra) and imported only here, only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tinyserve.bench import BenchError


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a BenchError that says how to install it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or pip install 'tinyserve[bench]')") from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    if values:
        xs = np.sort(values)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label} (n={len(xs)})")


def plot_serve(record: dict, path: str | Path) -> Path:
    """Three panels: CDFs of TTFT and end-to-end latency, CDFs of TPOT and ITL, output tokens/s over time."""
    plt = pyplot()
    ok = [r for r in record["requests"] if r["error"] is None]
    fig, (ax_latency, ax_token, ax_time) = plt.subplots(1, 3, figsize=(16, 4.5))
    _cdf(ax_latency, [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None], "TTFT")
    _cdf(ax_latency, [r["e2el_ms"] for r in ok], "end-to-end")
    _cdf(ax_token, [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None], "TPOT")
    _cdf(ax_token, [gap for r in ok for gap in r["itl_ms"]], "ITL")
    for ax, title in ((ax_latency, "Request latency"), (ax_token, "Per-token latency")):
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests / gaps", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend()
    _timeline(ax_time, record)
    config = record["config"]
    fig.suptitle(f"{record['model']} at {config['base_url']}: {len(record['requests'])} requests, "
                 f"concurrency {config['max_concurrency'] or 'unlimited'}, rate {config['request_rate']}")
    return _save(fig, plt, path)


def _timeline(ax, record: dict) -> None:
    """Output tokens/s per bin (left axis) and the requests open at each instant (right axis)."""
    bin_s, rates = record["timeline"]["bin_s"], record["timeline"]["output_tokens_per_s"]
    edges = np.arange(len(rates) + 1) * bin_s
    ax.step(edges, rates + rates[-1:], where="post", color="tab:blue")
    ax.set(title="Throughput over time", xlabel="time since start (s)", ylabel=f"output tokens/s ({bin_s:g} s bins)")
    ax.grid(alpha=0.3)
    events = sorted([(r["start_s"], 1) for r in record["requests"]]
                    + [(r["start_s"] + r["e2el_ms"] / 1000.0, -1) for r in record["requests"]])
    if events:
        twin = ax.twinx()
        twin.step([t for t, _ in events], np.cumsum([d for _, d in events]), where="post", color="tab:orange",
                  alpha=0.7)
        twin.set_ylabel("requests in flight", color="tab:orange")


def plot_sweep(rows: list[dict], path: str | Path) -> Path:
    """Throughput versus latency, one line per server, each point labelled with its concurrency; bars show
    the spread (min to max) over repeated runs."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, latency in zip(axes, ("TPOT p50 ms", "TTFT p50 ms")):
        for label in dict.fromkeys(row["server"] for row in rows):
            points = [row for row in rows if row["server"] == label]
            xs = [row["out tok/s"] for row in points]
            ys = [row[latency] for row in points]
            ax.errorbar([x.median for x in xs], [y.median for y in ys], marker="o", label=label, capsize=3,
                        xerr=_error_bars(xs), yerr=_error_bars(ys))
            for row, x, y in zip(points, xs, ys):
                ax.annotate(f"c={row['concurrency']}", (x.median, y.median), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        ax.set(xlabel="output tokens/s", ylabel=latency.replace(" ms", " (ms)"), title=f"Throughput vs {latency[:4]}")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, plt, path)


def _error_bars(spreads) -> np.ndarray:
    return np.array([[s.median - s.min for s in spreads], [s.max - s.median for s in spreads]])


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
