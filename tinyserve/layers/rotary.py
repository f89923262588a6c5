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
    """The rotation for a step's positions, computed once per step and applied in every layer. The
    cos/sin table is a plain attribute, not a buffer, so that a model built on the meta device and
    materialized with to_empty() keeps it; it follows positions to their device."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None = None):
        super().__init__()
        # Built on the host even inside a `torch.device("meta")` block, then moved once to the device.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, base, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, head_dim/2]
        # Full width, with rotate-half's sign folded into sin: x * cos + roll(x, half) * sin is
        # (x1 cos - x2 sin, x2 cos + x1 sin) in 4 ops instead of 8, bit for bit the same.
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, head_dim] in dtype, for ops.rotary."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

