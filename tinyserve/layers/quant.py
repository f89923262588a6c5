"""Weight-only quantization of the linear layers (CPU): int8 per output channel, int4 in groups of 32.

Why: a decode step with a few tokens is bound by reading the weights, so fewer bytes per weight is
faster. On this machine, all of SmolLM2-135M's linears at one token per step take 13.5 ms in packed
bfloat16, 9.3 ms in int8 and 4.6 ms in int4 (docs/PERFORMANCE.md). With dozens of tokens per step the
same int kernels are 2-3x *slower* than bfloat16 on oneDNN, because they are compute-bound there.

So a quantized layer keeps two layouts of one set of weights: the int kernel's, used for steps of at
most `max_tokens` tokens, and the dequantized values in bfloat16 (packed for oneDNN by the caller),
used for larger steps. Both hold the same quantized values, so the model is the quantized model whatever
the step size; only the kernel (and its rounding) changes, as in any GEMM library.

int4 is asymmetric with a scale and a minimum per group of 32 inputs: the layout of GGUF's Q4_1, so a
Q4_1 checkpoint keeps its own 4-bit codes (tests/test_quant.py checks them against the file's blocks).
The int kernels take bfloat16 activations: with float32 ones they run 10-25x slower here.
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP = 32
_TINY = torch.finfo(torch.float32).tiny  # keeps an all-zero row or group from dividing by zero


class Int8Weight:
    """Symmetric int8 with one scale per output row."""

    max_tokens = 2  # measured: int8 beats packed bfloat16 only up to ~2 tokens per step

    def __init__(self, weight: torch.Tensor):
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=_TINY).to(torch.bfloat16)  # the kernel's dtype
        self.codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scales

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
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

    def __init__(self, weight: torch.Tensor):
        codes, scale, minimum = int4_codes(weight)
        # The kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale; both in bfloat16
        # (the kernel's only dtype for them), laid out [groups, out, 2].
        zero = minimum + 8 * scale
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self._codes = codes  # kept only until dequantize() (4 bytes per weight)

    def dequantize(self) -> torch.Tensor:
        codes, self._codes = self._codes, None
        scale, zero = self.scales_and_zeros.float().unbind(-1)  # [groups, out] each
        grouped = codes.reshape(codes.shape[0], -1, INT4_GROUP).float()
        return ((grouped - 8) * scale.t()[..., None] + zero.t()[..., None]).reshape(codes.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)


def quantized_matmul(x: torch.Tensor, quantized: Int8Weight | Int4Weight) -> torch.Tensor:
    if x.dim() == 2 and x.dtype == torch.bfloat16:  # the model's case: flattened tokens
        return quantized.matmul(x)
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    return quantized.matmul(flat).to(x.dtype).reshape(*x.shape[:-1], -1)


def check_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(f"quantization {quantization!r} runs on CPU with dtype bfloat16 (or auto), "
                         f"got {device.type} and {dtype}")
