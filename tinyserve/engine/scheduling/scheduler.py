"""Iteration-level scheduler: which requests compute how many tokens in the next step.

Algorithm: there is no prefill or decode phase. Each request's num_computed_tokens chases its num_tokens
(prompt + output so far); a step gives each scheduled request a chunk of the tokens it has not computed
yet, within a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). A request whose
chunk reaches its last known token gets one sampled token. So a decode is a chunk of one, chunked
prefill is a prompt taking several steps, a prefix-cache hit or a fork starts num_computed_tokens above
zero, and preemption by recompute resets it to zero with no token lost.
Each step: running requests first (decodes, then the next chunks of prompts already running), so a long
prompt never stalls running streams; a running request that cannot get a block preempts the
lowest-priority, newest running request; then, if nothing was preempted, waiting requests are admitted
in priority order (lower first, FCFS among equals) while the budget, the cap and free blocks allow.
Priorities preempt: a waiting request that finds the cap full or too few blocks preempts the last running
request in order if that one's priority is worse. Order ages: a request's key is its priority times
priority_aging_s plus its arrival time, so a wait of priority_aging_s seconds counts as one level and a
low-priority request is overtaken (or preempted) for a bounded time only, never starved.
A paused request (its client reads slowly) holds nothing: running, it is preempted; waiting, it leaves
the queue until resumed, so it blocks nobody behind it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time

from tinyserve.config import SchedulerConfig
from tinyserve.engine.scheduling.block_manager import BlockManager
from tinyserve.engine.loop.request import Request, RequestStatus, SchedulerOutput
from tinyserve.types import FinishReason

logger = logging.getLogger(__name__)

OrderKey = tuple[float, float, int]  # (aged priority, arrival_time, add order): lower runs first


class WaitingQueue:
    """Waiting requests by OrderKey: a heap with lazy deletion, so push, remove and pop stay O(log n)
    however long the queue grows.

    Invariant: an entry is live iff `_entries[request] is entry`. remove() only forgets the entry; the
    stale copy is dropped when it reaches the top, or when stale copies outnumber live ones (a rebuild,
    amortized O(1) per removal).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[OrderKey, Request]] = []  # the unique add order means Requests never compare
        self._entries: dict[Request, tuple[OrderKey, Request]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, request: Request, key: OrderKey) -> None:
        assert request not in self._entries, f"{request} queued twice"
        entry = (key, request)
        self._entries[request] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, request: Request) -> bool:
        if self._entries.pop(request, None) is None:
            return False
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = list(self._entries.values())
            heapq.heapify(self._heap)
        return True

    def peek(self) -> Request | None:
        """The first request in order, or None when empty."""
        while self._heap and self._entries.get(self._heap[0][1]) is not self._heap[0]:
            heapq.heappop(self._heap)
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        request = self.peek()
        assert request is not None, "pop from an empty waiting queue"
        heapq.heappop(self._heap)
        del self._entries[request]
        return request

    def ordered(self) -> list[Request]:
        """Every queued request in order: O(n log n), for tests and debugging."""
        return [request for _, request in sorted(self._entries.values())]


