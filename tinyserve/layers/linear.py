"""Linear layers, and the one-time repacking of their weights into the layout a CPU kernel reads.

A MergedLinear is one matmul standing for several checkpoint projections stacked on the output dim
(q/k/v, gate/up): fewer, larger ops per step. The loader fills it shard by shard.

Why repack (bfloat16 on CPU): our kernel (csrc/bf16_matmul.cpp) reads weights interleaved by 16 rows;
over the model's linears it is 1.5x faster than oneDNN at one token per step and even with it at 16-512
(docs/PERFORMANCE.md). Where our kernels are not built, `F.linear` goes to oneDNN, which converts the
plain weight to its blocked layout on every call, so it gets the blocked weight once at load time
(what inductor's freezing pass does; 1.4-1.9x faster). Either way the plain copy is then dropped:
weights live once, in the layout the kernel reads. Quantized weights (layers/quant.py) take the same
slot, `kernel_weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.layers import cpu_kernels
from tinyserve.layers.direct_call import DirectCall
from tinyserve.layers.embedding import Embedding
from tinyserve.layers.quant import Int4Weight, Int8Weight, kernel_layout

# Tokens per step the blocked layout is tuned for; measured flat from 1 to 300 tokens per step.
PACK_BATCH_HINT = 64


class Bf16Weight:
    """A bfloat16 weight in our kernel's layout: blocks of 16 rows (zero rows pad the last); per block and
    pair of inputs, the 16 rows' two weights side by side (csrc/bf16_matmul.cpp)."""

    def __init__(self, weight: torch.Tensor, out_features: int):
        self.weight, self.out_features = weight, out_features

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Bf16Weight:
        # the int kernels' interleaving, with one group per row and 4 bytes = 2 weights per lane
        out_features, in_features = weight.shape
        pairs = weight.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(out_features, 1, in_features // 2, 4)
        interleaved, _ = kernel_layout(pairs, [])
        return cls(interleaved.view(torch.bfloat16), out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in] bfloat16 -> [tokens, out]"""
        return cpu_kernels.bf16_matmul(x, self.weight, self.out_features)


KernelWeight = Bf16Weight | Int8Weight | Int4Weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
           kernel_weight: KernelWeight | None = None) -> torch.Tensor:
    if kernel_weight is not None:
        out = kernel_weight.matmul(x)
        return out if bias is None else out + bias
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(DirectCall, nn.Linear):
    """nn.Linear whose weight can be repacked once for a kernel (see pack_linear_weights)."""

    packed_weight: torch.Tensor | None = None  # oneDNN's blocked layout
    kernel_weight: KernelWeight | None = None  # our kernels' (bf16 here, int8 / int4: layers/quant.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.kernel_weight)


class MergedLinear(Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        """(first output row, number of rows) of one stacked projection."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]


class TiedLMHead(DirectCall, nn.Module):
    """The LM head of a model with tied embeddings: logits through the input embedding's matrix. The
    matrix stays the embedding's parameter (not registered here, so the loader expects it once)."""

    packed_weight: torch.Tensor | None = None
    kernel_weight: KernelWeight | None = None

    def __init__(self, embedding: Embedding):
        super().__init__()
        self._embedding = (embedding,)  # a tuple hides it from nn.Module's registry

    @property
    def embedding(self) -> Embedding:
        return self._embedding[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.packed_weight, self.kernel_weight)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Repacking pays for bfloat16 on a CPU whose oneDNN has bf16 kernels (AVX512-BF16 / AMX)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module, own_kernel: bool | None = None) -> int:
    """Repack every unquantized Linear and tied head of a loaded bfloat16 model in place, for our kernel
    (own_kernel; by default where it is built) or else for oneDNN; returns how many. A Linear's plain
    weight is replaced by a meta-device placeholder of the same shape (no memory); a tied head's is the
    embedding's and stays."""
    own = cpu_kernels.load() is not None if own_kernel is None else own_kernel
    count = 0
    for module in model.modules():
        if (isinstance(module, (Linear, TiedLMHead)) and module.packed_weight is None
                and module.kernel_weight is None):
            weight = module.weight.detach()
            if own and weight.shape[1] % 16 == 0:  # the kernel sums 8 pairs of inputs per step
                module.kernel_weight = Bf16Weight.pack(weight)
            else:
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            if isinstance(module, Linear):
                module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
            count += 1
    return count


def quantize_linear_weights(model: nn.Module, quantization: str) -> int:
    """Quantize every Linear of a loaded (float32) model in place, the LM head in int8 in both modes;
    returns how many. Our int kernels then run every step: they beat oneDNN's bfloat16 at every step
    size here, from 1 token (4x) to 512 (1.05x), so no float copy is kept (a Linear's weight becomes a
    meta-device placeholder). A tied head's matrix is the embedding's, so the embedding looks its rows up
    in the head's int8 codes (layers/embedding.py): one model, in lookups and logits, stored once.

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
        if isinstance(module, (Linear, TiedLMHead)) and module.kernel_weight is None:
            fmt = Int4Weight if quantization == "int4" and not is_head else Int8Weight
            quantized, dequantized = fmt.quantize(module.weight.detach())
            if int_kernels:
                module.kernel_weight = quantized
                owner = module  # the module that holds the matrix
                if isinstance(module, TiedLMHead):  # the embedding's: its lookups read the same codes
                    owner = module.embedding
                    owner.kernel_weight = quantized
                owner.weight = nn.Parameter(owner.weight.to("meta"), requires_grad=False)
            else:
                module.weight.data.copy_(dequantized)
            count += 1
    return count
