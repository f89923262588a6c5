"""A request inside the engine: one sequence being generated, and everything the engine holds for it.

Identity is structured: a user request id, the index of its prompt (a completion may carry several) and
the index of the sample (n > 1). Nothing is keyed by a string built from them; the engine's components
hold Request objects (compared by identity), and each piece of per-sequence state lives on the Request
itself: the block table and its hashes (BlockManager), the seeded generator (Sampler), the grammar
matcher (engine/sampling/structured_output.py), the incremental detokenizer (LLMEngine), the timings. `LLMEngine`
owns every unfinished Request through its RequestGroup and ends each one in one place
(`LLMEngine._end_request`), which drops all of that state at once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyserve.types import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

    from tinyserve.engine.loop.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (or paused), holds no KV blocks
    RUNNING = "running"  # holds KV blocks, scheduled every step
    FINISHED = "finished"  # released: blocks, generator and detokenizer dropped, finish_reason set


@dataclass(eq=False)  # compared and hashed by identity: two samples of a prompt are equal in every field
class Request:
    """One sequence the engine generates. A prompt with n > 1 becomes n Requests (index 0..n-1).

    Invariants: num_computed_tokens <= num_tokens; a WAITING request holds no KV blocks; token ids only
    grow, except that preemption resets num_computed_tokens to 0 (recompute: no token is lost).
    """

    request_id: str  # the user's request id, shared by all its prompts and samples
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first; FCFS among equals
    index: int = 0  # which of the n samples this is
    prompt_index: int = 0  # which prompt of the user request
    parent: Request | None = None  # for index > 0: the sibling (index 0) whose prompt blocks it may share
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

    # engine state, dropped when the request is released
    # KV block ids in token order, one table per KV group (BlockManager); empty while it holds none
    block_tables: list[list[int]] = field(default_factory=list)
    # per table, its leading entries a sliding window left behind: released, placeholders only
    num_released_blocks: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading table blocks already offered to the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks, memoized
    generator: torch.Generator | None = None  # a seeded request's own generator (Sampler), made on first draw
    # with a structured output: follows its output tokens and says which tokens may come next
    matcher: LLMatcher | None = None
    # with prompt_logprobs, on sample 0 only (its siblings read their parent's): prompt tokens 1.., appended
    # as prefill chunks compute them (LLMEngine.step), complete at num_prompt_tokens - 1 entries
    prompt_logprobs: list[TokenLogprob] | None = None
    has_sent_prompt_logprobs: bool = False  # its first output after the prompt was computed carried them
    detokenizer: IncrementalDetokenizer | None = None
    # proposed next tokens for the coming step (engine/spec_decode/speculative.py), computed after num_tokens and
    # verified by that step; set anew before every step
    spec_token_ids: list[int] = field(default_factory=list)
    add_order: int = 0  # set by the scheduler: breaks arrival-time ties

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
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: each prompt position must be computed here, so
        neither the prefix cache nor a fork may provide it."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt {self.prompt_index}, sample {self.index}, {self.status.value})"


@dataclass(eq=False)
class RequestGroup:
    """Every sequence of one user request: its prompts x n samples, in (prompt, sample) order."""

    request_id: str
    samples: list[Request] = field(default_factory=list)

    @property
    def unfinished(self) -> list[Request]:
        return [r for r in self.samples if not r.is_finished]


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one step; the model runner executes exactly this."""

    # (request, number of new tokens to compute this step), decodes first, then prefill chunks.
    # A request's new tokens are all_token_ids[num_computed_tokens : num_computed_tokens + n].
    # A request whose chunk reaches its last known token gets one sampled token; others (mid-prompt) none.
    scheduled: list[tuple[Request, int]]
    num_batched_tokens: int = 0  # sum of the n's above, <= max_num_batched_tokens
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step (recompute)
    # grew past the whole KV pool (its blocks already dropped): the engine finishes them with LENGTH
    outgrown: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
