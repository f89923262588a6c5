"""Normalization layers: their weights, and the math in layers/ops.py."""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.layers import ops
from tinyserve.layers.direct_call import DirectCall


class RMSNorm(DirectCall, nn.Module):
    """x / rms(x) * weight, with the statistics in float32 whatever the activation dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with the pre-norm decoder's residual stream, (norm(x + residual), x + residual),
        the sum possibly written into residual's memory."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(DirectCall, nn.Module):
    """x / rms(x) * (1 + weight), in float32 (Gemma's checkpoints store the weight as an offset from 1)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gemma_rms_norm(x, self.weight, self.eps)


class LayerNorm(DirectCall, nn.Module):
    """Classic LayerNorm with weight and bias (GPT-2)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)
