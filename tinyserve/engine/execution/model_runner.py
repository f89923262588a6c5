"""Executes one scheduled step: one flattened batch, one forward, one sample per finished chunk.

The batch has no padding between sequences: each sequence contributes exactly the tokens the scheduler
gave it. Sequences with one new token (decodes) go first, longest context first, so that attention can
treat them together (layers/attention.py). The step becomes a StepPlan of host lists (engine/execution/step_plan.py);
the StageRunner builds its AttentionMetadata, decode plan included, before the forward (the layers only
read it). With tensor or pipeline parallel the plan is first broadcast to the other ranks, which build the
same from it (engine/execution/worker.py), and a pipelined step is cut into one micro-batch per stage.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyserve.engine.spec_decode import rejection_sampler

from tinyserve.engine.execution import step_plan
from tinyserve.engine.loop.request import Request
from tinyserve.engine.sampling.sampler import Sampler, TokenMasks, prompt_token_logprobs
from tinyserve.engine.execution.stage_runner import StageRunner
from tinyserve.engine.execution.step_plan import MessageKind, MicroBatchPlan, StepPlan
from tinyserve.layers.kv_cache import KVCache, KVLayout, allocate_kv_cache
from tinyserve.models.registry import device_and_dtype
from tinyserve.parallel.launch import Ranks
from tinyserve.types import TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher

logger = logging.getLogger(__name__)

# prompt rows scored per LM-head call: bounds the [rows, vocab] float32 logits a long prefill chunk makes
PROMPT_LOGITS_ROWS = 128


@dataclass
class StepResult:
    # the new tokens of each request whose chunk reached its last token: one, or with proposed tokens the
    # accepted ones and the target's next
    sampled: dict[Request, list[int]]
    logprobs: dict[Request, list[TokenLogprob]]  # one per new token, for requests that asked for logprobs
    # for requests that need prompt logprobs: those of the prompt tokens after this step's chunk positions,
    # in order, continuing Request.prompt_logprobs
    prompt_logprobs: dict[Request, list[TokenLogprob]] = field(default_factory=dict)
    # for requests that proposed tokens: (proposed, accepted)
    proposals: dict[Request, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _PromptSpan:
    """Consecutive rows of the batch whose next tokens are prompt tokens to score."""

    request: Request
    first_row: int
    token_ids: list[int]  # the prompt token each row predicts, in order

    def row_chunks(self) -> list[list[int]]:
        """Its rows, PROMPT_LOGITS_ROWS per LM-head call."""
        rows = range(self.first_row, self.first_row + len(self.token_ids))
        return [list(rows[i : i + PROMPT_LOGITS_ROWS]) for i in range(0, len(rows), PROMPT_LOGITS_ROWS)]


@dataclass
class _Batch:
    # what every rank computes; its logit calls: each prompt span's row chunks, then (when any sequence
    # samples) the sampled rows: each sampled sequence's last known token, then its proposed tokens, in order
    plan: StepPlan
    sampled_requests: list[Request]
    proposals: list[list[int]]  # per sampled request, the proposed tokens this step verifies (often none)
    prompt_spans: list[_PromptSpan]


def _batch_order(request: Request, num_new: int) -> tuple[bool, int]:
    """Sort key: decodes (with or without proposals) before prefill chunks, decodes by context length,
    longest first (stable)."""
    is_decode = num_new == 1 + len(request.spec_token_ids)
    return (not is_decode, -request.num_computed_tokens if is_decode else 0)


class ModelRunner:
    """Owns the model, the KV pool (allocated once, before the first step) and the sampler; with tensor or
    pipeline parallel (`ranks`), rank 0's part of the model and pool, and the step's broadcast."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, seed: int = 0,
                 fill_bitmask: Callable[[list[LLMatcher]], torch.Tensor] | None = None,
                 kv_cache: list[KVCache | None] | None = None, layout: KVLayout | None = None,
                 ranks: Ranks | None = None):
        """`kv_cache`: each layer's pool in `layout` (flat when None; None for layers other stages hold),
        allocated by the caller (LLMEngine, a slot at a time), or here when None."""
        self.device, self.dtype = device_and_dtype(model)
        self.model = model
        self.block_size = block_size
        self.layout = layout or KVLayout.flat(model.config.num_hidden_layers)
        if kv_cache is None:
            kv_cache = allocate_kv_cache(model.config, num_blocks, block_size, self.dtype, self.device, self.layout)
        self.kv_cache = kv_cache
        self.stage = StageRunner(model, kv_cache, self.layout, num_blocks, block_size, ranks)
        self.ranks = ranks
        # a pipelined step is cut into this many micro-batches, so that every stage has one to work on
        self.num_micro_batches = ranks.topology.pp_size if ranks is not None else 1
        self.sampler = Sampler(seed)
        # constrained sequences' token masks (StructuredOutputs.fill_bitmask), computed on a worker thread
        # while the forward runs: each depends only on the tokens its sequence already has
        self._fill_bitmask = fill_bitmask
        self._mask_worker: ThreadPoolExecutor | None = None

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> StepResult:
        """scheduled[i] = (request, new tokens this step), its block table covering all its tokens."""
        batch = self._prepare(scheduled)
        requests = batch.sampled_requests
        constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
        pending_masks = self._start_masks([requests[i].matcher for i in constrained]) if constrained else None
        if self.ranks is not None:
            step_plan.broadcast(self.ranks.host, MessageKind.STEP, batch.plan)
        hidden = self.stage.forward(batch.plan)  # [num_tokens, hidden]
        logit_calls = iter(batch.plan.logit_calls)
        prompt_logprobs = {span.request: self._score_prompt(hidden, span, logit_calls) for span in batch.prompt_spans}
        if not requests:
            return StepResult({}, {}, prompt_logprobs)
        logits = self.stage.logits(hidden, next(logit_calls))  # [num_sample_rows, vocab]
        if any(batch.proposals):  # constrained requests never propose: one row each, found by row offset
            first_rows = list(itertools.accumulate((1 + len(p) for p in batch.proposals), initial=0))
            constrained_rows = [first_rows[i] for i in constrained]
            masks = TokenMasks(pending_masks.result(), constrained_rows) if pending_masks is not None else None
            out = rejection_sampler.verify(self.sampler, logits, requests, batch.proposals, masks)
            return StepResult(dict(zip(requests, out.token_ids)),
                              {r: lp for r, lp in zip(requests, out.logprobs) if lp is not None}, prompt_logprobs,
                              {r: (len(p), a) for r, p, a in zip(requests, batch.proposals, out.num_accepted) if p})
        masks = TokenMasks(pending_masks.result(), constrained) if pending_masks is not None else None
        out = self.sampler(logits, requests, masks)
        logprobs = {r: [lp] for r, lp in zip(requests, out.logprobs) if lp is not None}
        return StepResult({r: [t] for r, t in zip(requests, out.next_token_ids)}, logprobs, prompt_logprobs)

    def keep_alive(self) -> None:
        """While idle: tell the other ranks rank 0 is alive (RankFailure if one is not)."""
        if self.ranks is not None:
            step_plan.broadcast(self.ranks.host, MessageKind.HEARTBEAT)

    def close(self) -> None:
        """Send the other ranks home (best effort: some may be gone) and leave the group."""
        if self.ranks is None:
            return
        if self.ranks.topology.pp_size > 1:
            logger.info("rank 0: %s", self.stage.describe_bubble())
        try:
            step_plan.broadcast(self.ranks.host, MessageKind.STOP)
        except RuntimeError:
            pass
        self.ranks.close()
        self.ranks = None

    def _score_prompt(self, hidden: torch.Tensor, span: _PromptSpan, logit_calls) -> list[TokenLogprob]:
        """The logprobs of the prompt tokens a span's rows predict, one LM-head call per row chunk."""
        k = span.request.sampling_params.prompt_logprobs
        scored: list[TokenLogprob] = []
        for start in range(0, len(span.token_ids), PROMPT_LOGITS_ROWS):
            token_ids = span.token_ids[start : start + PROMPT_LOGITS_ROWS]
            scored += prompt_token_logprobs(self.stage.logits(hidden, next(logit_calls)), token_ids, k)
        return scored

    def _start_masks(self, matchers: list[LLMatcher]) -> Future[torch.Tensor]:
        assert self._fill_bitmask is not None, "a constrained request in an engine without structured outputs"
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-masks")
        return self._mask_worker.submit(self._fill_bitmask, matchers)

    def _prepare(self, scheduled: list[tuple[Request, int]]) -> _Batch:
        order = sorted(range(len(scheduled)), key=lambda i: _batch_order(*scheduled[i]))
        input_ids: list[int] = []
        positions: list[int] = []
        num_groups = self.layout.num_groups
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        seq_lens, query_lens, sample_rows, sampled, prompt_spans = [], [], [], [], []
        proposals: list[list[int]] = []
        request_starts: list[tuple[int, int]] = []  # each request's first token and first sequence row
        bs = self.block_size
        for i in order:
            request, num_new = scheduled[i]
            request_starts.append((len(input_ids), len(seq_lens)))
            start = request.num_computed_tokens
            end = start + num_new
            proposal = request.spec_token_ids  # positions num_tokens.. (the scheduler fit them to the chunk)
            assert end == request.num_tokens + len(proposal) or (not proposal and end < request.num_tokens)
            input_ids.extend(request.all_token_ids[start : end - len(proposal)] + proposal)
            positions.extend(range(start, end))
            for group_slots, group_tables, table in zip(slots, tables, request.block_tables, strict=True):
                group_slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                # a verify step: attended as 1 + k decode rows, row j seeing the cache up to itself
                group_tables.extend([table] * num_new if proposal else [table])
            if proposal:
                seq_lens.extend(range(start + 1, end + 1))
                query_lens.extend([1] * num_new)
            else:
                seq_lens.append(end)
                query_lens.append(num_new)
            if request.needs_prompt_logprobs:
                # rows predicting prompt tokens not yet scored (after a preemption, recomputed ones are not)
                first, last = max(start, len(request.prompt_logprobs)), min(end, request.num_prompt_tokens - 1)
                if first < last:
                    row = len(input_ids) - num_new + first - start
                    prompt_spans.append(_PromptSpan(request, row, request.prompt_token_ids[first + 1 : last + 1]))
            # the chunk reaches the last known token: sample the next one (max_tokens 0 only scores the prompt)
            if end - len(proposal) == request.num_tokens and request.sampling_params.max_tokens != 0:
                sample_rows.extend(range(len(input_ids) - 1 - len(proposal), len(input_ids)))
                sampled.append(request)
                proposals.append(proposal)
        whole = MicroBatchPlan(input_ids, positions, slots, tables, seq_lens, query_lens)
        logit_calls = [rows for span in prompt_spans for rows in span.row_chunks()]
        if sampled:
            logit_calls.append(sample_rows)
        micro_batches = (_split(whole, request_starts, self.num_micro_batches) if self.num_micro_batches > 1
                         else [whole])
        return _Batch(StepPlan(micro_batches, logit_calls), sampled, proposals, prompt_spans)


def _split(whole: MicroBatchPlan, request_starts: list[tuple[int, int]], parts: int) -> list[MicroBatchPlan]:
    """Up to `parts` micro-batches of about equal tokens, cut between requests (a verify step's rows stay
    together); their concatenation is `whole`."""
    num_tokens = len(whole.input_ids)
    cuts, target = [(0, 0)], num_tokens / parts
    for token, row in request_starts[1:]:
        if len(cuts) < parts and token >= target * len(cuts):
            cuts.append((token, row))
    cuts.append((num_tokens, len(whole.seq_lens)))
    return [MicroBatchPlan(whole.input_ids[t0:t1], whole.positions[t0:t1], [s[t0:t1] for s in whole.slot_mappings],
                           [t[r0:r1] for t in whole.block_tables], whole.seq_lens[r0:r1], whole.query_lens[r0:r1])
            for (t0, r0), (t1, r1) in zip(cuts, cuts[1:])]
