"""What one step's attention needs to know, built once by the model runner before the forward and read
by every layer: where the new tokens' K/V go, what each sequence attends to, and how its decodes are
attended (the decode plan), for each KV group (layers/kv_cache.py, KVLayout). No layer changes it.

The decode plan: with our Triton kernel (`paged_kernel`, on CUDA: ops.paged_kernel_applies) or our C++
kernel (`cpu_attention`, where ops.cpu_attention_applies), one call per layer for the whole step, decodes
and prefill chunks, reading the blocks in place (`query_start_loc`, `max_query_len`); otherwise decodes are
attended in a few batched torch calls over groups of
similar length (`decode_groups`), whose gather rows, masks and value bags are computed here, once per
step, not once per layer: one set per sliding window the model's layers use (None for full attention),
each gathering only the blocks inside its window.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from tinyserve.layers.host_to_device import int64_tensor, to_device
from tinyserve.layers.kv_cache import KVCache


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences start..end-1, attended in one batched call padded to their longest."""

    start: int
    end: int
    rows: torch.Tensor  # [kv_heads * num_seqs * width_blocks] rows of the pool to gather
    # [num_seqs, 1, width_blocks * block_size] float32: 0, or -inf past a sequence's end or before its window
    bias: torch.Tensor
    # token rows of the value pool for each (kv head, sequence, query head of the group), one bag each,
    # and where each bag starts: [kv_heads * num_seqs * group * width_blocks * block_size], [bags]
    value_bags: torch.Tensor
    value_bag_offsets: torch.Tensor


@dataclass(frozen=True)
class GroupTables:
    """One KV group's part of a step (layers/kv_cache.py, KVLayout): its layers' slots and tables."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token's K/V
    # [num_seqs, max_blocks] int64; rows padded with block 0 past seq_lens, and holding block 0 where a
    # sliding-window group released a block its window left behind (never read)
    block_tables: torch.Tensor
    # without the kernel: the decode plan for each window the group's layers use (None: full attention);
    # each empty with the kernel or without decodes
    decode_groups: Mapping[int | None, tuple[DecodeGroup, ...]]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV pool and what each sequence attends to. Sequences come
    ordered decodes first (one query token each, longest context first), then prefill chunks. A verify
    step's 1 + k tokens come as 1 + k decode rows of one table, each seeing the pool up to itself."""

    groups: tuple[GroupTables, ...]  # one per KV group
    layer_groups: tuple[int, ...]  # attention layer -> its group
    seq_lens: torch.Tensor  # [num_seqs] int64 on device: cached + new tokens of each sequence
    seq_lens_host: list[int]  # the same on the host, for control flow without a device sync
    query_lens_host: list[int]  # new tokens of each sequence this step; the first num_decodes are 1
    num_decodes: int  # leading sequences with exactly one query token
    block_size: int
    cpu_attention: bool  # every sequence's attention in our C++ kernel (ops.cpu_paged_attention)
    # The pools this step reads and writes, one per attention layer (layers of one slot share one). They
    # travel with the step, not in the model's modules: a loaded model holds no engine state, so engines
    # (and their threads) may share it.
    kv_caches: tuple[KVCache, ...]
    # every sequence's attention in our Triton kernel (ops.paged_attention_kernel); it and the C++ kernel need
    # where each sequence's query rows start ([num_seqs + 1] on device, the total last), Triton the longest query
    paged_kernel: bool = False
    query_start_loc: torch.Tensor | None = None
    max_query_len: int = 0

    def layer_tables(self, layer_index: int) -> GroupTables:
        return self.groups[self.layer_groups[layer_index]]

    @classmethod
    def build(cls, slot_mappings: Sequence[list[int]], block_tables: Sequence[list[list[int]]], seq_lens: list[int],
              query_lens: list[int], *, block_size: int, num_blocks: int, num_heads: int, num_kv_heads: int,
              device: torch.device, cpu_attention: bool, kv_caches: Sequence[KVCache], paged_kernel: bool = False,
              layer_groups: Sequence[int] | None = None,
              group_windows: Sequence[Collection[int | None]] = ((None,),)) -> AttentionMetadata:
        """From host lists, one slot mapping and one list of tables per KV group, sequences ordered decodes
        first. One host-to-device copy per tensor. layer_groups: each layer's group (None: all in group 0);
        group_windows: the windows each group's layers use (KVLayout.group_layer_windows)."""
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        bounds = [] if cpu_attention or paged_kernel else decode_group_bounds(seq_lens[:num_decodes])
        groups = []
        for slot_mapping, tables_host, windows in zip(slot_mappings, block_tables, group_windows, strict=True):
            (window,) = windows if len(windows) == 1 else (None,)
            tables = padded_tables(tables_host, seq_lens, query_lens, block_size, window)
            slots = torch.tensor(slot_mapping, dtype=torch.int64)
            check_tables(slots, tables, [len(t) for t in tables_host], seq_lens, query_lens, block_size, num_blocks)
            tables = to_device(tables, device)
            plans = {window: tuple(_decode_group(start, end, tables, seq_lens, num_heads, num_kv_heads, num_blocks,
                                                 block_size, window) for start, end in bounds)
                     for window in set(windows)}
            groups.append(GroupTables(to_device(slots, device), tables, plans))
        return cls(
            groups=tuple(groups),
            layer_groups=tuple(layer_groups) if layer_groups is not None else (0,) * len(kv_caches),
            seq_lens=int64_tensor(seq_lens, device),
            seq_lens_host=seq_lens, query_lens_host=query_lens, num_decodes=num_decodes, block_size=block_size,
            cpu_attention=cpu_attention, kv_caches=tuple(kv_caches), paged_kernel=paged_kernel,
            query_start_loc=(int64_tensor([0, *itertools.accumulate(query_lens)], device)
                             if paged_kernel or cpu_attention else None),
            max_query_len=max(query_lens),
        )


