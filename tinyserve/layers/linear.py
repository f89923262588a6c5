"""Linear layers, and the one-time repacking of their weights for the CPU's matrix units.

A MergedLinear is one matmul standing for several checkpoint projections stacked on the output dim
(q/k/v, gate/up): fewer, larger ops per step. The loader fills it shard by shard.

Why repack: on CPU, `F.linear` in bfloat16 goes to oneDNN, which converts the plain [out, in] weight to
its blocked layout on every call. Converting once at load time and calling oneDNN with the
blocked weight (what inductor's freezing pass does) measured 1.4-1.9x faster over the model's linears
at 1-64 tokens per step on this machine (docs/PERFORMANCE.md). The plain copy is then dropped: weights
live once, in the layout the kernel reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.layers import cpu_kernels
from tinyserve.layers.quant import Int4Weight, Int8Weight

# Tokens per step the blocked layout is tuned for; measured flat from 1 to 300 tokens per step.
PACK_BATCH_HINT = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
           quantized: Int8Weight | Int4Weight | None = None) -> torch.Tensor:
    if quantized is not None:
        out = quantized.matmul(x)
        return out if bias is None else out + bias
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose weight can be repacked once for oneDNN (see pack_linear_weights)."""

    packed_weight: torch.Tensor | None = None
    quantized: Int8Weight | Int4Weight | None = None  # see layers/quant.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.quantized)


class MergedLinear(Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        """(first output row, number of rows) of one stacked projection."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]


class TiedLMHead(nn.Module):
    """The LM head of a model with tied embeddings: logits through the input embedding's matrix. The
    matrix stays the embedding's parameter (not registered here, so the loader expects it once)."""

    packed_weight: torch.Tensor | None = None
    quantized: Int8Weight | None = None

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._embedding = (embedding,)  # a tuple hides it from nn.Module's registry

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.packed_weight, self.quantized)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Repacking pays for bfloat16 on a CPU whose oneDNN has bf16 kernels (AVX512-BF16 / AMX)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module) -> int:
    """Repack every unquantized Linear and tied head of a loaded model in place; returns how many. A Linear's plain
    weight is replaced by a meta-device placeholder of the same shape (no memory); a tied head's is the
    embedding's and stays."""
    count = 0
    for module in model.modules():
        if (isinstance(module, (Linear, TiedLMHead)) and module.packed_weight is None
                and module.quantized is None):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_BATCH_HINT)
            if isinstance(module, Linear):
                module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
            count += 1
    return count


def quantize_linear_weights(model: nn.Module, quantization: str) -> int:
    """Quantize every Linear of a loaded (float32) model in place, the LM head in int8 in both modes;
    returns how many. Our int kernels then run every step: they beat oneDNN's bfloat16 at every step
    size here, from 1 token (4x) to 512 (1.05x), so no float copy is kept (a Linear's weight becomes a
    meta-device placeholder). A tied head's matrix is the embedding's, so the embedding rows become the
    int8 values: one model, in lookups and logits.

    Why the head: it reads 28M weights for every token, ~2.3 ms of a 9 ms int4 step in bfloat16 here.
    Why int8 there: in int4 it was faster still but cost 7% perplexity (docs/PERFORMANCE.md). The
    default GGUF stores it as Q8_0, so int8 keeps its exact values.

    Without our C++ kernels (logged by cpu_kernels) the weights become the dequantized values and run
    through the float path: the same model, slower.
    """
    int_kernels = cpu_kernels.load() is not None
    count = 0
    for name, module in model.named_modules():
        is_head = isinstance(module, TiedLMHead) or name.rsplit(".", 1)[-1] == "lm_head"
        if isinstance(module, (Linear, TiedLMHead)) and module.quantized is None:
            fmt = Int4Weight if quantization == "int4" and not is_head else Int8Weight
            quantized, dequantized = fmt.quantize(module.weight.detach())
            if int_kernels and isinstance(module, Linear):
                module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
            else:
                module.weight.data.copy_(dequantized)
            module.quantized = quantized if int_kernels else None
            count += 1
    return count
