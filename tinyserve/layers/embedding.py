"""Token (and position) embeddings: a row lookup, from the codes of a quantized tied head if any.

Why a class of our own: the weights always come from a checkpoint, so the random init nn.Embedding runs
at construction is skipped. On the meta device (where the loader builds models) that init is torch's
Python reference of `normal_`, whose first use imports torch._dynamo and sympy: resident memory for a
server that never compiles anything (docs/PERFORMANCE.md, "Resident memory").

Why lookups in codes: a quantized model's tied LM head is int8, or the file's own int4 codes
(layers/linear.py, quantized_format), and the embedding's rows are exactly its values, so the rows are read
from the head's codes instead of a float copy of the vocab x hidden matrix.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.layers import ops
from tinyserve.layers.direct_call import DirectCall
from tinyserve.layers.quant import Int4SuperblockWeight, Int4Weight, Int6SuperblockWeight, Int8Weight
from tinyserve.layers.weight_format import DenseWeight
from tinyserve.parallel.group import SINGLE, TensorParallelGroup
from tinyserve.parallel.shard import CheckpointSlice, column_slice


class Embedding(DirectCall, nn.Embedding):
    """Looks rows up in `weight_format`: DenseWeight(self.weight), or the Int8Weight / Int4Weight /
    Int6SuperblockWeight of a quantized tied head, or the file's own codes of an untied one (Int4Weight,
    Int8Weight; in w4a16 Int4SuperblockWeight for Q4_K, Int6SuperblockWeight for Q6_K), set by the loader;
    `weight` is then a placeholder on meta. The same NOTE as Linear's holds: a replaced parameter needs
    use_dense_weight again."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup = SINGLE):
        """Tensor parallel: this rank holds rows [rank x V / T, (rank + 1) x V / T) of the V-token vocabulary."""
        self.weight_slice = column_slice(num_embeddings, tp)
        super().__init__(num_embeddings // tp.size, embedding_dim)
        self.tp = tp
        self.use_dense_weight()

    def checkpoint_slice(self, attr: str, shard: int | None) -> CheckpointSlice | None:
        return self.weight_slice

    def reset_parameters(self) -> None:
        pass  # filled by the loader (see the module docstring)

    def use_dense_weight(self) -> None:
        self.weight_format: DenseWeight | Int8Weight | Int4Weight | Int4SuperblockWeight | Int6SuperblockWeight = \
            DenseWeight(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_slice is None:
            return ops.embedding(ids, self.weight_format).to(self.weight.dtype)  # rows from codes come as float32
        # this rank's rows, zeros for the others' ids; the sum over the group has every row exactly
        local = ids - self.weight_slice.start
        outside = (local < 0) | (local >= self.weight_slice.length)
        rows = ops.embedding(local.masked_fill(outside, 0), self.weight_format).to(self.weight.dtype)
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(1), 0))