class Scheduler:
    """Decides each step over the unfinished requests it is given; the only caller of BlockManager.free.

    Invariants: a request is in exactly one of `running` (holds blocks), `_queue` (waiting, holds none)
    and `_paused_waiting` (paused, holds none) from `add_request` until `remove`, which frees its blocks
    and marks it finished; a request appears at most once in a step. A running request that is paused is
    preempted into `_paused_waiting`. The scheduler never ends a request on its own: the stop conditions
    it finds (`update`) and the requests that outgrew the pool (`SchedulerOutput.outgrown`) go back to
    the engine, which finishes them (LLMEngine._finish).
    """

    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager):
        self.config = scheduler_config
        self.block_manager = block_manager
        self.running: list[Request] = []  # in admission order, at most max_num_seqs
        self._queue = WaitingQueue()
        self._paused_waiting: set[Request] = set()  # paused and waiting: out of the queue
        self.num_preemptions = 0
        self._counter = itertools.count()  # add order: breaks arrival_time ties

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests the next steps may schedule. Paused ones are not counted: they hold no seat and no
        block, and are bounded by their stream's write timeout, so they must not fill admission's queue."""
        return len(self._queue)

    @property
    def num_paused(self) -> int:
        """Paused requests set aside while waiting (a running one that is paused is preempted into them)."""
        return len(self._paused_waiting)

    @property
    def waiting(self) -> list[Request]:
        """Every waiting request (paused ones included) in admission order; O(n log n), for tests."""
        return sorted([*self._queue.ordered(), *self._paused_waiting], key=self._order_key)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or len(self._queue) or self._paused_waiting)

    def has_schedulable_requests(self) -> bool:
        """Whether a step now could do anything: False when every unfinished request is paused, so the
        engine thread sleeps instead of spinning on empty steps until one is resumed or aborted."""
        return bool(self.running or len(self._queue))

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if its prompt alone needs more blocks than the whole pool."""
        assert request.status is RequestStatus.WAITING and not request.block_tables, f"{request} added twice"
        bm = self.block_manager
        if not self._fits_pool(request):
            raise ValueError(f"prompt of {request.num_tokens} tokens exceeds the KV cache ({bm.num_blocks} blocks)")
        request.add_order = next(self._counter)
        self._enqueue(request)

    def set_paused(self, request: Request, paused: bool) -> None:
        """A paused request is not scheduled until resumed: a running one is preempted (its reader has
        fallen behind, so its seat and blocks go to others; it recomputes when resumed), a waiting one
        is set aside and not admitted. Call between steps. A finished request: no-op."""
        if request.is_finished or paused == self.is_paused(request):
            return
        if paused:
            if request.status is RequestStatus.RUNNING:
                outgrown = SchedulerOutput(scheduled=[])
                self._preempt(request, outgrown)
                assert not outgrown.outgrown, "a running request holds its blocks: it cannot outgrow the pool"
            if self._queue.remove(request):
                self._paused_waiting.add(request)
        else:
            self._paused_waiting.discard(request)
            self._enqueue(request)

    def is_paused(self, request: Request) -> bool:
        return request in self._paused_waiting

    def remove(self, request: Request) -> None:
        """Forget a request the engine finishes, wherever it is, and free its blocks now. Idempotent."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)  # O(max_num_seqs)
        elif request in self._paused_waiting:
            self._paused_waiting.discard(request)
        else:
            is_queued = self._queue.remove(request)
            assert is_queued, f"waiting request {request} is in no queue"
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(scheduled=[])
        self._schedule_running(output)
        if not output.preempted:  # memory just ran short: admitting now would only thrash
            self._admit_waiting(output)
        assert output.num_batched_tokens == sum(n for _, n in output.scheduled) <= self.config.max_num_batched_tokens
        assert len(output.scheduled) <= self.config.max_num_seqs
        assert len({id(r) for r, _ in output.scheduled}) == len(output.scheduled), "double-scheduled"
        return output

    def update(self, scheduler_output: SchedulerOutput,
               sampled: dict[Request, list[int]]) -> list[tuple[Request, FinishReason | None, int]]:
        """Apply one executed step. `sampled` maps each request whose chunk reached its last known token
        to its new tokens (one, or with speculation its accepted proposals and the target's token).
        Returns (request, stop condition or None, number of new tokens kept) for each request that got
        tokens, in step order. The tokens are applied one by one and the first that meets a stop condition
        (EOS, a stop token id, a length limit) is the last kept; the engine finishes those. A request of
        max_tokens 0 gets no token: it comes back with LENGTH once its prompt is computed.

        A request whose update raises (other than a broken invariant) comes back with ERROR alone, its
        traceback logged."""
        updates = []
        now = time.monotonic()
        for request, num_new in scheduler_output.scheduled:
            if request.is_finished:
                continue
            try:
                update = self._apply(request, num_new, sampled, now)
                if update is not None:
                    updates.append((request, *update))
            except AssertionError:
                raise
            except Exception:
                logger.exception("%s failed while its step was applied", request)
                updates.append((request, FinishReason.ERROR, 0))
        return updates

    def _apply(self, request: Request, num_new: int, sampled: dict[Request, list[int]],
               now: float) -> tuple[FinishReason | None, int] | None:
        """One request's part of update: (stop condition or None, tokens kept) if it got tokens."""
        num_proposed = len(request.spec_token_ids)
        if num_proposed:  # verified this step; no new list per request per step when nothing was proposed
            request.spec_token_ids = []
        request.num_computed_tokens += num_new - num_proposed  # proposals' KV counts once accepted
        assert request.num_computed_tokens <= request.num_tokens
        is_sampled = request.num_computed_tokens == request.num_tokens
        if is_sampled and request.sampling_params.max_tokens == 0:  # prompt scored, nothing to generate
            self.block_manager.cache_full_blocks(request)
            return FinishReason.LENGTH, 0
        if not is_sampled:
            self.block_manager.cache_full_blocks(request)
            return None
        assert request in sampled, f"no sampled token for {request}"
        reason, num_kept = None, 0
        for token_id in sampled[request]:
            request.output_token_ids.append(token_id)
            num_kept += 1
            if (reason := self._stop_reason(request)) is not None:
                break
        # every kept token but the last was a proposal the step computed: its KV is valid
        request.num_computed_tokens = request.num_tokens - 1
        if request.first_token_time is None:
            request.first_token_time = now
        self.block_manager.cache_full_blocks(request)
        return reason, num_kept

    def _schedule_running(self, output: SchedulerOutput) -> None:
        # decodes (one token left to compute) before prompt chunks: sorted() is stable, so admission order
        # holds within each group
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            budget = self._token_budget(output)
            if budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running {request} has nothing to compute"
            if request.spec_token_ids:
                num_new += self._fit_proposal(request, budget - num_new)
            if not self._allocate_or_preempt(request, num_new, output):
                break
            self._add_scheduled(output, request, num_new)

    def _fit_proposal(self, request: Request, budget: int) -> int:
        """Cut a decode's proposed tokens to the step's budget left and to the free blocks (a proposal never
        preempts anyone); returns how many stay."""
        proposal = request.spec_token_ids[:budget]
        num_decode = request.num_tokens - request.num_computed_tokens
        if proposal and not self.block_manager.can_allocate(request, num_decode + len(proposal)):
            proposal = []
        request.spec_token_ids = proposal
        return len(proposal)

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Get the request's blocks for num_new tokens, preempting others as needed. False if it was the
        one preempted (or finished: see _preempt)."""
        # terminates: each failed try removes one running request, the last of them being this one
        while not self.block_manager.allocate_slots(request, num_new):
            victim = max(self.running, key=self._order_key)
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Recompute: drop its blocks, keep its tokens; it returns to its place at the front of waiting."""
        self._unschedule(request, output)
        if not self._fits_pool(request):
            # NOTE: it could never be re-admitted. This is also the only way a lone request can fail to
            # allocate (everything else is free), so ending it here ends what would be a livelock.
            logger.warning("%s outgrew the KV cache at %d tokens", request, request.num_tokens)
            self.remove(request)
            output.outgrown.append(request)  # the engine finishes it with LENGTH in this step
            return
        num_blocks = self.block_manager.num_held_blocks(request)
        request.spec_token_ids = []
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)
        output.preempted.append(request)
        logger.debug("preempted %s (%d tokens, freed %d blocks)", request, request.num_tokens, num_blocks)

    def _admit_waiting(self, output: SchedulerOutput) -> None:
        # n > 1 samples waiting for their parent's prompt are popped and pushed back: at most
        # n - 1 per running parent, so a step's work does not grow with the queue
        gated: list[Request] = []
        while (request := self._queue.peek()) is not None:
            budget = self._token_budget(output)
            if budget == 0:
                break
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_for_priority(request, output):
                    continue
                break
            must_wait, fork_source = self._parent_gate(request)
            if must_wait:  # not a resource stall: requests behind it may still go
                gated.append(self._queue.pop())
                continue
            num_new = self._allocate_for_admission(request, budget, fork_source)
            if num_new is None:  # FCFS: nobody overtakes the head, which may only preempt worse priorities
                if self._preempt_for_priority(request, output):
                    continue
                break
            self._queue.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self._add_scheduled(output, request, num_new)
            logger.debug(
                "admitted %s (%d tokens, %d cached, %d blocks, %d free)", request, request.num_tokens,
                request.num_computed_tokens, self.block_manager.num_held_blocks(request),
                self.block_manager.num_free_blocks,
            )
        for request in gated:
            self._enqueue(request)

    def _preempt_for_priority(self, request: Request, output: SchedulerOutput) -> bool:
        """Preempt the last running request in order for the waiting `request`, if that one has a worse
        priority and, aged, still comes after it. Returns whether one was preempted."""
        if not self.running:
            return False
        victim = max(self.running, key=self._order_key)
        if victim.priority <= request.priority or self._order_key(victim) < self._order_key(request):
            return False
        logger.debug("%s (priority %d) preempts %s (priority %d)", request, request.priority, victim,
                     victim.priority)
        self._preempt(victim, output)
        return True

    def _allocate_for_admission(self, request: Request, budget: int, fork_source: Request | None) -> int | None:
        """Start the request's blocks from a fork of its parent or from the prefix cache, then allocate
        its first chunk. Returns the chunk size, or None with nothing changed."""
        bm = self.block_manager
        num_shared_blocks = (request.num_prompt_tokens - 1) // bm.block_size if fork_source else 0
        if num_shared_blocks:
            assert fork_source.prompt_token_ids == request.prompt_token_ids, "a sample must share its parent's prompt"
            if not bm.fork(fork_source, request, num_shared_blocks):
                num_shared_blocks = 0  # the parent's window left blocks behind the sample needs: it starts alone
        if num_shared_blocks:
            request.num_computed_tokens = num_shared_blocks * bm.block_size
            num_cached = 0
        elif request.needs_prompt_logprobs:  # cached tokens have no logits (as vLLM: no prefix cache for it)
            num_cached = 0
        else:
            num_cached = bm.get_computed_prefix(request)
        num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
        if not bm.allocate_slots(request, num_new, num_cached):
            if num_shared_blocks:  # undo the fork: the parent still holds those blocks, so this is exact
                bm.free(request)
                request.num_computed_tokens = 0
            return None
        request.num_computed_tokens += num_cached
        if request.num_preemptions == 0 and request.first_scheduled_time is None:
            request.num_cached_tokens = request.num_computed_tokens
        return num_new

    def _parent_gate(self, request: Request) -> tuple[bool, Request | None]:
        """(must wait, parent to fork from) for sample i > 0 of an n > 1 request.

        It waits while its parent has not yet computed its prompt for the first time; it forks once the
        parent is running with its prompt computed; if the parent finished or was preempted before that,
        it prefills on its own, unless the parent's prompt logprobs are still to come: each sample's first
        output carries them, so none may run ahead of them.
        """
        parent = request.parent
        if parent is None or parent.is_finished:
            return False, None
        if parent.status is RequestStatus.RUNNING and parent.num_computed_tokens >= parent.num_prompt_tokens:
            return False, parent
        return parent.num_preemptions == 0 or parent.needs_prompt_logprobs, None

    def _stop_reason(self, request: Request) -> FinishReason | None:
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        # the tokens before this one count toward min_tokens, as the sampler masks stop ids until they exist
        if request.num_output_tokens - 1 >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP
            if token_id in params.stop_token_id_set:
                return FinishReason.STOP
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        limits = [x for x in (request.max_total_tokens, self.config.max_model_len) if x is not None]
        if limits and request.num_tokens >= min(limits):
            return FinishReason.LENGTH
        return None

    def _enqueue(self, request: Request) -> None:
        self._queue.push(request, self._order_key(request))

    def _order_key(self, request: Request) -> OrderKey:
        """Lower runs first: priority aged by the time since arrival, then arrival (FCFS among equals).
        Preemption picks the max. Static although it ages: every request ages at the same rate."""
        aged = request.priority * self.config.priority_aging_s + request.arrival_time
        return aged, request.arrival_time, request.add_order

    def _unschedule(self, request: Request, output: SchedulerOutput) -> None:
        """Take back a request scheduled earlier in this step, and its tokens from the budget."""
        for i, (scheduled, num_new) in enumerate(output.scheduled):
            if scheduled is request:
                del output.scheduled[i]
                output.num_batched_tokens -= num_new
                return

    def _add_scheduled(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        output.scheduled.append((request, num_new))
        output.num_batched_tokens += num_new

    def _fits_pool(self, request: Request) -> bool:
        """Whether the whole pool holds the request, recomputed in chunks of up to a step's budget: if not,
        it could never be (re-)admitted."""
        bm = self.block_manager
        return bm.blocks_needed(request.num_tokens, self.config.max_num_batched_tokens) <= bm.num_blocks

    def _token_budget(self, output: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - output.num_batched_tokens
