"""Token (and position) embeddings: a row lookup, from the int8 codes of a quantized tied head if any.

Why a class of our own: the weights always come from a checkpoint, so the random init nn.Embedding runs
at construction is skipped. On the meta device (where the loader builds models) that init is torch's
Python reference of `normal_`, whose first use imports torch._dynamo and sympy: ~50 MiB resident for a
server that never compiles anything.

Why int8 lookups: a quantized model's tied LM head is int8 (layers/quant.py), and the embedding's rows
are exactly its values, so the rows are read from the head's codes instead of a bfloat16 copy of the
matrix (56 MiB for SmolLM2-135M).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.layers.direct_call import DirectCall
from tinyserve.layers.quant import Int8Weight


class Embedding(DirectCall, nn.Embedding):
    kernel_weight: Int8Weight | None = None  # set with a quantized tied head; `weight` is then on meta

    def reset_parameters(self) -> None:
        pass  # filled by the loader (see the module docstring)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernel_weight is not None:
            return self.kernel_weight.rows(ids).to(self.weight.dtype)
        return F.embedding(ids, self.weight)
