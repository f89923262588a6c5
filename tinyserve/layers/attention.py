"""Paged attention: K/V live in a preallocated pool of fixed-size blocks; each sequence owns a block table.

Tokens of many sequences arrive flattened in one step (no padding between sequences). The model runner
orders them decodes first (one query token each, longest context first), then prefill chunks (many
query tokens each). Decodes are attended in one call of our C++ kernel on CPU (cpu_kernels.py), or
elsewhere in a few batched torch calls over groups of similar length; prefill chunks one sequence at a
time through SDPA, each with its causal mask offset by the tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.layers import cpu_kernels
from tinyserve.layers.direct_call import DirectCall


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV pool and what each sequence attends to. Built once per step
    by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token's K/V
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64; rows padded with block 0 past seq_lens
    seq_lens: torch.Tensor  # [num_seqs] int64 on device: cached + new tokens of each sequence
    seq_lens_host: list[int]  # the same on the host, for control flow without a device sync
    query_lens_host: list[int]  # new tokens of each sequence this step; the first num_decodes are 1
    num_decodes: int  # leading sequences with exactly one query token
    block_size: int
    decode_kernel: bool = False  # decodes go to the C++ kernel (cpu_kernels.decode_kernel_applies)
    # For the torch-op decode path, computed once per step, not per layer (empty when num_decodes == 0
    # or with the kernel)
    decode_groups: list[DecodeGroup] = field(default_factory=list)

    @classmethod
    def build(cls, slot_mapping: list[int], block_tables: list[list[int]], seq_lens: list[int],
              query_lens: list[int], block_size: int, num_kv_heads: int, num_blocks: int,
              device: torch.device, decode_kernel: bool = False) -> AttentionMetadata:
        """From host lists, sequences ordered decodes first. One host-to-device copy per tensor."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        slots = torch.tensor(slot_mapping, dtype=torch.int64)
        check_tables(slots, tables, [len(t) for t in block_tables], seq_lens, query_lens, block_size, num_blocks)
        tables = tables.to(device)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        meta = cls(
            slot_mapping=slots.to(device),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            seq_lens_host=seq_lens, query_lens_host=query_lens, num_decodes=num_decodes, block_size=block_size,
            decode_kernel=decode_kernel,
        )
        if decode_kernel:
            return meta
        for start, end in decode_group_bounds(seq_lens[:num_decodes]):
            rows, bias = decode_gather_plan(tables[start:end], seq_lens[start:end], num_kv_heads, num_blocks,
                                            block_size)
            meta.decode_groups.append(DecodeGroup(start, end, rows, bias))
        return meta


def check_tables(slot_mapping: torch.Tensor, block_tables: torch.Tensor, table_lens: list[int], seq_lens: list[int],
                 query_lens: list[int], block_size: int, num_blocks: int) -> None:
    """Raise RuntimeError unless every block id and slot lies in the pool and every sequence fits its table
    (slot_mapping and the padded block_tables as cpu int64 tensors, before they go to the device). The pool
    is indexed with these: on CPU the C++ kernel checks them too, but on CUDA an index out of range is a
    device-side assert that ends the process, and a negative block id would silently read another head's
    block in the torch-op decode path. Once per step, not per layer."""
    for i, (num_table_blocks, seq_len, query_len) in enumerate(zip(table_lens, seq_lens, query_lens, strict=True)):
        if not 1 <= query_len <= seq_len <= num_table_blocks * block_size:
            raise RuntimeError(f"sequence {i}: {query_len} new of {seq_len} tokens do not fit its block table of "
                               f"{num_table_blocks} blocks of {block_size} (a scheduler bug)")
    for name, ids, size in (("block_tables", block_tables, num_blocks), ("slot_mapping", slot_mapping,
                                                                         num_blocks * block_size)):
        if ids.numel() and not (0 <= ids.min().item() and ids.max().item() < size):  # table padding is block 0
            raise RuntimeError(f"{name} holds values outside the pool [0, {size}) (a scheduler bug)")


@dataclass
class KVCache:
    """One layer's pool, allocated once at start-up; the engine never reallocates it. Heads lead so that
    one sequence's gathered blocks are already [kv_heads, tokens, head_dim], the layout matmuls want."""

    key: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    value: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]


