"""Rotary position embedding (the "rotate half" layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tinyserve.config import RopeScaling
from tinyserve.layers.direct_call import DirectCall


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with linear, llama3 or per-frequency scaling applied."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors":  # as ggml's rope divides each theta by its freq_factors entry
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)  # [head_dim // 2]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(DirectCall, nn.Module):
    """The rotation for a step's positions, computed once per step and applied in every layer. The cos/sin
    table is a plain attribute, not a buffer, so that a model built on the meta device and materialized with
    to_empty() keeps it; it follows positions to their device. An engine has it built for the positions it
    serves (cover_positions: its max_model_len), a model used alone at its first step for all of the model's:
    a 128K-context file's full table is 64-128 MiB that an engine serving 8K tokens would hold for nothing."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim, self.max_position, self.base, self.scaling = head_dim, max_position, base, scaling
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def cover_positions(self, count: int, device: torch.device) -> None:
        """Have the table hold positions 0 .. count - 1 (at most the model's), built now on `device`, so that
        nothing is built inside a captured CUDA graph's first step. A table never shrinks: engines that share
        a model (tests, replicas of one load) each keep the positions they serve."""
        count = min(count, self.max_position)
        if self.cos is None or self.cos.shape[0] < count:
            self._build(count, device)

    def _build(self, count: int, device: torch.device) -> None:
        with torch.device("cpu"):  # on the host even inside a `torch.device("meta")` block, then moved once
            inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling)
            freqs = torch.outer(torch.arange(count, dtype=torch.float32), inv_freq)  # [count, head_dim / 2]
        # Full width, with rotate-half's sign folded into sin: x * cos + roll(x, half) * sin is
        # (x1 cos - x2 sin, x2 cos + x1 sin) in 4 ops instead of 8, bit for bit the same.
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(device)
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim] in dtype, for ops.rotary."""
        if self.cos is None:
            self._build(self.max_position, positions.device)
        elif self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def cover_positions(model: nn.Module, count: int, device: torch.device) -> None:
    """Every RotaryEmbedding of `model` holds the table of positions 0 .. count - 1 (RotaryEmbedding's)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cover_positions(count, device)
