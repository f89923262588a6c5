"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.layers import cpu_kernels
from tinyserve.layers.direct_call import DirectCall


class SiluAndMul(DirectCall, nn.Module):
    """SwiGLU on a fused gate_up projection: [..., 2 * d] -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.applies(x) and x.is_contiguous():
            return cpu_kernels.silu_and_mul(x)  # one C++ call instead of chunk, silu, mul
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu_new: the tanh approximation of GELU."""
    return F.gelu(x, approximate="tanh")
