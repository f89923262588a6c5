"""The backend seam: each op the layers and models compute, done by our C++ CPU kernel where one applies
and by its torch formula elsewhere. The only module that imports cpu_kernels, so that layer and model code
read as the math (`ops.add_rms_norm(x, residual, weight, eps)`, `ops.linear(x, weight_format, bias)`)
and another device's kernels would plug in here.

Where the kernels apply: on CPU, in float32 and bfloat16, once built (`kernel_takes`); CUDA, float16 or a
failed build take the torch formulas. In bfloat16 the elementwise kernels round where the formulas round,
so both paths give the same values (tests/test_cpu_kernels.py); in float32 they differ by summation order.
Two choices are made once rather than per call: a linear's weight format at load time (layers/linear.py;
a format other than DenseWeight exists only where its kernel does), and attention's path by the model
runner (`cpu_attention_applies`, carried in AttentionMetadata).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.layers.kernels import cpu_kernels
from tinyserve.layers import kv_cache
from tinyserve.layers.kv_cache import KVCache
from tinyserve.layers.quant import (Int4SuperblockWeight, Int4Weight, Int5SuperblockWeight, Int5Weight,
                                    Int6SuperblockWeight, Int8ChannelWeight, Int8Weight)
from tinyserve.layers.weight_format import Bf16Weight, DenseWeight, LinearWeight, OneDnnWeight, StackedWeight


def has_cpu_kernels() -> bool:
    """Whether our kernels are built here (the first call builds or loads them)."""
    return cpu_kernels.load() is not None


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels take this tensor: on CPU, in a dtype they are compiled for, and built."""
    return x.device.type == "cpu" and x.dtype in cpu_kernels.KERNEL_DTYPES and cpu_kernels.load() is not None


def cpu_attention_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention for this model runs in our C++ kernel: CPU, a compiled dtype and head size, and a
    successful build. Asked once, by the model runner, at start-up (which builds the kernels then,
    not in the first timed step)."""
    return (device.type == "cpu" and dtype in cpu_kernels.KERNEL_DTYPES and head_dim in cpu_kernels.ATTENTION_HEAD_DIMS
            and cpu_kernels.load() is not None)


def paged_kernel_applies(device: torch.device) -> bool:
    """Whether attention runs in our Triton kernel (layers/kernels/triton_attention.py) for every step shape: on CUDA
    with Triton installed. Asked once, by the model runner; the module is imported only then, so that a
    test can set TRITON_INTERPRET before its first import."""
    if device.type != "cuda":
        return False
    from tinyserve.layers.kernels import triton_attention

    return triton_attention.triton_available(device)


def paged_attention_kernel(q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                           window: int | None) -> torch.Tensor:
    """Attention of every sequence of the step over the pool, in place (where paged_kernel_applies)."""
    from tinyserve.layers.kernels.triton_attention import paged_attention_triton

    return paged_attention_triton(q, cache.key, cache.value, block_tables, seq_lens, query_start_loc, max_query_len,
                                  scale, window)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch formula (Hugging Face's): the path off the kernels, and their yardstick."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _norm_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return kernel_takes(x) and x.is_contiguous() and weight.dtype == x.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, the statistics in float32 whatever x's dtype."""
    if _norm_kernel_takes(x, weight):
        return cpu_kernels.rms_norm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm decoder's residual add fused into the norm
    after it. The sum may be written into residual's memory (the kernel does, in place)."""
    if _norm_kernel_takes(x, weight):
        return cpu_kernels.add_rms_norm(x, residual, weight, eps), residual
    residual = x + residual
    return torch_rms_norm(residual, weight, eps), residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's x / rms(x) * (1 + weight), all in float32 and rounded once at the end: Llama's formula rounds
    the normalized x before the product, and 1 + weight stored in a bfloat16 checkpoint would lose bits."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate_up projection: [..., 2 * d] -> silu(gate) * up, [..., d]."""
    if kernel_takes(x) and x.is_contiguous():
        return cpu_kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu_new: the tanh approximation of GELU."""
    return F.gelu(x, approximate="tanh")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma) on a fused gate_up projection: [..., 2 * d] -> gelu_tanh(gate) * up, [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_tokens, heads, head_dim] and k [num_tokens, kv_heads, head_dim] rotated by position (HF's
    "rotate half" layout, its sign folded into sin: layers/rotary.py), cos/sin [num_tokens, 1, head_dim].
    Where the kernel takes them, both in one call and in place (q and k may be views into the fused qkv
    output, rows strided, each head's dims contiguous); the caller must own their memory."""
    if kernel_takes(q) and all(x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] for x in (q, k)):
        cpu_kernels.rotary_(q, k, cos, sin)
        return q, k
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, dims=-1) * sin, k * cos + k.roll(half, dims=-1) * sin


# Up to this many tokens a float32 step's linears run in our kernel, above it in torch's GEMM (which gains
# on it as the tokens grow: docs/PERFORMANCE.md, "A float32 kernel for steps of a few tokens").
F32_KERNEL_MAX_TOKENS = 16


