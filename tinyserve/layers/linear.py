"""Linear layers, and the one-time choice of the format their matrices are multiplied in.

A MergedLinear is one matmul standing for several checkpoint projections stacked on the output dim
(q/k/v, gate/up): fewer, larger ops per step. The loader fills it shard by shard.

Each linear (and tied LM head) holds one weight format (layers/weight_format.py): DenseWeight of its
`weight` parameter as built and loaded; then, once, at load time, bfloat16 on CPU is repacked for our
kernel or oneDNN (pack_linear_weights) and `--quantization` gives int codes (quantize_linear_weights).
"""

from __future__ import annotations

import dataclasses

import logging
from collections.abc import Iterator

import torch
from torch import nn

from tinyserve.layers import ops
from tinyserve.layers.direct_call import DirectCall
from tinyserve.layers.embedding import Embedding
from tinyserve.layers.quant import (Int4SuperblockWeight, Int4Weight, Int5SuperblockWeight, Int5Weight,
                                    Int6SuperblockWeight, Int8ChannelWeight, Int8Weight)
from tinyserve.layers.weight_format import Bf16Weight, DenseWeight, LinearWeight, OneDnnWeight
from tinyserve.parallel.group import TensorParallelGroup
from tinyserve.parallel.shard import CheckpointSlice

logger = logging.getLogger(__name__)


class Linear(DirectCall, nn.Linear):
    """nn.Linear multiplying by `weight_format`: DenseWeight(self.weight) until a load-time repacking
    replaces it, after which `weight` is a shape-only placeholder on the meta device.

    NOTE: DenseWeight holds the parameter object. Casts keep that object (`module.to(dtype)` swaps its
    data); whatever replaces the parameter itself (the loader materializing the meta model) must call
    use_dense_weight again (use_dense_weights)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, is_lm_head: bool = False,
                 weight_slice: CheckpointSlice | None = None):
        super().__init__(in_features, out_features, bias=bias)
        # tensor parallel: the rows (column-parallel) or columns (row-parallel) of the checkpoint's matrix
        # this rank holds (parallel/shard.py); None: all of it
        self.weight_slice = weight_slice
        self.is_lm_head = is_lm_head  # set by the model that builds its head: quantized to int8 in both modes
        # bits per weight its checkpoint stored it at, the most over a merged one's shards (set by the loader;
        # None: float or unknown): int4 mode quantizes a matrix stored at more than 4 bits to int8
        self.stored_bits: int | None = None
        self.use_dense_weight()

    def use_dense_weight(self) -> None:
        self.weight_format: LinearWeight = DenseWeight(self.weight)

    def checkpoint_slice(self, attr: str, shard: int | None) -> CheckpointSlice | None:
        """Where a parameter's values lie in its checkpoint tensor (the loader cuts it there)."""
        if attr == "bias" and self.weight_slice is not None and self.weight_slice.dim == 1:
            return None  # a row-parallel layer adds its whole bias once, after the sum
        return self.weight_slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight_format, self.bias)


class RowParallelLinear(Linear):
    """Tensor parallel's second matmul (o_proj, down_proj): this rank's input columns times its slice of
    the input, summed over the group, then the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup):
        weight_slice = CheckpointSlice(1, tp.rank * in_features, in_features, in_features * tp.size)
        super().__init__(in_features, out_features, bias=bias, weight_slice=weight_slice)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(ops.linear(x, self.weight_format))
        return out if self.bias is None else out + self.bias


def row_parallel_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> Linear:
    """A Linear of this rank's in_features inputs (its share of the checkpoint's), summed over the group."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class MergedLinear(Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 shard_slices: list[CheckpointSlice | None] | None = None):
        """shard_slices: tensor parallel's rows of each stacked projection's checkpoint tensor on this rank."""
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.shard_slices = shard_slices or [None] * len(output_sizes)

    def shard_offset(self, shard: int) -> tuple[int, int]:
        """(first output row, number of rows) of one stacked projection."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def checkpoint_slice(self, attr: str, shard: int | None) -> CheckpointSlice | None:
        return None if shard is None else self.shard_slices[shard]


class TiedLMHead(DirectCall, nn.Module):
    """The LM head of a model with tied embeddings: logits through the input embedding's matrix. The
    matrix stays the embedding's parameter (not registered here, so the loader expects it once)."""

    is_lm_head = True

    def __init__(self, embedding: Embedding):
        super().__init__()
        self._embedding = (embedding,)  # a tuple hides it from nn.Module's registry
        self.use_dense_weight()

    @property
    def embedding(self) -> Embedding:
        return self._embedding[0]

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def use_dense_weight(self) -> None:
        self.weight_format: LinearWeight = DenseWeight(self.embedding.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight_format)


