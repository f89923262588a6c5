"""Paged attention: K/V live in a preallocated pool of fixed-size blocks (layers/kv_cache.py); each
sequence owns a block table.

Tokens of many sequences arrive flattened in one step (no padding between sequences), decodes first (one
query token each, longest context first), then prefill chunks (many query tokens each). The whole step is
one call per layer of our own kernel: Triton on CUDA (layers/kernels/triton_attention.py), C++ on CPU
(layers/kernels/csrc/paged_attention.cpp), both reading the blocks in place. The C++ kernel computes each
query the same way whatever its step, so float32 tokens do not depend on batching, chunking or prefix-cache
hits. Without a kernel (a failed build, float16, an odd head size) decodes are attended in a few batched
torch calls over groups of similar length, as the step's plan says (layers/attention_metadata.py), and
prefill chunks one sequence at a time through SDPA, each with its causal mask offset by the tokens already
in the cache.

An int8 pool (layers/kv_cache.py) is read by the C++ kernel, which folds each row's scale into its score
and its weight (the model runner refuses the pool where the kernel does not apply).

Logit soft-cap c (Gemma 2's `attn_logit_softcapping`): a score s becomes c * tanh(s / c) before the
softmax, in the C++ kernel and in the torch ops; the Triton kernel does not take it yet (refused).

Sliding window (per layer, Mistral's and transformers' meaning): the query at position p attends to keys
p - W + 1 .. p, W keys itself included; None is full attention. Every path reads only the blocks from
the window's start on (the kernel and the decode groups from each sequence's own, a prefill chunk from
its first query's), and masks the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.layers import ops
from tinyserve.layers.attention_metadata import AttentionMetadata, DecodeGroup, GroupTables
from tinyserve.layers.direct_call import DirectCall
from tinyserve.layers.kv_cache import KVCache, gather_kv


def first_key(position: int, window: int | None) -> int:
    """The first key the query at `position` attends to."""
    return 0 if window is None else max(0, position + 1 - window)


def causal_mask(query_len: int, seq_len: int, device: torch.device, window: int | None = None,
                first: int = 0) -> torch.Tensor:
    """[query_len, seq_len - first] bool, True where attention is allowed, over keys first .. seq_len - 1.
    The queries are the last query_len positions of the sequence, so query i (at p = seq_len - query_len + i)
    sees keys max(0, p - window + 1) .. p."""
    q_pos = torch.arange(query_len, device=device).unsqueeze(1) + (seq_len - query_len)
    k_pos = torch.arange(first, seq_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    return allowed if window is None else allowed & (k_pos > q_pos - window)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
          is_causal: bool) -> torch.Tensor:
    """q [heads, q_len, head_dim]; k, v [kv_heads, kv_len, head_dim] (GQA: heads is a multiple).
    The leading batch dim of 1 matters: on CPU, 3-d inputs take the unfused math path, 4-d ones the
    faster flash kernel (docs/PERFORMANCE.md, "Changes, each measured before and after")."""
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=k.shape[0] != q.shape[0],
    )[0]


def _soft_capped(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    return scores if soft_cap is None else soft_cap * torch.tanh(scores / soft_cap)


def _decode_attention(q: torch.Tensor, cache: KVCache, plan: DecodeGroup, scale: float,
                      soft_cap: float | None) -> torch.Tensor:
    """One group of decode sequences at once, in torch ops: gather their K blocks (one index_select) for
    one batched matmul over (kv head, sequence), softmax, then sum V's pool rows weighted by the
    probabilities (embedding_bag over the plan's value bags: V is read once, never gathered into a copy).
    Sequences shorter than the group's longest are masked by the plan's bias.
    q [num_decodes, heads, head_dim] -> same shape."""
    # an int8 pool's decodes are the C++ kernel's (the model runner refuses the pool where it does not apply)
    assert not cache.quantized, "decode groups read a float pool"
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = cache.key.shape[0]
    group = num_heads // num_kv_heads
    rows = cache.key.view(-1, cache.key.shape[2] * head_dim)  # [kv_heads * num_blocks, block_size * head_dim]
    k = rows.index_select(0, plan.rows).view(num_kv_heads * num_decodes, -1, head_dim)
    # [kv_heads * num_decodes, group, head_dim]: query heads of one kv head are adjacent (h = kvh * group + g)
    qg = (q * scale).view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
    scores = torch.bmm(qg, k.transpose(1, 2)).view(num_kv_heads, num_decodes, group, -1)
    probs = (_soft_capped(scores.float(), soft_cap) + plan.bias).softmax(dim=-1).to(q.dtype)  # [kvh, nd, group, w]
    out = F.embedding_bag(plan.value_bags, cache.value.view(-1, head_dim), plan.value_bag_offsets, mode="sum",
                          per_sample_weights=probs.reshape(-1))  # [kv_heads * num_decodes * group, head_dim]
    return out.view(num_kv_heads, num_decodes, group, head_dim).transpose(0, 1).reshape(num_decodes, num_heads, head_dim)


def paged_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, tables: GroupTables, scale: float,
                    new_k: torch.Tensor, new_v: torch.Tensor, window: int | None = None,
                    soft_cap: float | None = None) -> torch.Tensor:
    """q [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]. The step's K/V are already in
    the cache; new_k/new_v ([num_tokens, kv_heads, head_dim]) spare a gather for a prefill with no
    cached prefix on the torch path. tables: the layer's KV group's; window: the layer's sliding window,
    None for full attention; soft_cap: the logit soft-cap, None for none."""
    if meta.paged_kernel:
        if soft_cap is not None:
            raise NotImplementedError("the Triton attention kernel has no logit soft-cap yet")
        return ops.paged_attention_kernel(q, cache, tables.block_tables, meta.seq_lens, meta.query_start_loc,
                                          meta.max_query_len, scale, window)
    if meta.cpu_attention:
        return ops.cpu_paged_attention(q, cache, tables.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                                       window, soft_cap)
    out = torch.empty_like(q)
    for plan in tables.decode_groups[window]:
        out[plan.start : plan.end] = _decode_attention(q[plan.start : plan.end], cache, plan, scale, soft_cap)
    start = meta.num_decodes
    for i in range(meta.num_decodes, len(meta.query_lens_host)):
        q_len, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
        q_seq = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
        first = first_key(seq_len - q_len, window)  # the chunk's first query's first key
        if q_len == seq_len:  # nothing cached before this chunk (first is 0): its own K/V
            k = new_k[start : start + q_len].transpose(0, 1)
            v = new_v[start : start + q_len].transpose(0, 1)
        else:
            k, v = gather_kv(cache, tables.block_tables[i], seq_len, first, q.dtype)
        # plain causal attention (SDPA's own mask) where no key is cached and none leaves the window
        is_causal = soft_cap is None and q_len == seq_len and (window is None or window >= seq_len)
        mask = None if is_causal else causal_mask(q_len, seq_len, q.device, window, first)
        if soft_cap is None:
            attended = _sdpa(q_seq, k, v, scale, mask, is_causal)
        else:
            attended = _soft_capped_attention(q_seq, k, v, scale, mask, soft_cap)
        out[start : start + q_len] = attended.transpose(0, 1)
        start += q_len
    return out


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor,
                           soft_cap: float) -> torch.Tensor:
    """SDPA's math with the scores soft-capped (SDPA has no cap): q [heads, q_len, head_dim], k/v [kv_heads,
    kv_len, head_dim], allowed [q_len, kv_len] bool."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = _soft_capped((q.float() @ k.float().transpose(1, 2)) * scale, soft_cap)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (probs @ v.float()).to(q.dtype)


