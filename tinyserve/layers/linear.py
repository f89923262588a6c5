"""Linear layers. A MergedLinear is one matmul standing for several checkpoint projections stacked on the
output dim (q/k/v, gate/up): fewer, larger ops per step. The loader fills it shard by shard."""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        """(first output row, number of rows) of one stacked projection."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]
