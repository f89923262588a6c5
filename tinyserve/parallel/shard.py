"""The part of a model one rank holds, and where its tensors' rows and columns come from in the checkpoint.

Tensor parallel, as Megatron-LM splits a transformer: q/k/v and gate/up are column-parallel (each rank
holds its heads' and its slice of the MLP's rows), o and down row-parallel (the matching input columns,
one all-reduce each), the vocabulary split between ranks for the embedding and the LM head. KV heads are
split too, or replicated when there are fewer of them than ranks (each rank keeps the one its query heads
read). Pipeline parallel: each stage holds a contiguous range of layers (parallel/dispatch.py); stage 0
holds the embedding, the final norm and the LM head as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyserve.config import ModelConfig
from tinyserve.parallel.group import SINGLE, TensorParallelGroup


@dataclass(frozen=True)
class CheckpointSlice:
    """The part of a checkpoint tensor that a parameter (or one shard of a merged one) holds on this rank:
    `length` of its `full` rows (dim 0) or columns (dim 1), from `start`."""

    dim: int
    start: int
    length: int
    full: int


def column_slice(full: int, tp: TensorParallelGroup, dim: int = 0) -> CheckpointSlice | None:
    """An even split of `full` rows (or columns) between the group's ranks; None without tensor parallel."""
    if tp.size == 1:
        return None
    length = full // tp.size
    return CheckpointSlice(dim, tp.rank * length, length, full)


def kv_head_slice(num_kv_heads: int, head_dim: int, tp: TensorParallelGroup) -> tuple[int, CheckpointSlice | None]:
    """(this rank's KV heads, where its K or V rows are): its share, or with fewer KV heads than ranks the
    one head its query heads use (ranks r * KV / T .. share it)."""
    if tp.size == 1:
        return num_kv_heads, None
    local = max(1, num_kv_heads // tp.size)
    first_head = tp.rank * num_kv_heads // tp.size
    return local, CheckpointSlice(0, first_head * head_dim, local * head_dim, num_kv_heads * head_dim)


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """ValueError unless the model splits evenly into tp_size ranks."""
    if tp_size == 1:
        return
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % tp_size:
        problems.append(f"{heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"{kv_heads} KV heads (neither a multiple nor a divisor of {tp_size})")
    if config.intermediate_size % tp_size:
        problems.append(f"an MLP of {config.intermediate_size}")
    if config.vocab_size % tp_size:
        problems.append(f"a vocabulary of {config.vocab_size}")
    if problems:
        raise ValueError(f"tensor parallel size {tp_size} does not divide the model's {', '.join(problems)}")


@dataclass(frozen=True, eq=False)
class ModelShard:
    """What this rank holds: its tensor-parallel group's shard of the layers in `layers`, and on the first
    stage (`layers.start == 0`) the embedding, the final norm and the LM head."""

    num_layers: int
    layers: range
    tp: TensorParallelGroup = SINGLE

    @classmethod
    def whole(cls, num_layers: int) -> ModelShard:
        return cls(num_layers, range(num_layers))

    @property
    def is_whole(self) -> bool:
        return self.tp.size == 1 and len(self.layers) == self.num_layers

    @property
    def holds_ends(self) -> bool:
        """The embedding, final norm and LM head live here (stage 0)."""
        return self.layers.start == 0

    def holds_param(self, name: str) -> bool:
        """Whether a parameter of the whole model (by its name) has a part on this rank."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layers
        return self.holds_ends