def use_dense_weights(model: nn.Module) -> None:
    """Point every linear, tied head and embedding at its current `weight` parameter: the loader calls
    this once it has replaced the parameters the model was built with on the meta device."""
    for module in model.modules():
        if isinstance(module, (Linear, TiedLMHead, Embedding)):
            module.use_dense_weight()


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Repacking pays for bfloat16 on a CPU whose oneDNN has bf16 kernels (AVX512-BF16 / AMX)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _dense_heads_and_linears(model: nn.Module) -> list[Linear | TiedLMHead]:
    return [m for m in model.modules()
            if isinstance(m, (Linear, TiedLMHead)) and isinstance(m.weight_format, DenseWeight)]


def pack_linear_weights(model: nn.Module, own_kernel: bool | None = None) -> int:
    """Repack every dense Linear and tied head of a loaded bfloat16 model in place, for our kernel
    (own_kernel; by default where it is built) or else for oneDNN; returns how many. A Linear's plain
    weight is replaced by a meta-device placeholder of the same shape (no memory); a tied head's is the
    embedding's and stays."""
    return sum(1 for _ in pack_linear_weights_in_pieces(model, own_kernel))


def pack_linear_weights_in_pieces(model: nn.Module, own_kernel: bool | None = None) -> Iterator[None]:
    """pack_linear_weights, yielding after each module (a load in pieces: loader/model_loader.py)."""
    own = ops.has_cpu_kernels() if own_kernel is None else own_kernel
    for module in _dense_heads_and_linears(model):
        weight = module.weight.detach()
        if own and weight.shape[1] % 16 == 0:  # the kernel sums 8 pairs of inputs per step
            module.weight_format = Bf16Weight.pack(weight)
        else:
            module.weight_format = OneDnnWeight.pack(weight)
        if isinstance(module, Linear):
            module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
        yield


def quantize_linear_weights(model: nn.Module, quantization: str) -> int:
    """Quantize every dense Linear of a loaded (float32) model in place, the LM head in int8 in both
    modes; returns how many. (The loader instead takes each matrix straight into its format as it reads it,
    loader/staged_linears.py, where a head the file stores as Q4_x keeps those codes: quantized_format.) Our int kernels then run every step (they lead bfloat16 at every step size:
    docs/PERFORMANCE.md, "Speed modes"), so no float copy is kept (a Linear's weight becomes a meta-device
    placeholder). A tied head's matrix is the embedding's, so the embedding looks its rows up in the
    head's int8 codes (layers/embedding.py): one model, in lookups and logits, stored once.

    Why the head: it reads vocab x hidden weights for every token, a large share of an int4 step in
    bfloat16. Why int8 there: in int4 it was faster still but cost perplexity (docs/PERFORMANCE.md,
    "Speed modes"). The default GGUF stores it as Q8_0, so int8 keeps its exact values.

    In int8 mode the block linears take one scale per row (Int8ChannelWeight: as fast at decode, ~1.3x
    faster from 64 rows, no worse in perplexity: docs/PERFORMANCE.md, "Prefill at the integer rate"), except
    where the file stores a matrix (or a merged one's shard) as Q8_0, whose own values Int8Weight keeps.

    In int4 and w4a16 modes a Linear whose checkpoint stored it at more than 4 bits (`stored_bits`: a K-quant mix's
    Q5_0 / Q6_K / Q8_0 tensors) is quantized to int8 too: the file's own choice of precision per tensor,
    kept as llama.cpp keeps it. A float checkpoint made no such choice: its matrices all go to int4.

    w4a16 stores what int4 stores; its kernels keep the activations unrounded (csrc/quantized_matmul_a16.cpp).

    Without our C++ kernels (logged by cpu_kernels) the weights become the dequantized values and run
    through the float path: the same model, slower.
    """
    return sum(1 for _ in quantize_linear_weights_in_pieces(model, quantization))