def reference_paged_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
                              window: int | None = None, kv_group: int = 0,
                              soft_cap: float | None = None) -> torch.Tensor:
    """The plain algorithm, one sequence and one head at a time in float32: the yardstick for tests.
    Reads every key of each sequence (a group that released blocks would need a window-sized gather)."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.key.shape[0]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        k, v = gather_kv(cache, meta.groups[kv_group].block_tables[i], seq_len)
        allowed = causal_mask(q_len, seq_len, q.device, window)
        for h in range(q.shape[1]):
            qh = q[start : start + q_len, h].float()  # [q_len, head_dim]
            scores = _soft_capped((qh @ k[h // group].float().T) * scale, soft_cap)  # [q_len, seq_len]
            scores = scores.masked_fill(~allowed, float("-inf"))
            scores = scores - scores.max(dim=-1, keepdim=True).values  # stable softmax
            weights = scores.exp()
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out[start : start + q_len, h] = (weights @ v[h // group].float()).to(q.dtype)
        start += q_len
    return out


class Attention(DirectCall, nn.Module):
    """Writes this step's K/V into its layer's pool, then attends over the pool. Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_index: int,
                 scale: float | None = None, sliding_window: int | None = None, soft_cap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_index = layer_index  # its pool is the step's meta.kv_caches[layer_index], its tables its group's
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window  # keys per query, itself included; None: full attention
        self.soft_cap = soft_cap  # scores become soft_cap * tanh(score / soft_cap); None: not capped

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [num_tokens, heads, head_dim], k/v [num_tokens, kv_heads, head_dim] -> [num_tokens, heads, head_dim]"""
        cache = meta.kv_caches[self.layer_index]
        tables = meta.layer_tables(self.layer_index)
        ops.write_kv(cache, k, v, tables.slot_mapping)
        return paged_attention(q, cache, meta, tables, self.scale, k, v, self.sliding_window, self.soft_cap)
