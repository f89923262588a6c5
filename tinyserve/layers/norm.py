"""Normalization layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.layers import cpu_kernels
from tinyserve.layers.direct_call import DirectCall


class RMSNorm(DirectCall, nn.Module):
    """x / rms(x) * weight, with the statistics in float32 whatever the activation dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with the pre-norm decoder's residual stream, (norm(x + residual), x + residual),
        the sum possibly written into residual's memory. One C++ call on CPU (cpu_kernels)."""
        if cpu_kernels.applies(x) and x.is_contiguous() and self.weight.dtype == x.dtype:
            if residual is None:
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm(residual, self.weight, self.eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch formula (Hugging Face's): the fallback off the CPU kernels, and their yardstick."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LayerNorm(DirectCall, nn.Module):
    """Classic LayerNorm with weight and bias (GPT-2)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
