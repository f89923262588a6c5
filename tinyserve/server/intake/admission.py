"""Adaptive admission (`--admission adaptive --target-ttft MS`): how many samples a model lets wait.

The fixed queue (`--max-queue`) admits until that many samples wait, so under overload every admitted
request waits for the whole queue ahead of it: its time to first token grows with the queue, not with the
work. Here the limit is on the samples admitted and still without their first token (queued, or seated
with their prompt still computing: free seats are no exception, since 64 prompts admitted at once into 64
seats wait for each other's prefill), which by Little's law is the drain rate times the TTFT, and it
follows what clients see. Each request's first token reports its TTFT; a TTFT over
the target cuts the limit by DECREASE_FACTOR (at most once per target interval, so one burst of late
tokens, all caused by the same queue, counts once), and each TTFT under half of it adds 1 / limit (one
slot per limit's worth of good answers: TCP's congestion avoidance); in between the limit holds. A TTFT
arrives only once the wait is over, so
an admission that finds the oldest pending request already waiting past the target counts that as a miss
at once, without waiting for its token. This is AIMD, as in Netflix's
concurrency-limits: it needs no model of the step time or the prompt mix, it converges to a fair share
when several models share the CPU, and its one signal is the bar it must hold. (A gradient rule, which
compares a short and a long average latency, would not need a target, but this server's users state one.)

A request over the limit gets 503 before it is parsed or tokenized, with a Retry-After of the time the
samples pending now need to start at the measured drain rate (first tokens per second).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

DECREASE_FACTOR = 0.7
# only a TTFT with this much headroom adds to the limit; between it and the target the limit holds. Raising
# on every TTFT under the target let the pending prefills grow until they missed it, and the misses of
# that queue are the p99 (docs/PERFORMANCE.md, "Admission under overload").
INCREASE_BELOW = 0.5
MIN_LIMIT = 1.0  # one sample may always be pending: admission never closes completely
INITIAL_LIMIT = 4.0  # start low: the first TTFTs come only after the first admissions have waited
RATE_HALF_LIFE_S = 10.0  # of the drain-rate average
MAX_RETRY_AFTER_S = 60


class AdaptiveAdmission:
    """The limit on waiting samples for one model, moved by its TTFTs. Event loop only."""

    def __init__(self, target_ttft_s: float, max_limit: int | None,
                 on_limit: Callable[[float], None] = lambda limit: None,
                 clock: Callable[[], float] = time.monotonic):
        self.target_ttft_s = target_ttft_s
        self.max_limit = float(max_limit) if max_limit is not None else math.inf
        self.limit = min(INITIAL_LIMIT, self.max_limit)
        self.num_pending = 0  # samples admitted without their first token yet (AdmissionTicket)
        self._pending: dict[AdmissionTicket, float] = {}  # ticket -> admission time, oldest first
        self.num_increases = self.num_decreases = 0
        self._on_limit, self._clock = on_limit, clock
        self._last_decrease = -math.inf
        self._rate = 0.0  # first tokens per second, exponentially averaged
        self._last_event: float | None = None
        on_limit(self.limit)

    def observe(self, ttft_s: float) -> None:
        """One request's first token came `ttft_s` after its arrival."""
        now = self._clock()
        self._count_drain(now)
        if ttft_s > self.target_ttft_s:
            self._decrease(now)
        elif ttft_s <= self.target_ttft_s * INCREASE_BELOW and self.limit < self.max_limit:
            self.limit = min(self.max_limit, self.limit + 1.0 / self.limit)
            self.num_increases += 1
            self._on_limit(self.limit)

    def _decrease(self, now: float) -> None:
        if now - self._last_decrease >= self.target_ttft_s:
            self._last_decrease = now
            self.limit = max(MIN_LIMIT, self.limit * DECREASE_FACTOR)
            self.num_decreases += 1
            self._on_limit(self.limit)

    def admits(self, num_samples: int) -> bool:
        """Whether `num_samples` more may be pending beside those pending now. A request of more samples
        than the limit is admitted alone, when nothing else is pending: it cannot fit otherwise."""
        if not self.num_pending:
            return True
        now = self._clock()
        if now - next(iter(self._pending.values())) > self.target_ttft_s:  # a miss already, token or not
            self._decrease(now)
        return self.num_pending + num_samples <= self.limit

    def ticket(self, num_samples: int) -> AdmissionTicket:
        ticket = AdmissionTicket(self, num_samples)
        self._pending[ticket] = self._clock()
        return ticket

    def retry_after(self) -> int:
        """Seconds until the samples pending now have started, at the measured drain rate."""
        rate = self._decayed_rate(self._clock())
        if rate <= 0:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(max(self.num_pending, 1) / rate)))

    def _count_drain(self, now: float) -> None:
        self._rate = self._decayed_rate(now) + math.log(2) / RATE_HALF_LIFE_S
        self._last_event = now

    def _decayed_rate(self, now: float) -> float:
        """An exponentially weighted event rate: each event adds ln 2 / half-life, which decays with it."""
        if self._last_event is None:
            return 0.0
        return self._rate * 0.5 ** ((now - self._last_event) / RATE_HALF_LIFE_S)


class AdmissionTicket:
    """One admitted request's samples, pending from admission until its first token (or its end)."""

    def __init__(self, admission: AdaptiveAdmission, num_samples: int):
        self._admission, self._num_samples = admission, num_samples
        self._is_pending = True
        admission.num_pending += num_samples

    def first_token(self, ttft_s: float) -> None:
        if self._leave_pending():
            self._admission.observe(ttft_s)

    def close(self) -> None:
        """The request ended (or failed to start); without a first token its wait is no TTFT."""
        self._leave_pending()

    def _leave_pending(self) -> bool:
        if not self._is_pending:
            return False
        self._is_pending = False
        self._admission.num_pending -= self._num_samples
        self._admission._pending.pop(self, None)
        return True