def padded_tables(tables: list[list[int]], seq_lens: list[int], query_lens: list[int], block_size: int,
                   window: int | None) -> torch.Tensor:
    """The padded [num_seqs, max_blocks] int64 tables of one group. With a window, only the entries from
    each sequence's first query's window on are copied (the rest, never read, are 0): a long sequence's
    window group has ~W / block_size live entries of its hundreds, and copying them one Python int at a
    time cost more than the step's other host work (docs/PERFORMANCE.md, "KV groups")."""
    width = max(len(t) for t in tables)
    if window is None:
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    index, values = [], []  # each live entry's place in the flattened table, and its block id
    for row, (table, seq_len, query_len) in enumerate(zip(tables, seq_lens, query_lens, strict=True)):
        first = max(0, seq_len - query_len + 1 - window) // block_size
        index += range(row * width + first, row * width + len(table))
        values += table[first:]
    out = torch.zeros(len(tables) * width, dtype=torch.int64)
    out[torch.tensor(index, dtype=torch.int64)] = torch.tensor(values, dtype=torch.int64)
    return out.view(len(tables), width)


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


# A decode group below this many sequences does not pay for its own ops (docs/PERFORMANCE.md, "Numbers
# behind the code's comments").
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
                       block_size: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool rows to gather, additive mask) for decode sequences whose tables are `block_tables`.
    Row r of the pool viewed as [kv_heads * num_blocks, block_size * head_dim] is block r % num_blocks
    of kv head r // num_blocks. With a window, each sequence's gather starts at the block holding its
    first key (max(0, seq_len - window)): width is then the most blocks one window spans, not the longest
    sequence's table."""
    device, num_seqs = block_tables.device, block_tables.shape[0]
    starts = [0 if window is None else max(0, n - window) // block_size for n in seq_lens]  # first block each
    width = max(-(-n // block_size) - s for n, s in zip(seq_lens, starts))
    first_block = torch.tensor(starts, device=device).view(num_seqs, 1)
    columns = first_block + torch.arange(width, device=device)  # [num_seqs, width], past a table's end: masked
    tables = block_tables.gather(1, columns.clamp_(max=block_tables.shape[1] - 1))
    heads = torch.arange(num_kv_heads, device=device).view(-1, 1, 1) * num_blocks
    rows = (heads + tables.unsqueeze(0)).reshape(-1)  # [kv_heads * num_seqs * width]
    lens = torch.tensor(seq_lens, device=device).view(num_seqs, 1, 1)
    # [num_seqs, 1, width * block_size]: each gathered token's position in its sequence
    positions = (first_block.view(num_seqs, 1, 1) * block_size
                 + torch.arange(width * block_size, device=device).view(1, 1, -1))
    outside = positions >= lens
    if window is not None:
        outside |= positions < lens - window
    bias = torch.zeros(num_seqs, 1, width * block_size, device=device)
    return rows, bias.masked_fill_(outside, float("-inf"))


def _decode_group(start: int, end: int, block_tables: torch.Tensor, seq_lens: list[int], num_heads: int,
                  num_kv_heads: int, num_blocks: int, block_size: int, window: int | None) -> DecodeGroup:
    rows, bias = decode_gather_plan(block_tables[start:end], seq_lens[start:end], num_kv_heads, num_blocks,
                                    block_size, window)
    # probs x V is a weighted sum of the value pool's token rows (embedding_bag): one bag per (kv head,
    # sequence, query head of the kv head's group), holding the group's gathered token rows
    num_seqs, group, width = end - start, num_heads // num_kv_heads, bias.shape[-1]
    tokens = (rows.view(-1, 1) * block_size + torch.arange(block_size, device=rows.device)).view(
        num_kv_heads, num_seqs, 1, width)
    bags = tokens.expand(num_kv_heads, num_seqs, group, width).reshape(-1)
    offsets = torch.arange(0, bags.numel(), width, device=rows.device)
    return DecodeGroup(start, end, rows, bias, bags, offsets)
