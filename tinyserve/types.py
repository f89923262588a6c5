"""Shared vocabulary of tinyserve: what a request is, how it should be sampled, what comes back.

Plain data only: no torch device code, no I/O. Every layer may import this module; it imports nothing of ours.
"""

from __future__ import annotations

import concurrent.futures
import enum
import math
import operator
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
# Work done in pieces: each `next` does one piece and yields None, and the generator returns the result.
# Why: a model loads on the step thread of every engine (engine/loop/step_loop.py), which runs one piece of a
# job between rounds of steps, so that the models already serving keep stepping while another loads. A
# piece that waits for work on another thread (a file read, loader/file_reads.py) yields that Future
# instead: whoever runs the job does other work, or waits on it, before the next `next`.
Job = Generator["concurrent.futures.Future | None", None, T]
JOB_WAIT_POLL_S = 0.05  # how long run_to_end waits on a yielded Future before resuming the job


def as_job(fn: Callable[[], T]) -> Job[T]:
    """`fn` as a job of one piece."""
    return fn()
    yield  # NOTE: never reached; it makes this a generator, so that `fn` runs at the first `next`


def run_to_end(job: Job[T]) -> T:
    """All of a job's pieces back to back (whoever has no step loop to share: tinyserve.LLM, tests)."""
    while True:
        try:
            waiting_on = next(job)
        except StopIteration as done:
            return done.value
        if waiting_on is not None:  # resumed now and then: the job keeps its own deadline
            concurrent.futures.wait([waiting_on], timeout=JOB_WAIT_POLL_S)



class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled: client gone, shutdown
    TIMEOUT = "timeout"  # the request's deadline passed (server: its text so far)
    ERROR = "error"  # the engine failed while the request was in flight


class InvalidRequest(ValueError):
    """A request refused for what it asks: `param` names the field (as SamplingParams and the engine call
    it; the server renames it to the client's spelling), `code` is stable for clients, the message says
    why with the numbers. Raised where each rule is checked; nobody parses the message."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    if math.isnan(value) or below or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"{name} must be in {bracket}{low}, {high}], got {value}", param=name)


STRUCTURED_OUTPUT_KINDS = ("json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to a language: a JSON schema (as JSON text; '{"type": "object"}' is OpenAI's
    json_object), a regex, a choice of strings (a JSON list), or a grammar (GBNF as llama.cpp writes it,
    or Lark). Only the text: engine/sampling/structured_output.py compiles it into the token masks."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise InvalidRequest(f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                                 f"got {self.kind!r}", param="structured_output")
        if not isinstance(self.spec, str) or not self.spec:
            raise InvalidRequest(f"the {self.kind} must be a non-empty string", param="structured_output")


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
    # None: none; k: each prompt token's logprob (all but the first, which has no context), rank and the top
    # k, from the model's raw logits. Such a prompt skips the prefix cache: cached tokens have no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # every token is drawn from the grammar's allowed set
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    # derived once here, so that per-token work is a set lookup and a list extend
    stop_token_id_set: frozenset[int] = field(init=False, repr=False, compare=False)
    logit_bias_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    logit_bias_values: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_stops()
        self._check_logit_bias()
        if not 1 <= self.n <= 128:
            raise InvalidRequest(f"n must be in [1, 128], got {self.n}", param="n")
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequest(f"top_k must be >= 1 (or None to disable), got {self.top_k}", param="top_k")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        # max_tokens 0 only scores the prompt: nothing is generated
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise InvalidRequest(f"max_tokens must be >= 1 (or 0 with prompt_logprobs, to score the prompt only), "
                                 f"got {self.max_tokens}", param="max_tokens")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", param="min_tokens")
        for name in ("logprobs", "prompt_logprobs"):  # their caps: RequestLimits.max_logprobs
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidRequest(f"{name} must be >= 0, got {getattr(self, name)}", param=name)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be in [0, 2**63), got {self.seed}", param="seed")

    def _check_stops(self) -> None:
        """Normalizes stop and stop_token_ids to tuples (their counts: RequestLimits.check_sampling)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequest("stop strings must be non-empty strings", param="stop")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        try:
            ids = tuple(operator.index(t) for t in ids)
        except TypeError:
            raise InvalidRequest("stop_token_ids must be integers", param="stop_token_ids") from None
        if any(t < 0 for t in ids):
            raise InvalidRequest(f"stop_token_ids must be token ids >= 0, got {min(ids)}", param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "stop_token_id_set", frozenset(ids))

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias or {}  # its count: RequestLimits.check_sampling
        ids, values = [], []
        for key, value in bias.items():
            try:
                token_id, value = int(key), float(value)
            except (TypeError, ValueError):
                raise InvalidRequest(f"logit_bias must map integer token ids to numbers, got {key!r}",
                                     param="logit_bias") from None
            if token_id < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids >= 0, got {token_id}", param="logit_bias")
            _check_range("logit_bias", value, -100.0, 100.0)
            ids.append(token_id)
            values.append(value)
        object.__setattr__(self, "logit_bias_ids", tuple(ids))
        object.__setattr__(self, "logit_bias_values", tuple(values))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # the top-k alternatives at this position, best first: (token_id, logprob)
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # of token_id in its distribution, 1 = the most likely (prompt tokens only)


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

    request_id: str  # the user's request id (shared by all its prompts and samples)
    index: int  # which sample of its prompt
    new_text: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    error: str | None = None  # set with FinishReason.ERROR
    metrics: RequestMetrics | None = None  # on the final output only
    prompt_index: int = 0  # which prompt of the request (a completion may carry several)
    # with SamplingParams.prompt_logprobs: prompt tokens 1.. (the first has no context), on each sample's first
    # output once the whole prompt is computed
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
