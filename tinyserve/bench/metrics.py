"""Serving metrics with vLLM's definitions, computed from client-side timestamps only.

Per request: TTFT = first chunk carrying text - request sent; end-to-end latency (E2EL) = end of the
stream - request sent; TPOT = (E2EL - TTFT) / (output tokens - 1), for requests with more than one
output token; ITL = the gaps between consecutive chunks carrying text (a chunk may hold several tokens).
Over a run: TTFT, TPOT and E2EL distributions over successful requests, ITL pooled over all their gaps;
throughputs over the whole run's duration; goodput = successful requests meeting every SLO per second.
A request whose single output token leaves no TPOT meets a TPOT SLO trivially.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    """What the client saw of one request: time.perf_counter() seconds, filled in by the client."""

    prompt_len: int  # tokens, as the dataset counted them
    output_len: int  # max_tokens asked for
    start_time: float = 0.0  # sent (after the concurrency limit let it through)
    end_time: float = 0.0  # stream over ([DONE], or the error)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    usage_completion_tokens: int | None = None  # from the server's usage chunk, when it sent one
    usage_prompt_tokens: int | None = None
    num_output_tokens: int = 0  # the count metrics use: usage, else the text re-tokenized, else chunks
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # None: success; else a short reason key ("http_503", "timeout", ...)
    error_detail: str = ""

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start_time if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end_time - self.start_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens <= 1 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    """Summary of a sample, in milliseconds. count == 0: no sample, and every statistic is 0."""

    count: int
    mean: float
    std: float
    median: float
    p90: float
    p99: float
    max: float
    # the percentiles asked for (ServeBenchConfig.metric_percentiles): "p95" -> ms
    percentiles: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_seconds(cls, values: list[float], percentiles: tuple[float, ...] = ()) -> Distribution:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, {percentile_key(q): 0.0 for q in percentiles})
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])  # linear interpolation, as numpy and vLLM
        asked = {percentile_key(q): float(np.percentile(ms, q)) for q in percentiles}
        return cls(len(ms), float(ms.mean()), float(ms.std()), float(p50), float(p90), float(p99), float(ms.max()),
                   asked)


def percentile_key(q: float) -> str:
    """vLLM's name of a percentile: 95 -> "p95", 99.9 -> "p99.9"."""
    return f"p{q:g}"


@dataclass(frozen=True)
class ServeMetrics:
    duration_s: float
    num_completed: int
    num_failed: int
    failures: dict[str, int]  # reason -> count
    total_input_tokens: int  # over successful requests
    total_output_tokens: int
    request_throughput: float  # successful requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input + output tokens per second
    goodput: float | None  # requests per second meeting every SLO; None without SLOs
    max_concurrent_requests: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.latency}
    for key, limit_ms in slos_ms.items():
        value = measured[key]
        if value is None:
            if key == "tpot":
                continue  # one output token: no time per output token to exceed
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def max_concurrency(results: list[RequestResult]) -> int:
    """The most requests that were open at the same instant (a request ending as another starts counts
    as closed first)."""
    events = sorted([(r.start_time, 1) for r in results] + [(r.end_time, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    peak = open_now = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    return peak


def compute_metrics(results: list[RequestResult], duration_s: float,
                    slos_ms: dict[str, float] | None = None, percentiles: tuple[float, ...] = ()) -> ServeMetrics:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in ok) / duration_s
    return ServeMetrics(
        duration_s=duration_s,
        num_completed=len(ok),
        num_failed=len(results) - len(ok),
        failures=dict(Counter(r.error for r in results if not r.success)),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        goodput=goodput,
        max_concurrent_requests=max_concurrency(results),
        ttft_ms=Distribution.of_seconds([r.ttft for r in ok if r.ttft is not None], percentiles),
        tpot_ms=Distribution.of_seconds(tpots, percentiles),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itls], percentiles),
        e2el_ms=Distribution.of_seconds([r.latency for r in ok], percentiles),
    )


TIMELINE_BINS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def timeline_bin_s(duration_s: float, max_bins: int = 120) -> float:
    """The smallest round bin width that cuts the run into at most max_bins bins."""
    return next((b for b in TIMELINE_BINS_S if duration_s / b <= max_bins), TIMELINE_BINS_S[-1])


def output_token_timeline(results: list[RequestResult], start: float, duration_s: float,
                          bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive bins from `start`. A request's tokens are spread evenly over
    its chunks, since a chunk's own token count is not on the wire."""
    num_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = np.zeros(num_bins)
    for r in results:
        if r.success and r.chunk_times:
            bins = np.minimum(((np.asarray(r.chunk_times) - start) / bin_s).astype(np.int64), num_bins - 1)
            np.add.at(tokens, np.maximum(bins, 0), r.num_output_tokens / len(r.chunk_times))
    return (tokens / bin_s).tolist()


@dataclass(frozen=True)
class Spread:
    """A metric over repeated runs: the median, with the smallest and largest run."""

    median: float
    min: float
    max: float
    num_runs: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one run")
        return cls(float(np.median(values)), float(min(values)), float(max(values)), len(values))

    def __str__(self) -> str:
        if self.num_runs == 1:
            return _short(self.median)
        return f"{_short(self.median)} [{_short(self.min)}-{_short(self.max)}]"


def _short(value: float) -> str:
    """Three or four significant digits: 2693, 31.5, 0.36."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
