"""Shared vocabulary of tinyserve: what a request is, how it should be sampled, what comes back.

Plain data only: no torch device code, no I/O. Every layer may import this module; it imports nothing of ours.
"""

from __future__ import annotations

import enum
import math
import operator
import time
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
# Per-request caps: the engine thread does work in proportion to each of these on every token
# (stop-string matching, the stop-id set, the logit_bias scatter), so one body must not choose them.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled: client gone, timeout, shutdown
    ERROR = "error"  # the engine failed while the request was in flight


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # holds KV blocks, scheduled every step
    FINISHED = "finished"  # blocks freed, finish_reason set


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    if math.isnan(value) or below or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction (ValueError names the field)."""

    n: int = 1  # independent samples of the same prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output tokens (as transformers)
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI-style, over output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist
    stop: tuple[str, ...] = ()  # the returned text ends before the first stop string
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's logprob and the top k
    skip_special_tokens: bool = True
    # derived once here, so that per-token work is a set lookup and a list extend
    stop_token_id_set: frozenset[int] = field(init=False, repr=False, compare=False)
    logit_bias_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    logit_bias_values: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_stops()
        self._check_logit_bias()
        if not 1 <= self.n <= 128:
            raise ValueError(f"n must be in [1, 128], got {self.n}")
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None to disable), got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def _check_stops(self) -> None:
        """Normalizes stop and stop_token_ids to tuples; counts are checked before any per-entry work."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        if max(map(len, stop), default=0) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        try:
            ids = tuple(operator.index(t) for t in ids)
        except TypeError:
            raise ValueError("stop_token_ids must be integers") from None
        if any(t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {min(ids)}")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "stop_token_id_set", frozenset(ids))

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        ids, values = [], []
        for key, value in bias.items():
            try:
                token_id, value = int(key), float(value)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map integer token ids to numbers, got {key!r}") from None
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id}")
            _check_range("logit_bias", value, -100.0, 100.0)
            ids.append(token_id)
            values.append(value)
        object.__setattr__(self, "logit_bias_ids", tuple(ids))
        object.__setattr__(self, "logit_bias_values", tuple(values))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One sequence the engine generates. A prompt with n > 1 becomes n Requests (index 0..n-1).

    Invariants: num_computed_tokens <= num_tokens; a WAITING request holds no KV blocks (the block
    manager owns the block table, keyed by request_id); token ids only grow, except that preemption
    resets num_computed_tokens to 0 (recompute: no token is lost).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first; FCFS among equals
    index: int = 0  # which of the n samples this is
    parent_id: str | None = None  # for index > 0: the sibling (index 0) whose prompt blocks it shares
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int | None = None  # prompt + output may not exceed this (the model's context)
    # prefix-cache namespace: blocks are shared only between requests with the same salt (None: the
    # shared cache); n > 1 samples carry their parent's salt
    cache_salt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one step; the model runner executes exactly this."""

    # (request, number of new tokens to compute this step), decodes first, then prefill chunks.
    # A request's new tokens are all_token_ids[num_computed_tokens : num_computed_tokens + n].
    # A request whose chunk reaches its last known token gets one sampled token; others (mid-prompt) none.
    scheduled: list[tuple[Request, int]]
    num_batched_tokens: int = 0  # sum of the n's above, <= max_num_batched_tokens
    preempted_ids: list[str] = field(default_factory=list)  # sent back to waiting this step (recompute)
    # finished outside update_from_output since the last step (abort, finish_request, or LENGTH when a
    # request outgrew the whole KV cache), blocks already freed: the runner drops their per-request state
    finished_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # the top-k alternatives at this position, best first: (token_id, logprob)
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestMetrics:
    """Timings of one finished sample (time.monotonic seconds); None where the request never got there."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0


@dataclass(frozen=True)
class RequestOutput:
    """One increment of one sample of one request, engine -> server. The last one has finish_reason set."""

    request_id: str  # the user's request id (shared by its n samples)
    index: int  # which sample
    new_text: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    error: str | None = None  # set with FinishReason.ERROR
    metrics: RequestMetrics | None = None  # on the final output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
