"""Executes one scheduled step: one flattened batch, one forward, one sample per finished chunk.

The batch has no padding between sequences: each sequence contributes exactly the tokens the scheduler
gave it. Sequences with one new token (decodes) go first, longest context first, so that attention can
treat them together (layers/attention.py). The step's AttentionMetadata, decode plan included, is built
completely here, before the forward; the layers only read it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyserve.engine import rejection_sampler
from tinyserve.engine.request import Request
from tinyserve.engine.sampler import Sampler, TokenMasks, prompt_token_logprobs
from tinyserve.layers.attention_metadata import AttentionMetadata
from tinyserve.layers.kv_cache import KVCache, KVLayout, allocate_kv_cache
from tinyserve.layers.ops import decode_kernel_applies
from tinyserve.models.registry import device_and_dtype
from tinyserve.types import TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher

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


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # [num_sample_rows] the rows whose logits are sampled: each sampled sequence's last known token, then
    # its proposed tokens (if any), in order
    sample_rows: torch.Tensor
    sampled_requests: list[Request]
    proposals: list[list[int]]  # per sampled request, the proposed tokens this step verifies (often none)
    prompt_spans: list[_PromptSpan]


def _batch_order(request: Request, num_new: int) -> tuple[bool, int]:
    """Sort key: decodes (with or without proposals) before prefill chunks, decodes by context length,
    longest first (stable)."""
    is_decode = num_new == 1 + len(request.spec_token_ids)
    return (not is_decode, -request.num_computed_tokens if is_decode else 0)


class ModelRunner:
    """Owns the model, the KV pool (allocated once, before the first step) and the sampler."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, seed: int = 0,
                 fill_bitmask: Callable[[list[LLMatcher]], torch.Tensor] | None = None,
                 kv_cache: list[KVCache] | None = None, layout: KVLayout | None = None):
        """`kv_cache`: each layer's pool in `layout` (flat when None), allocated by the caller (LLMEngine, a
        slot at a time), or here when None."""
        self.device, self.dtype = device_and_dtype(model)
        self.model = model
        self.block_size, self.num_blocks = block_size, num_blocks
        self.num_heads, self.num_kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.layout = layout or KVLayout.flat(model.config.num_hidden_layers)
        # one decode plan per window a group's layers use
        self.group_windows = self.layout.group_layer_windows(model.config.layer_sliding_windows())
        if kv_cache is None:
            kv_cache = allocate_kv_cache(model.config, num_blocks, block_size, self.dtype, self.device, self.layout)
        self.kv_cache = kv_cache
        self.sampler = Sampler(seed)
        # constrained sequences' token masks (StructuredOutputs.fill_bitmask), computed on a worker thread
        # while the forward runs: each depends only on the tokens its sequence already has
        self._fill_bitmask = fill_bitmask
        self._mask_worker: ThreadPoolExecutor | None = None
        # The decode plan's kernel-or-torch choice, made once; the kernels build (or load) here, at
        # start-up, not in the first timed step.
        self.decode_kernel = decode_kernel_applies(self.device, self.dtype, model.config.head_dim)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> StepResult:
        """scheduled[i] = (request, new tokens this step), its block table covering all its tokens."""
        batch = self._prepare(scheduled)
        requests = batch.sampled_requests
        constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
        pending_masks = self._start_masks([requests[i].matcher for i in constrained]) if constrained else None
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)  # [num_tokens, hidden]
        prompt_logprobs = {span.request: self._score_prompt(hidden, span) for span in batch.prompt_spans}
        if not requests:
            return StepResult({}, {}, prompt_logprobs)
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [num_sample_rows, vocab]
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

    def _score_prompt(self, hidden: torch.Tensor, span: _PromptSpan) -> list[TokenLogprob]:
        """The logprobs of the prompt tokens a span's rows predict, PROMPT_LOGITS_ROWS rows at a time."""
        k = span.request.sampling_params.prompt_logprobs
        scored: list[TokenLogprob] = []
        for start in range(0, len(span.token_ids), PROMPT_LOGITS_ROWS):
            token_ids = span.token_ids[start : start + PROMPT_LOGITS_ROWS]
            rows = hidden[span.first_row + start : span.first_row + start + len(token_ids)]  # [rows, hidden]
            scored += prompt_token_logprobs(self.model.compute_logits(rows), token_ids, k)
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
        bs = self.block_size
        for i in order:
            request, num_new = scheduled[i]
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
        device = self.device
        meta = AttentionMetadata.build(slots, tables, seq_lens, query_lens, block_size=bs, num_blocks=self.num_blocks,
                                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, device=device,
                                       decode_kernel=self.decode_kernel, kv_caches=self.kv_cache,
                                       layer_groups=self.layout.layer_groups, group_windows=self.group_windows)
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            sampled_requests=sampled,
            proposals=proposals,
            prompt_spans=prompt_spans,
        )
