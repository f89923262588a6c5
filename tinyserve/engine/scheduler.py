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
A paused request (its client reads slowly) holds nothing: running, it is preempted; waiting, it leaves
the queue until resumed, so it blocks nobody behind it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time

from tinyserve.config import SchedulerConfig
from tinyserve.engine.block_manager import BlockManager
from tinyserve.types import FinishReason, Request, RequestStatus, SchedulerOutput

logger = logging.getLogger(__name__)

OrderKey = tuple[int, float, int]  # (priority, arrival_time, add order): lower runs first


class WaitingQueue:
    """Waiting requests by OrderKey: a heap with lazy deletion, so push, remove and pop stay O(log n)
    however long the queue grows.

    Invariant: an entry is live iff `_entries[request_id] is entry`. remove() only forgets the entry; the
    stale copy is dropped when it reaches the top, or when stale copies outnumber live ones (a rebuild,
    amortized O(1) per removal).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[OrderKey, Request]] = []  # the unique add order means Requests never compare
        self._entries: dict[str, tuple[OrderKey, Request]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, request: Request, key: OrderKey) -> None:
        assert request.request_id not in self._entries, f"{request.request_id} queued twice"
        entry = (key, request)
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, request_id: str) -> bool:
        if self._entries.pop(request_id, None) is None:
            return False
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = list(self._entries.values())
            heapq.heapify(self._heap)
        return True

    def peek(self) -> Request | None:
        """The first request in order, or None when empty."""
        while self._heap and self._entries.get(self._heap[0][1].request_id) is not self._heap[0]:
            heapq.heappop(self._heap)
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        request = self.peek()
        assert request is not None, "pop from an empty waiting queue"
        heapq.heappop(self._heap)
        del self._entries[request.request_id]
        return request

    def ordered(self) -> list[Request]:
        """Every queued request in order: O(n log n), for tests and debugging."""
        return [request for _, request in sorted(self._entries.values())]


class Scheduler:
    """Owns every unfinished request and decides each step; the only caller of BlockManager.free.

    Invariants: a request is in exactly one of `waiting` (holds no blocks) and `running` (holds blocks)
    until it finishes, when its blocks are freed at once and it is forgotten; a request appears at most
    once in a step. A waiting request is in `_queue` (by _order_key) unless it is paused, then in
    `_paused_waiting`; a running request that is paused is preempted into `_paused_waiting`.
    """

    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager):
        self.config = scheduler_config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}  # unfinished requests, by id
        self.running: list[Request] = []  # in admission order, at most max_num_seqs
        self._queue = WaitingQueue()
        self._paused_waiting: dict[str, Request] = {}  # paused and waiting: out of the queue
        self.num_preemptions = 0
        self._arrival_seq: dict[str, int] = {}  # breaks arrival_time ties in add order
        self._counter = itertools.count()
        self._finished_ids: list[str] = []  # finished outside update_from_output, for the next output
        self._outgrown: list[Request] = []  # finished in schedule(), returned by the next update_from_output

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
        return sorted([*self._queue.ordered(), *self._paused_waiting.values()], key=self._order_key)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether a step now could do anything: False when every unfinished request is paused, so the
        engine thread sleeps instead of spinning on empty steps until one is resumed or aborted."""
        return bool(self.running or len(self._queue) or self._finished_ids or self._outgrown)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if its prompt alone needs more blocks than the whole pool."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        bm = self.block_manager
        if -(-request.num_tokens // bm.block_size) > bm.num_blocks:
            raise ValueError(f"prompt of {request.num_tokens} tokens exceeds the KV cache ({bm.num_blocks} blocks)")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._arrival_seq[request.request_id] = next(self._counter)
        self._enqueue(request)

    def set_paused(self, request_id: str, paused: bool) -> None:
        """A paused request is not scheduled until resumed: a running one is preempted (its reader has
        fallen behind, so its seat and blocks go to others; it recomputes when resumed), a waiting one
        is set aside and not admitted. Call between steps. Unknown id: no-op."""
        request = self.requests.get(request_id)
        if request is None or paused == (request_id in self._paused_waiting):
            return
        if paused:
            if request.status is RequestStatus.RUNNING:
                # back into the queue; an outgrown request (it cannot be: it holds its blocks) would
                # finish instead and land in _finished_ids
                self._preempt(request, SchedulerOutput(scheduled=[], finished_ids=self._finished_ids))
            if self._queue.remove(request_id):
                self._paused_waiting[request_id] = request
        elif self._paused_waiting.pop(request_id, None) is not None:
            self._enqueue(request)

    def is_paused(self, request_id: str) -> bool:
        return request_id in self._paused_waiting

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request and free its blocks now. False if it is not in flight."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """Finish a request from outside the step (a stop string, an abort). False if not in flight."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason)
        self._finished_ids.append(request_id)
        return True

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(scheduled=[], finished_ids=self._finished_ids)
        self._finished_ids = []
        self._schedule_running(output)
        if not output.preempted_ids:  # memory just ran short: admitting now would only thrash
            self._admit_waiting(output)
        assert output.num_batched_tokens == sum(n for _, n in output.scheduled) <= self.config.max_num_batched_tokens
        assert len(output.scheduled) <= self.config.max_num_seqs
        assert len({r.request_id for r, _ in output.scheduled}) == len(output.scheduled), "double-scheduled"
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply one executed step. `sampled` maps request id -> token for the requests whose chunk reached
        their last known token. Returns the requests that got a token or finished, in step order.

        A request whose update raises (other than a broken invariant) is finished with ERROR alone and
        returned, its traceback logged; the caller gives it its final output."""
        changed, self._outgrown = self._outgrown, []
        now = time.monotonic()
        for request, num_new in scheduler_output.scheduled:
            if request.is_finished:  # aborted while the step ran
                continue
            try:
                is_changed = self._apply(request, num_new, sampled, now)
            except AssertionError:
                raise
            except Exception:
                logger.exception("request %s failed while its step was applied", request.request_id)
                self._finish(request, FinishReason.ERROR)
                is_changed = True
            if is_changed:
                changed.append(request)
        return changed

    def _apply(self, request: Request, num_new: int, sampled: dict[str, int], now: float) -> bool:
        """One request's part of update_from_output; True if it got a token."""
        request.num_computed_tokens += num_new
        assert request.num_computed_tokens <= request.num_tokens
        is_sampled = request.num_computed_tokens == request.num_tokens
        if is_sampled:
            assert request.request_id in sampled, f"no sampled token for {request.request_id}"
            request.output_token_ids.append(sampled[request.request_id])
            if request.first_token_time is None:
                request.first_token_time = now
        self.block_manager.cache_full_blocks(request)
        if is_sampled:
            reason = self._stop_reason(request)
            if reason is not None:
                self._finish(request, reason)
        return is_sampled

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
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            if not self._allocate_or_preempt(request, num_new, output):
                break
            self._add_scheduled(output, request, num_new)

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
        bm = self.block_manager
        if -(-request.num_tokens // bm.block_size) > bm.num_blocks:
            # NOTE: it could never be re-admitted. This is also the only way a lone request can fail to
            # allocate (everything else is free), so finishing it here ends what would be a livelock.
            logger.warning("request %s outgrew the KV cache at %d tokens", request.request_id, request.num_tokens)
            self._finish(request, FinishReason.LENGTH)
            output.finished_ids.append(request.request_id)
            self._outgrown.append(request)  # the engine gets it from the next update_from_output
            return
        num_blocks = len(bm.block_table(request.request_id))
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)
        output.preempted_ids.append(request.request_id)
        logger.debug("preempted %s (%d tokens, freed %d blocks)", request.request_id, request.num_tokens, num_blocks)

    def _admit_waiting(self, output: SchedulerOutput) -> None:
        # n > 1 samples waiting for their parent's prompt are popped and pushed back: at most
        # n - 1 per running parent, so a step's work does not grow with the queue
        gated: list[Request] = []
        while (request := self._queue.peek()) is not None:
            budget = self._token_budget(output)
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            must_wait, fork_source = self._parent_gate(request)
            if must_wait:  # not a resource stall: requests behind it may still go
                gated.append(self._queue.pop())
                continue
            num_new = self._allocate_for_admission(request, budget, fork_source)
            if num_new is None:  # no preemption for admissions; FCFS: nobody overtakes the head
                break
            self._queue.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self._add_scheduled(output, request, num_new)
            logger.debug(
                "admitted %s (%d tokens, %d cached, %d blocks, %d free)", request.request_id, request.num_tokens,
                request.num_computed_tokens, len(self.block_manager.block_table(request.request_id)),
                self.block_manager.num_free_blocks,
            )
        for request in gated:
            self._enqueue(request)

    def _allocate_for_admission(self, request: Request, budget: int, fork_source: Request | None) -> int | None:
        """Start the request's blocks from a fork of its parent or from the prefix cache, then allocate
        its first chunk. Returns the chunk size, or None with nothing changed."""
        bm = self.block_manager
        num_shared_blocks = (request.num_prompt_tokens - 1) // bm.block_size if fork_source else 0
        if num_shared_blocks:
            assert fork_source.prompt_token_ids == request.prompt_token_ids, "a sample must share its parent's prompt"
            bm.fork(fork_source, request, num_shared_blocks)
            request.num_computed_tokens = num_shared_blocks * bm.block_size
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
        it prefills on its own.
        """
        parent = self.requests.get(request.parent_id) if request.parent_id is not None else None
        if parent is None:
            return False, None
        if parent.status is RequestStatus.RUNNING and parent.num_computed_tokens >= parent.num_prompt_tokens:
            return False, parent
        return parent.num_preemptions == 0, None

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

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)  # O(max_num_seqs)
        elif self._paused_waiting.pop(request.request_id, None) is None:
            is_queued = self._queue.remove(request.request_id)
            assert is_queued, f"waiting request {request.request_id} is in no queue"
        num_blocks = len(self.block_manager.block_table(request.request_id))
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
        del self._arrival_seq[request.request_id]
        logger.debug(
            "finished %s (%s, %d output tokens, freed %d blocks, %d free)", request.request_id, reason.value,
            request.num_output_tokens, num_blocks, self.block_manager.num_free_blocks,
        )

    def _enqueue(self, request: Request) -> None:
        self._queue.push(request, self._order_key(request))

    def _order_key(self, request: Request) -> OrderKey:
        """Lower runs first: priority, then arrival (FCFS). Preemption picks the max."""
        return request.priority, request.arrival_time, self._arrival_seq[request.request_id]

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

    def _token_budget(self, output: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - output.num_batched_tokens