def _f32_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] <= F32_KERNEL_MAX_TOKENS and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu" and weight.is_contiguous()
            and cpu_kernels.load() is not None)


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in] times the weight in whichever format it was given at load -> [tokens, out]."""
    match weight:
        case DenseWeight():
            if not _f32_kernel_takes(x, weight.weight):
                return F.linear(x, weight.weight, bias)
            out = cpu_kernels.f32_matmul(x, weight.weight)
        case OneDnnWeight():
            return torch.ops.mkldnn._linear_pointwise(x, weight.blocked, bias, "none", [], "")
        case Bf16Weight():
            out = cpu_kernels.bf16_matmul(x, weight.interleaved, weight.out_features)
        case Int4Weight():
            matmul = cpu_kernels.int4_matmul if weight.int8_inputs else cpu_kernels.w4a16_matmul
            out = matmul(x, weight.codes, weight.scales, weight.minimums, weight.out_features)
        case Int8Weight():
            matmul = cpu_kernels.int8_matmul if weight.int8_inputs else cpu_kernels.w8a16_matmul
            out = matmul(x, weight.codes, weight.scales, weight.out_features)
        case Int8ChannelWeight():
            out = cpu_kernels.int8_channel_matmul(x, weight.codes, weight.scales, weight.out_features)
        case Int5Weight():
            out = cpu_kernels.w5a16_matmul(x, weight.codes, weight.high_bits, weight.scales, weight.minimums,
                                           weight.out_features)
        case Int5SuperblockWeight():  # before its base class, Int4SuperblockWeight
            out = cpu_kernels.w5a16_superblock_matmul(x, weight.codes, weight.high_bits, weight.d, weight.dmin,
                                                      weight.sub_scales, weight.sub_mins, weight.out_features)
        case Int4SuperblockWeight():
            out = cpu_kernels.w4a16_superblock_matmul(x, weight.codes, weight.d, weight.dmin, weight.sub_scales,
                                                      weight.sub_mins, weight.out_features)
        case Int6SuperblockWeight():
            out = cpu_kernels.w6a16_superblock_matmul(x, weight.codes, weight.high_bits, weight.d, weight.sub_scales,
                                                      weight.out_features)
        case StackedWeight():
            out = torch.cat([linear(x, part) for part in weight.parts], dim=-1)
        case _:
            raise TypeError(f"no linear for a {type(weight).__name__}")
    return out if bias is None else out + bias


def embedding(ids: torch.Tensor, weight: DenseWeight | Int8Weight | Int4Weight | Int4SuperblockWeight
              | Int6SuperblockWeight) -> torch.Tensor:
    """Rows `ids` of the matrix: [n] -> [n, dim]; from codes (int8, int4, Q4_K's, Q6_K's) as float32 (the caller
    casts)."""
    match weight:
        case DenseWeight():
            return F.embedding(ids, weight.weight)
        case Int8Weight() | Int4Weight() | Int4SuperblockWeight() | Int6SuperblockWeight():
            return weight.rows(ids)  # Int4SuperblockWeight's refuses its Q5_K subclass
        case _:
            raise TypeError(f"no embedding lookup for a {type(weight).__name__}")


def cpu_paged_attention(q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor | None, scale: float, window: int | None,
                        soft_cap: float | None = None) -> torch.Tensor:
    """Attention of every sequence of a step in our C++ kernel (where cpu_attention_applies): q [num_tokens,
    heads, head_dim], each sequence's new tokens in order (query_start_loc [num_seqs + 1] int64 says where
    each starts; None: one token a sequence); block_tables [num_seqs, width], seq_lens [num_seqs] int64 ->
    [num_tokens, heads, head_dim]. The kernel walks each block table and reads K and V in place, from the
    first block of the sliding window (`window` keys, the query's own included) where the layer has one."""
    return cpu_kernels.paged_attention(q, cache.key, cache.value, block_tables, seq_lens, scale, window,
                                       cache.key_scale, cache.value_scale, query_start_loc=query_start_loc,
                                       soft_cap=soft_cap)


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The step's K/V ([num_tokens, kv_heads, head_dim], rows may be strided) into their slots: both in one
    kernel call where the kernels take them (an 8-bit pool's rounding with the same values as
    kv_cache.write_kv's formula)."""
    if kernel_takes(key) and (cache.quantized or cache.key.dtype == key.dtype):
        cpu_kernels.write_kv(key, value, cache.key, cache.value, slot_mapping, cache.key_scale, cache.value_scale)
    else:
        kv_cache.write_kv(cache, key, value, slot_mapping)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64, the first index of each row's largest value (a NaN counts as the
    largest), as torch.argmax: in our kernel on the CPU, on the device elsewhere."""
    if kernel_takes(logits) and logits.dim() == 2 and logits.is_contiguous() and logits.shape[1] > 0:
        return cpu_kernels.row_argmax(logits)
    return logits.argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place on [batch, vocab] float32 logits: -inf on logits[rows[i], t] wherever bit t % 32 of word
    t // 32 of bitmask[i] ([num_masked, words] int32, a grammar library's token bitmask) is 0."""
    if logits.device.type == "cpu" and logits.is_contiguous() and cpu_kernels.load() is not None:
        cpu_kernels.apply_token_bitmask(logits, bitmask.contiguous(), rows)
        return
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    allowed = allowed.to(logits.device)
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
