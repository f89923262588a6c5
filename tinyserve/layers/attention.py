"""Paged attention: K/V live in a preallocated pool of fixed-size blocks; each sequence owns a block table.

Tokens of many sequences arrive flattened in one step (no padding between sequences). The model runner
orders them decodes first (one query token each), then prefill chunks (many query tokens each):
decodes are attended in one batched call, prefill chunks one sequence at a time, each with its causal
mask offset by the tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV pool and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token's K/V
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64; rows padded with block 0 past seq_lens
    seq_lens: torch.Tensor  # [num_seqs] int64 on device: cached + new tokens of each sequence
    seq_lens_host: list[int]  # the same on the host, for control flow without a device sync
    query_lens_host: list[int]  # new tokens of each sequence this step; the first num_decodes are 1
    num_decodes: int  # leading sequences with exactly one query token
    block_size: int

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


@dataclass
class KVCache:
    """One layer's pool. Allocated once at start-up; the engine never reallocates it."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    cache.key.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    cache.value.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(cache: KVCache, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first seq_len cached K and V, each [seq_len, num_kv_heads, head_dim]."""
    num_blocks = -(-seq_len // cache.key.shape[1])
    blocks = block_table[:num_blocks]
    shape = (-1, cache.key.shape[2], cache.key.shape[3])
    return cache.key[blocks].reshape(shape)[:seq_len], cache.value[blocks].reshape(shape)[:seq_len]


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True where attention is allowed. The queries are the last query_len
    positions of the sequence, so query i sees keys 0 .. seq_len - query_len + i."""
    offset = seq_len - query_len
    q_pos = torch.arange(query_len, device=device).unsqueeze(1) + offset
    return torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
          is_causal: bool) -> torch.Tensor:
    """q [heads, q_len, head_dim]; k, v [kv_heads, kv_len, head_dim] (GQA: heads is a multiple)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
    )


def _decode_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batched over the decode sequences: gather each one's blocks up to the longest, mask the rest."""
    num_decodes = meta.num_decodes
    max_len = max(meta.seq_lens_host[:num_decodes])
    block_size = meta.block_size
    max_blocks = -(-max_len // block_size)
    tables = meta.block_tables[:num_decodes, :max_blocks]
    num_kv_heads, head_dim = cache.key.shape[2], cache.key.shape[3]
    # [num_decodes, kv_heads, max_blocks * block_size, head_dim]
    k = cache.key[tables].reshape(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = cache.value[tables].reshape(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = positions.unsqueeze(0) < meta.seq_lens[:num_decodes].unsqueeze(1)  # [num_decodes, kv_len]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=num_kv_heads != q.shape[1],
    )  # [num_decodes, heads, 1, head_dim]
    return out.squeeze(2)


def paged_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
                    new_k: torch.Tensor, new_v: torch.Tensor) -> torch.Tensor:
    """q [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]. The step's K/V are already in
    the cache; new_k/new_v ([num_tokens, kv_heads, head_dim]) spare a gather for a prefill with no
    cached prefix."""
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(q[: meta.num_decodes], cache, meta, scale)
    start = meta.num_decodes
    for i in range(meta.num_decodes, len(meta.query_lens_host)):
        q_len, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
        q_seq = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
        if q_len == seq_len:  # nothing cached before this chunk: plain causal attention
            k, v = new_k[start : start + q_len], new_v[start : start + q_len]
            o = _sdpa(q_seq, k.transpose(0, 1), v.transpose(0, 1), scale, None, True)
        else:
            k, v = gather_kv(cache, meta.block_tables[i], seq_len)
            mask = causal_mask(q_len, seq_len, q.device)
            o = _sdpa(q_seq, k.transpose(0, 1), v.transpose(0, 1), scale, mask, False)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def reference_paged_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """The plain algorithm, one sequence and one head at a time in float32: the yardstick for tests."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.key.shape[2]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        k, v = gather_kv(cache, meta.block_tables[i], seq_len)
        allowed = causal_mask(q_len, seq_len, q.device)
        for h in range(q.shape[1]):
            qh = q[start : start + q_len, h].float()  # [q_len, head_dim]
            scores = (qh @ k[:, h // group].float().T) * scale  # [q_len, seq_len]
            scores = scores.masked_fill(~allowed, float("-inf"))
            scores = scores - scores.max(dim=-1, keepdim=True).values  # stable softmax
            weights = scores.exp()
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out[start : start + q_len, h] = (weights @ v[:, h // group].float()).to(q.dtype)
        start += q_len
    return out


class Attention(nn.Module):
    """Writes this step's K/V into its layer's pool, then attends over the pool. Holds no weights."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.kv_cache: KVCache | None = None  # bound by the model runner once the pool exists

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [num_tokens, heads, head_dim], k/v [num_tokens, kv_heads, head_dim] -> [num_tokens, heads, head_dim]"""
        assert self.kv_cache is not None, "bind_kv_cache() must run before the first forward"
        write_kv(self.kv_cache, k, v, meta.slot_mapping)
        return paged_attention(q, self.kv_cache, meta, self.scale, k, v)
