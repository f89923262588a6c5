"""Weight-only quantization of the linear layers (CPU): int8 per output channel, int4 in groups of 32.

Why: a decode step with a few tokens is bound by reading the weights, so fewer bytes per weight is
faster. On this machine, all of SmolLM2-135M's linears at one token per step take 13.5 ms in packed
bfloat16, 9.3 ms in int8 and 4.6 ms in int4 (docs/PERFORMANCE.md). With dozens of tokens per step the
same int kernels are 2-3x *slower* than bfloat16 on oneDNN, because they are compute-bound there.

So a quantized layer keeps two layouts of one set of weights: the int kernel's, used for steps of at
most `max_tokens` tokens (activations [tokens, in] in bfloat16), and the dequantized values in bfloat16
(packed for oneDNN by the caller), used for larger steps. Both hold the same quantized values, so the
model is the quantized model whatever the step size; only the kernel (and its rounding) changes, as in
any GEMM library.

int4 is asymmetric with a scale and a minimum per group of 32 inputs: the layout of GGUF's Q4_1, so a
Q4_1 checkpoint keeps its own 4-bit codes (tests/test_quant.py checks them against the file's blocks).
The int kernels take bfloat16 activations: with float32 ones they run 10-25x slower here.
"""

from __future__ import annotations

import torch

from tinyserve.config import QUANTIZATIONS

INT4_GROUP = 32
_TINY = torch.finfo(torch.float32).tiny  # keeps an all-zero row or group from dividing by zero


class Int8Weight:
    """Symmetric int8 with one scale per output row."""

    max_tokens = 2  # measured: int8 beats packed bfloat16 only up to ~2 tokens per step

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes, self.scales = codes, scales  # [out, in] int8, [out] bfloat16

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[Int8Weight, torch.Tensor]:
        """The quantized weight and its dequantized values (float32)."""
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=_TINY).to(torch.bfloat16)  # the kernel's dtype
        codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(codes, scales), codes.float() * scales.float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in] bfloat16 -> [tokens, out]"""
        return torch._weight_int8pack_mm(x, self.codes, self.scales)


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1's rule per group of 32 inputs: minimum = the group's min, scale = (max - min) / 15,
    code = round((w - minimum) / scale). Returns codes [out, in] int32, scale and minimum [out, groups]."""
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP:
        raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {in_features}")
    groups = weight.float().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    minimum = groups.amin(dim=-1, keepdim=True)
    scale = ((groups.amax(dim=-1, keepdim=True) - minimum) / 15).clamp(min=_TINY)
    codes = torch.round((groups - minimum) / scale).clamp(0, 15).to(torch.int32).reshape(weight.shape)
    return codes, scale.squeeze(-1), minimum.squeeze(-1)


class Int4Weight:
    """Asymmetric int4 per group of 32 inputs: w = code * scale + minimum, code in [0, 15]."""

    max_tokens = 8  # measured: int4 beats packed bfloat16 up to ~8-10 tokens per step

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor):
        self.packed, self.scales_and_zeros = packed, scales_and_zeros  # the kernel's layouts

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[Int4Weight, torch.Tensor]:
        """The quantized weight and its dequantized values (float32)."""
        codes, scale, minimum = int4_codes(weight)
        # The kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale; both in bfloat16
        # (the kernel's only dtype for them), laid out [groups, out, 2].
        scales_and_zeros = torch.stack([scale.t(), (minimum + 8 * scale).t()], dim=-1).to(torch.bfloat16)
        scale, zero = scales_and_zeros.float().unbind(-1)  # rounded as the kernel reads them
        grouped = codes.reshape(codes.shape[0], -1, INT4_GROUP).float()
        dequantized = ((grouped - 8) * scale.t()[..., None] + zero.t()[..., None]).reshape(codes.shape)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return cls(packed, scales_and_zeros.contiguous()), dequantized

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in] bfloat16 -> [tokens, out]"""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)


def check_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(f"quantization {quantization!r} runs on CPU with dtype bfloat16 (or auto), "
                         f"got {device.type} and {dtype}")
