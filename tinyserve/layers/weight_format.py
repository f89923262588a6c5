"""The formats a linear's matrix can be held in; each Linear holds exactly one, chosen at load time
(layers/linear.py), and ops.linear multiplies by it.

- DenseWeight: the plain [out, in] matrix for F.linear: float32 (the exact reference), and every dtype
  and device off our kernels.
- Bf16Weight: bfloat16 on CPU where our kernels are built: csrc/bf16_matmul.cpp reads weights
  interleaved by 16 rows, one per vector lane, faster than oneDNN at a few tokens per step and even
  with it for batches (docs/PERFORMANCE.md, "bfloat16 linears in our own kernel").
- OneDnnWeight: bfloat16 on CPU without our kernels: `F.linear` would reach oneDNN with the plain
  matrix, which it converts to its blocked layout on every call, so it gets the blocked one once (what
  inductor's freezing pass does; docs/PERFORMANCE.md, "Changes, each measured before and after").
- Int8Weight, Int4Weight (layers/quant.py): weight-only quantization, in our int kernels' layout.
- Int8ChannelWeight (layers/quant.py): int8 with one scale per row, which prefills at 1.6-2x bfloat16.
- Int4SuperblockWeight (layers/quant.py): a GGUF's Q4_K matrix in its own codes and super-block scales (w4a16).
- Int5Weight, Int5SuperblockWeight, Int6SuperblockWeight (layers/quant.py): a GGUF's Q5_0 / Q5_1, Q5_K, Q6_K
  matrix in its own 5-bit, 5-bit, 6-bit codes and scales (w4a16).
- StackedWeight: a merged linear (QKV) whose file stores its projections in different types (a Q4_K_M's Q4_K
  q and k beside a Q6_K v), each run of rows in its own type's format, one matmul a run.

Whatever the format, the plain copy is dropped once it is repacked: weights live once, in the layout
their kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.layers.quant import (Int4SuperblockWeight, Int4Weight, Int5SuperblockWeight, Int5Weight,
                                    Int6SuperblockWeight, Int8ChannelWeight, Int8Weight, kernel_layout)

# Tokens per step oneDNN's blocked layout is tuned for; near the best at every step size measured
# (docs/PERFORMANCE.md, "Changes, each measured before and after").
PACK_BATCH_HINT = 64


@dataclass(frozen=True)
class DenseWeight:
    weight: torch.Tensor  # [out, in]: the module's own parameter, as loaded


@dataclass(frozen=True)
class OneDnnWeight:
    blocked: torch.Tensor  # oneDNN's opaque blocked layout of a bfloat16 [out, in] matrix

    @classmethod
    def pack(cls, weight: torch.Tensor) -> OneDnnWeight:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT))


@dataclass(frozen=True)
class Bf16Weight:
    """Blocks of 16 rows (zero rows pad the last); per block and pair of inputs, the 16 rows' two weights
    side by side (csrc/bf16_matmul.cpp)."""

    interleaved: torch.Tensor  # [blocks, in * 16] bfloat16
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Bf16Weight:
        # the int kernels' interleaving, with one group per row and 4 bytes = 2 weights per lane
        out_features, in_features = weight.shape
        pairs = weight.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(out_features, 1, in_features // 2, 4)
        interleaved, _ = kernel_layout(pairs, [])
        return cls(interleaved.view(torch.bfloat16), out_features)


@dataclass(frozen=True)
class StackedWeight:
    """Runs of rows, each in its own format: out = the runs' outputs side by side. For a merged linear whose
    file holds its projections in types that no one format takes as they are: one format for all would hold
    them requantized (int8 in w4a16 mode: a Q4_K projection at 272 bytes per 256 weights for the file's 144)."""

    parts: tuple  # the runs' formats (LinearWeight), first rows first
    out_features: int


LinearWeight = (DenseWeight | OneDnnWeight | Bf16Weight | Int8Weight | Int4Weight | Int8ChannelWeight
                | Int4SuperblockWeight | Int5Weight | Int5SuperblockWeight | Int6SuperblockWeight | StackedWeight)
