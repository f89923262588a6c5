"""Plain statistics the engine produces, all of them here; the server turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """A snapshot after a step. Counters (preemptions, prefix cache) are totals since start-up."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests, 0..1
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    num_steps: int
    num_failed_requests: int = 0  # finished with FinishReason.ERROR since start-up
    num_paused: int = 0  # set aside until their slow reader catches up; not in num_waiting
    num_prefill_tokens: int = 0  # computed in prompt chunks (recomputes included, prefix-cache hits not)
    num_cached_blocks: int = 0  # blocks holding a prefix-cache hash (held or free)
    worst_running_priority: int | None = None  # the largest priority value running (None: nothing runs)
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: a copy of its counters


@dataclass
class PrefixCacheStats:
    """Counted when a request first allocates (and again after each preemption); the engine reports them."""

    num_query_blocks: int = 0  # full blocks looked up (a request's last token is never looked up)
    num_hit_blocks: int = 0
    num_query_tokens: int = 0  # all known tokens of the looked-up requests
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters since start-up, named as vLLM's: a draft is one sequence's proposal
    in one step (of 1 or more tokens); accepted tokens are proposals the target kept (the token the target
    adds after them is not counted)."""

    num_speculative_tokens: int  # proposals per draft, at most
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [num_speculative_tokens]: drafts whose proposal at position i was accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def count(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a draft step emits on average: accepted proposals plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_speculative_tokens, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))


@dataclass(frozen=True)
class LoopStats:
    """Where the engine thread's time went since start-up (seconds), for starvation measurements: a step
    loop starved by other threads shows up as a longer mean step at the same batch, or as overhead."""

    num_steps: int
    step_seconds: float  # inside LLMEngine.step()
    overhead_seconds: float  # inbox, stats, delivery and listeners, while work was pending
    max_gap_seconds: float  # longest time between the end of one step and the start of the next
