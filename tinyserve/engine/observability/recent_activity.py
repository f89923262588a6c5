"""The engine's recent past, for a live view: one record per step and one per finished sample.

Written on the engine thread (one bounded deque append per step and per finish, nothing more), read from
any thread: `deque.copy()` runs in C under the GIL, so a reader never sees a half-appended record and the
writer never waits for it. Windows (tokens/s, latency percentiles over the last minute) are computed by
the reader, off the step loop.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

MAX_STEP_RECORDS = 8192  # a minute of 7 ms steps; faster steps shorten the window (ActivityWindow.seconds)
MAX_FINISH_RECORDS = 4096


@dataclass(frozen=True)
class StepRecord:
    """One engine step that ran a batch."""

    end_time: float  # time.monotonic()
    duration_s: float
    num_seqs: int  # sequences in the batch
    num_prefill_tokens: int  # tokens of chunks in a prompt or a recompute (LLMEngine.step), not decodes
    num_decode_tokens: int  # tokens of chunks after the prompt (1, or 1 + proposals when speculating)
    num_generated_tokens: int  # tokens appended to outputs this step


@dataclass(frozen=True)
class FinishRecord:
    """One finished sample's latencies (seconds); None where it never got a first token or a second one."""

    finished_time: float  # time.monotonic()
    ttft_s: float | None  # arrival to first token
    tpot_s: float | None  # first token to finish, per output token after the first


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p95: float | None
    p99: float | None


@dataclass(frozen=True)
class ActivityWindow:
    """The last `seconds` (shorter when the engine started less long ago or the records ran out)."""

    seconds: float
    num_steps: int
    num_finished: int
    tokens_per_s: float  # generated tokens per second of wall time
    ttft: Percentiles
    tpot: Percentiles


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..100) of ascending values; None for none."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _percentiles(values: list[float]) -> Percentiles:
    values = sorted(values)
    return Percentiles(percentile(values, 50), percentile(values, 95), percentile(values, 99))


class RecentActivity:
    """Bounded records of recent steps and finishes. The engine thread calls `record_*`; anyone reads."""

    def __init__(self, max_steps: int = MAX_STEP_RECORDS, max_finishes: int = MAX_FINISH_RECORDS):
        self.started_time = time.monotonic()
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        self._finishes: deque[FinishRecord] = deque(maxlen=max_finishes)

    def record_step(self, record: StepRecord) -> None:
        self._steps.append(record)

    def record_finish(self, arrival_time: float, first_token_time: float | None, finished_time: float,
                      num_output_tokens: int) -> None:
        ttft = None if first_token_time is None else first_token_time - arrival_time
        tpot = None
        if first_token_time is not None and num_output_tokens > 1:
            tpot = (finished_time - first_token_time) / (num_output_tokens - 1)
        self._finishes.append(FinishRecord(finished_time, ttft, tpot))

    def recent_steps(self, count: int) -> list[StepRecord]:
        steps = self._steps.copy()
        return list(steps)[-count:] if count else []

    def window(self, seconds: float, now: float | None = None) -> ActivityWindow:
        now = time.monotonic() if now is None else now
        start = max(now - seconds, self.started_time)
        steps = self._steps.copy()
        if len(steps) == steps.maxlen and steps[0].end_time > start:
            start = steps[0].end_time  # the records ran out before the window did
        in_window = [s for s in steps if s.end_time > start]
        finishes = [f for f in self._finishes.copy() if f.finished_time > start]
        span = max(now - start, 1e-9)
        return ActivityWindow(
            seconds=now - start, num_steps=len(in_window), num_finished=len(finishes),
            tokens_per_s=sum(s.num_generated_tokens for s in in_window) / span,
            ttft=_percentiles([f.ttft_s for f in finishes if f.ttft_s is not None]),
            tpot=_percentiles([f.tpot_s for f in finishes if f.tpot_s is not None]))