def quantize_linear_weights_in_pieces(model: nn.Module, quantization: str) -> Iterator[None]:
    """quantize_linear_weights, yielding after each module (a load in pieces: loader/model_loader.py)."""
    int_kernels = ops.has_cpu_kernels()
    block_formats = []
    for module in _dense_heads_and_linears(model):
        fmt = quantized_format(module, quantization)
        if not module.is_lm_head:
            block_formats.append(fmt)
        quantized, dequantized = fmt.quantize(module.weight.detach())
        if quantization == "w4a16":  # the same codes; the activations stay unrounded
            quantized = dataclasses.replace(quantized, int8_inputs=False)
        if not int_kernels:
            module.weight.data.copy_(dequantized)
        else:
            module.weight_format = quantized
            owner = module  # the module that holds the matrix
            if isinstance(module, TiedLMHead):  # the embedding's: its lookups read the same codes
                owner = module.embedding
                owner.weight_format = quantized
            owner.weight = nn.Parameter(owner.weight.to("meta"), requires_grad=False)
        yield
    log_kept_at_int8(quantization, block_formats)


def log_kept_at_int8(quantization: str, block_formats: list[QuantizedFormat]) -> None:
    """Says how many block linears int4 / w4a16 keep at int8 (the file stores them at 5-8 bits)."""
    kept = sum(1 for fmt in block_formats if fmt is Int8Weight) if quantization != "int8" else 0
    if kept:
        logger.info("%s: %d of %d linears kept at int8 (the file stores them at 5-8 bits)", quantization, kept,
                    len(block_formats))


QuantizedFormat = (type[Int4Weight] | type[Int8Weight] | type[Int8ChannelWeight] | type[Int4SuperblockWeight]
                   | type[Int5Weight] | type[Int5SuperblockWeight] | type[Int6SuperblockWeight])
# the bits of a K-quant's super-blocks (Q4_K: 4, Q5_K: 5, Q6_K: 6) -> the format w4a16 computes them in, from
# their codes
SUPERBLOCK_FORMATS = {4: Int4SuperblockWeight, 5: Int5SuperblockWeight, 6: Int6SuperblockWeight}


def quantized_format(module: Linear | TiedLMHead | Embedding, quantization: str,
                     file_code_bits: int | None = None, superblock_bits: int | None = None) -> QuantizedFormat:
    """The format `quantization` gives the module's matrix (quantize_linear_weights says why).
    file_code_bits: the bits of the file's codes that our formats take as they are (a GGUF's Q4_0 / Q4_1: 4,
    Q5_0 / Q5_1: 5, w4a16's Int5Weight alone; Q8_0: 8; None: other types or a float checkpoint): the LM head (and
    an untied embedding held in codes) keeps the file's own 4-bit codes where it has them, as llama.cpp computes
    it, and is int8 otherwise.
    superblock_bits: the file stores the whole matrix in one K-quant type of these bits (Q4_K, Q5_K, Q6_K), which
    w4a16 computes from its own codes (SUPERBLOCK_FORMATS; a head too where it is Q6_K: the file's values in
    fewer bytes than int8's; an untied embedding where it is Q4_K or Q6_K: a 128K-row table stays at the file's
    size, not float32's); the other modes requantize it by rows."""
    if quantization == "w4a16" and superblock_bits == 6:
        return Int6SuperblockWeight
    if quantization == "w4a16" and superblock_bits == 4 and isinstance(module, Embedding):  # untied: its rows
        return Int4SuperblockWeight
    if isinstance(module, Embedding) or module.is_lm_head:
        return Int4Weight if file_code_bits == 4 and quantization != "int8" else Int8Weight
    if quantization == "w4a16" and superblock_bits in SUPERBLOCK_FORMATS:
        return SUPERBLOCK_FORMATS[superblock_bits]
    if quantization == "w4a16" and file_code_bits == 5:
        return Int5Weight
    if file_code_bits == 4 and quantization != "int8":  # Q4_0 / Q4_1: their own codes (a merged linear's run of
        return Int4Weight                               # them too, beside a projection stored at more bits)
    if module.stored_bits == 8 or file_code_bits == 8:  # Q8_0 in the file: its own values
        return Int8Weight
    if quantization == "int8":
        return Int8ChannelWeight
    stored_bits = module.stored_bits
    return Int8Weight if stored_bits is not None and stored_bits > 4 else Int4Weight
