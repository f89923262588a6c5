"""A step as the model ranks see it: host lists only, and its encoding as one int64 tensor.

Rank 0 builds a StepPlan from the scheduler's output (ModelRunner._prepare) and broadcasts it; every rank
then builds the same tensors and attention metadata from it (StageRunner). It carries exactly what the
forward and the LM head need: token ids, positions, each KV group's slots and block tables, lengths,
which rows get logits. Sampling stays on rank 0, so no sampling data travels. The encoding is a typed
layout of integers, not a pickled object: a rank can only ever decode a step from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from tinyserve.parallel.group import HostGroup


class MessageKind(IntEnum):
    STEP = 1
    HEARTBEAT = 2  # rank 0 is idle and alive (a rank waiting for a step would otherwise time out)
    STOP = 3  # rank 0 is shutting down: leave the group and exit


@dataclass
class MicroBatchPlan:
    """Some of a step's sequences, decodes first: a pipeline stage passes one on and takes the next."""

    input_ids: list[int]  # [num_tokens]
    positions: list[int]  # [num_tokens]
    slot_mappings: list[list[int]]  # per KV group: [num_tokens] pool slots of the new tokens' K/V
    block_tables: list[list[list[int]]]  # per KV group: [num_seqs] block tables
    seq_lens: list[int]  # [num_seqs]
    query_lens: list[int]  # [num_seqs]


@dataclass
class StepPlan:
    micro_batches: list[MicroBatchPlan]
    # each LM-head call, in order: rows of the step's hidden states (the micro-batches' concatenated)
    logit_calls: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(mb.input_ids) for mb in self.micro_batches)


def encode(plan: StepPlan) -> torch.Tensor:
    """[n] int64: counts first, then each list (a table's length before its entries)."""
    num_groups = len(plan.micro_batches[0].slot_mappings)
    out = [len(plan.micro_batches), num_groups, len(plan.logit_calls)]
    for mb in plan.micro_batches:
        out += (len(mb.input_ids), len(mb.seq_lens))
        out += mb.input_ids
        out += mb.positions
        out += mb.seq_lens
        out += mb.query_lens
        for slots, tables in zip(mb.slot_mappings, mb.block_tables, strict=True):
            out += slots
            out += (len(t) for t in tables)
            for table in tables:
                out += table
    for rows in plan.logit_calls:
        out.append(len(rows))
        out += rows
    return torch.tensor(out, dtype=torch.int64)


def decode(message: torch.Tensor) -> StepPlan:
    values = message.tolist()
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return values[pos - n : pos]

    num_micro, num_groups, num_calls = take(3)
    micro = []
    for _ in range(num_micro):
        num_tokens, num_seqs = take(2)
        ids, positions, seq_lens, query_lens = take(num_tokens), take(num_tokens), take(num_seqs), take(num_seqs)
        slots, tables = [], []
        for _ in range(num_groups):
            slots.append(take(num_tokens))
            lens = take(num_seqs)
            tables.append([take(n) for n in lens])
        micro.append(MicroBatchPlan(ids, positions, slots, tables, seq_lens, query_lens))
    calls = [take(take(1)[0]) for _ in range(num_calls)]
    assert pos == len(values), "a step message longer than its counts"
    return StepPlan(micro, calls)


def broadcast(host: HostGroup, kind: MessageKind, plan: StepPlan | None = None) -> None:
    """Rank 0: a message to every rank (a header of two ints, then the encoded plan)."""
    payload = encode(plan) if plan is not None else None
    host.broadcast_from_first(torch.tensor([kind, 0 if payload is None else payload.numel()], dtype=torch.int64))
    if payload is not None:
        host.broadcast_from_first(payload)


def receive(host: HostGroup) -> tuple[MessageKind, StepPlan | None]:
    """Another rank: the next message from rank 0."""
    header = torch.empty(2, dtype=torch.int64)
    host.broadcast_from_first(header)
    kind, length = MessageKind(int(header[0])), int(header[1])
    if kind != MessageKind.STEP:
        return kind, None
    payload = torch.empty(length, dtype=torch.int64)
    host.broadcast_from_first(payload)
    return kind, decode(payload)
