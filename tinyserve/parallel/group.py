"""This rank's place among the ranks, and the collectives each part of a step needs.

Ranks: T x P of them, rank r at tensor rank r % T of pipeline stage r // T. Rank 0 (stage 0, tensor rank
0) runs the scheduler and the sampler. Stage 0 holds the embedding, the final norm and the LM head beside
its layers, so the last stage sends its output back to stage 0, where the logits are computed next to
the sampler that needs them.

Every collective goes through this file, so that a rank's death (a closed connection, a timeout) surfaces
in one exception type: RankFailure, which ends the engine rather than one step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """Another rank died or stopped answering: the group cannot compute a step any more."""


@dataclass(frozen=True)
class Topology:
    rank: int
    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    def rank_at(self, stage: int, tp_rank: int | None = None) -> int:
        """The rank of `stage` at this rank's tensor rank (or at `tp_rank`)."""
        return stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)


SINGLE_PROCESS = Topology(rank=0, tp_size=1, pp_size=1)


@contextmanager
def _collective(what: str) -> Iterator[None]:
    """Around a torch.distributed call: a peer's death or a timeout becomes RankFailure."""
    try:
        yield
    except RankFailure:
        raise
    except RuntimeError as exc:  # gloo's and NCCL's errors (dist.DistError is one)
        raise RankFailure(f"{what} failed: {str(exc).splitlines()[0][:200]}") from exc


class TensorParallelGroup:
    """The ranks of one pipeline stage, which hold the shards of the same layers: the collectives a
    sharded layer needs. Of size 1 (no process group) in a single process, where both are no-ops."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None, first_rank: int = 0):
        self.rank, self.size, self.group = rank, size, group
        self._first_rank = first_rank  # the global rank of tensor rank 0 in this group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (row-parallel linears, the vocabulary-split embedding)."""
        if self.size > 1:
            with _collective("all_reduce"):
                dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """x of every rank ([n, k] each), concatenated along its last dim on tensor rank 0 ([n, k x size]);
        None on the others (the vocabulary-split LM head: only rank 0 samples)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        with _collective("gather"):
            dist.gather(x, parts, dst=self._first_rank, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TensorParallelGroup()


class StageChannel:
    """Activations between pipeline stages: each rank sends to (and receives from) the rank of the same
    tensor rank in the next (previous) stage; the last stage sends to stage 0. Sends are asynchronous, so
    that a stage goes on with its next microbatch while the previous one travels."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # a send, and its tensor kept alive until it left

    def send(self, tensors: tuple[torch.Tensor, ...], stage: int) -> None:
        dst = self.topology.rank_at(stage)
        with _collective("send"):
            for t in tensors:
                t = t.contiguous()
                self._pending.append((dist.isend(t, dst), t))

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
             stage: int) -> tuple[torch.Tensor, ...]:
        src = self.topology.rank_at(stage)
        out = tuple(torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
        with _collective("recv"):
            for t in out:
                dist.recv(t, src)
        return out

    def wait_sent(self) -> None:
        """Block until every send has left (their tensors may then be reused)."""
        with _collective("send"):
            for work, _ in self._pending:
                work.wait()
        self._pending.clear()


class HostGroup:
    """Every rank, over gloo: the collectives on host tensors (the step message, start-up agreements). A
    group of its own: on CUDA the default group is NCCL's, which takes only device tensors, and a rank waits
    here for the next step without the step collectives' timeout."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def broadcast_from_first(self, x: torch.Tensor) -> None:
        """x of rank 0 into x of every rank, in place (the step message)."""
        with _collective("broadcast"):
            dist.broadcast(x, src=0, group=self.group)

    def all_reduce_min(self, value: int) -> int:
        """The least of every rank's value (the KV blocks each rank's budget holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        with _collective("all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (of the same length), by rank."""
        t = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        with _collective("all_gather"):
            dist.all_gather(parts, t, group=self.group)
        return [p.tolist() for p in parts]