@dataclass
class DecodeGroup:
    """Decode sequences start..end-1, attended in one batched call padded to their longest."""

    start: int
    end: int
    rows: torch.Tensor  # [kv_heads * num_seqs * width_blocks] rows of the pool to gather
    bias: torch.Tensor  # [num_seqs, 1, width_blocks * block_size] float32: 0, or -inf past a sequence's end
    # token rows of the value pool for each (kv head, sequence, query head of the group), one bag each,
    # and where each bag starts; built by the first layer (they depend on the query group size) and
    # shared by the rest
    value_bags: torch.Tensor | None = None
    value_bag_offsets: torch.Tensor | None = None


# A decode group below this many sequences is not worth its own ops (about 0.2 ms per layer).
MIN_DECODE_GROUP = 16
MAX_DECODE_GROUPS = 4


def decode_group_bounds(seq_lens: list[int]) -> list[tuple[int, int]]:
    """Split decode sequences, already sorted longest first, into up to MAX_DECODE_GROUPS runs of equal
    count. Padding each run only to its own longest sequence, instead of all to the longest of the step,
    cuts the gathered and multiplied KV of uniformly spread lengths from ~2x the real amount to ~1.1x."""
    count = len(seq_lens)
    groups = max(1, min(MAX_DECODE_GROUPS, count // MIN_DECODE_GROUP))
    cuts = [count * g // groups for g in range(groups + 1)]
    return [(cuts[g], cuts[g + 1]) for g in range(groups) if cuts[g] < cuts[g + 1]]


def decode_gather_plan(block_tables: torch.Tensor, seq_lens: list[int], num_kv_heads: int, num_blocks: int,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool rows to gather, additive mask) for decode sequences whose tables are `block_tables`.
    Row r of the pool viewed as [kv_heads * num_blocks, block_size * head_dim] is block r % num_blocks
    of kv head r // num_blocks."""
    num_seqs = block_tables.shape[0]
    width = -(-max(seq_lens) // block_size)
    tables = block_tables[:, :width]
    heads = torch.arange(num_kv_heads, device=tables.device).view(-1, 1, 1) * num_blocks
    rows = (heads + tables.unsqueeze(0)).reshape(-1)  # [kv_heads * num_seqs * width]
    lens = torch.tensor(seq_lens, device=tables.device).view(num_seqs, 1, 1)
    positions = torch.arange(width * block_size, device=tables.device).view(1, 1, -1)
    bias = torch.zeros(num_seqs, 1, width * block_size, device=tables.device)
    return rows, bias.masked_fill_(positions >= lens, float("-inf"))


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    cache.key.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    cache.value.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def gather_kv(cache: KVCache, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first seq_len cached K and V, each [num_kv_heads, seq_len, head_dim]."""
    num_kv_heads, _, block_size, head_dim = cache.key.shape
    blocks = block_table[: -(-seq_len // block_size)]
    k = cache.key[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
    v = cache.value[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
    return k, v


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True where attention is allowed. The queries are the last query_len
    positions of the sequence, so query i sees keys 0 .. seq_len - query_len + i."""
    offset = seq_len - query_len
    q_pos = torch.arange(query_len, device=device).unsqueeze(1) + offset
    return torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
          is_causal: bool) -> torch.Tensor:
    """q [heads, q_len, head_dim]; k, v [kv_heads, kv_len, head_dim] (GQA: heads is a multiple).
    The leading batch dim of 1 matters: on CPU, 3-d inputs take the unfused math path, 4-d ones the
    flash kernel, 2-3x faster for a 512-token chunk."""
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal, scale=scale,
        enable_gqa=k.shape[0] != q.shape[0],
    )[0]


def _decode_attention(q: torch.Tensor, cache: KVCache, plan: DecodeGroup, scale: float) -> torch.Tensor:
    """One group of decode sequences at once: gather their K blocks (one index_select) for one batched
    matmul over (kv head, sequence), softmax, then sum V's pool rows weighted by the probabilities
    (embedding_bag). Sequences shorter than the group's longest are masked by the precomputed bias.
    q [num_decodes, heads, head_dim] -> same shape."""
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = cache.key.shape[0]
    group = num_heads // num_kv_heads
    rows = cache.key.view(-1, cache.key.shape[2] * head_dim)  # [kv_heads * num_blocks, block_size * head_dim]
    k = rows.index_select(0, plan.rows).view(num_kv_heads * num_decodes, -1, head_dim)
    # [kv_heads * num_decodes, group, head_dim]: query heads of one kv head are adjacent (h = kvh * group + g)
    qg = (q * scale).view(num_decodes, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
    scores = torch.bmm(qg, k.transpose(1, 2)).view(num_kv_heads, num_decodes, group, -1)
    probs = (scores.float() + plan.bias).softmax(dim=-1).to(q.dtype)  # [kv_heads, num_decodes, group, width]
    # probs x V as a weighted sum of pool rows (embedding_bag): V is read once, never gathered into a copy
    width = probs.shape[-1]
    if plan.value_bags is None:
        block_size = cache.value.shape[2]
        tokens = (plan.rows.view(-1, 1) * block_size + torch.arange(block_size, device=q.device)).view(
            num_kv_heads, num_decodes, 1, width)
        plan.value_bags = tokens.expand(num_kv_heads, num_decodes, group, width).reshape(-1)
        plan.value_bag_offsets = torch.arange(0, plan.value_bags.numel(), width, device=q.device)
    out = F.embedding_bag(plan.value_bags, cache.value.view(-1, head_dim), plan.value_bag_offsets, mode="sum",
                          per_sample_weights=probs.reshape(-1))  # [kv_heads * num_decodes * group, head_dim]
    return out.view(num_kv_heads, num_decodes, group, head_dim).transpose(0, 1).reshape(num_decodes, num_heads, head_dim)


def paged_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
                    new_k: torch.Tensor, new_v: torch.Tensor) -> torch.Tensor:
    """q [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]. The step's K/V are already in
    the cache; new_k/new_v ([num_tokens, kv_heads, head_dim]) spare a gather for a prefill with no
    cached prefix."""
    nd = meta.num_decodes
    decoded = None
    if meta.decode_kernel and nd:
        decoded = cpu_kernels.paged_decode_attention(q[:nd], cache.key, cache.value, meta.block_tables[:nd],
                                                     meta.seq_lens[:nd], scale)
        if nd == len(meta.query_lens_host):  # a decode-only step: no copy into out
            return decoded
    out = torch.empty_like(q)
    if decoded is not None:
        out[:nd] = decoded
    for plan in meta.decode_groups:
        out[plan.start : plan.end] = _decode_attention(q[plan.start : plan.end], cache, plan, scale)
    start = meta.num_decodes
    for i in range(meta.num_decodes, len(meta.query_lens_host)):
        q_len, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
        q_seq = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
        if q_len == seq_len:  # nothing cached before this chunk: plain causal attention
            k = new_k[start : start + q_len].transpose(0, 1)
            v = new_v[start : start + q_len].transpose(0, 1)
            o = _sdpa(q_seq, k, v, scale, None, True)
        else:
            k, v = gather_kv(cache, meta.block_tables[i], seq_len)
            o = _sdpa(q_seq, k, v, scale, causal_mask(q_len, seq_len, q.device), False)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def reference_paged_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """The plain algorithm, one sequence and one head at a time in float32: the yardstick for tests."""
    out = torch.empty_like(q)
    group = q.shape[1] // cache.key.shape[0]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        k, v = gather_kv(cache, meta.block_tables[i], seq_len)
        allowed = causal_mask(q_len, seq_len, q.device)
        for h in range(q.shape[1]):
            qh = q[start : start + q_len, h].float()  # [q_len, head_dim]
            scores = (qh @ k[h // group].float().T) * scale  # [q_len, seq_len]
            scores = scores.masked_fill(~allowed, float("-inf"))
            scores = scores - scores.max(dim=-1, keepdim=True).values  # stable softmax
            weights = scores.exp()
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out[start : start + q_len, h] = (weights @ v[h // group].float()).to(q.dtype)
        start += q_len
    return out


class Attention(DirectCall, nn.Module):
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
