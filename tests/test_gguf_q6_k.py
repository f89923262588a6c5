"""A GGUF's Q6_K tensors computed from their own codes and scales (issue 45 piece 4-5): the file's bytes into
Int6SuperblockCodes without a float (loader/gguf/blocks.py), Int6SuperblockWeight holding them in the file's
size, its W4A16 kernel (csrc/quantized_matmul_a16.cpp) against float64 on the file's values and the same bits
for a token in any batch, and a Q4_K_M-like mix with a tied Q6_K embedding loaded in w4a16 mode with each
tensor in its own format, the head and the embedding's lookups in the Q6_K codes."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_q4_k import (ALL_Q4_K, COLS, ROWS, _gguf_names, assert_int4_mode_holds,
                            assert_the_same_bits_in_any_batch, assert_w4a16_logits_match, assert_within_the_bound,
                            dequantized_in_a_load, exact_values, load_in_formats, random_rows,
                            write_tiny_llama)

from tinyserve.layers import ops
from tinyserve.layers.quant import Int4SuperblockWeight, Int4Weight, Int6SuperblockWeight, Int8Weight
from tinyserve.loader.gguf.blocks import int6_superblock_codes
from tinyserve.loader.gguf.checkpoint import open_gguf

needs_int_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="our C++ kernels are not built")


def _matmul(x: torch.Tensor, weight: Int6SuperblockWeight) -> torch.Tensor:
    from tinyserve.layers.kernels.cpu_kernels import w6a16_superblock_matmul

    return w6a16_superblock_matmul(x, weight.codes, weight.high_bits, weight.d, weight.sub_scales,
                                   weight.out_features)


def test_the_codes_stand_for_the_file_s_values_exactly():
    """ggml's float32 values bit for bit, and float64's exact values: d * sc * (q - 32) never rounds in float32."""
    blocks = random_rows(Q.Q6_K, 0)
    values = int6_superblock_codes(blocks).dequantized()
    assert torch.equal(values, torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q6_K)))
    assert torch.equal(values.double(), exact_values(Q.Q6_K, blocks))


def test_the_embedding_rows_are_the_file_s_values():
    """rows() (an embedding lookup, read out of the kernel's interleaved layout) gives each row's exact values."""
    blocks = random_rows(Q.Q6_K, 1)
    weight = Int6SuperblockWeight.from_codes(int6_superblock_codes(blocks))
    ids = torch.tensor([0, 20, 5, 16, 15, 5])
    assert torch.equal(weight.rows(ids).double(), exact_values(Q.Q6_K, blocks)[ids])


@needs_int_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 7, 13])
def test_the_kernel_computes_with_the_file_s_values(tokens, dtype):
    """Against float64 on the file's exact values. Each weight is widened exactly (csrc/a16_formats.h says why)
    and each of the COLS products is added into a float32 sum with one rounding (FMA), so the error is at most
    COLS * 2^-24 * sum_k |x_k w_k| (a recursive sum's bound); a bfloat16 output adds its own rounding, 2^-8 of
    the value."""
    blocks = random_rows(Q.Q6_K, 2)
    weight = Int6SuperblockWeight.from_codes(int6_superblock_codes(blocks))
    assert_within_the_bound(lambda x: _matmul(x, weight), exact_values(Q.Q6_K, blocks), tokens, dtype, COLS)


@needs_int_kernels
def test_a_token_s_output_is_the_same_bits_in_any_batch():
    """Each (token, row) sum runs over the inputs in one order whatever the step's size or tiling."""
    weight = Int6SuperblockWeight.from_codes(int6_superblock_codes(random_rows(Q.Q6_K, 3)))
    assert_the_same_bits_in_any_batch(lambda x: _matmul(x, weight), COLS, seed=3)


def test_the_format_holds_the_file_s_bytes():
    """210 bytes per 256 weights of a row, as the file's 210 (int8's: 272). ROWS pads to 32 rows (the kernel's
    blocks of 16), so per row."""
    blocks = random_rows(Q.Q6_K, 4)
    weight = Int6SuperblockWeight.from_codes(int6_superblock_codes(blocks))
    assert weight.nbytes / (weight.codes.shape[0] * 16) == blocks.shape[1]


# a Q4_K_M-like mix with a tied head: the embedding, a V and a down projection at Q6_K, the rest Q4_K
MIX = ALL_Q4_K | {"blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.Q6_K}
# our module -> its format in w4a16 mode: Q6_K's and Q4_K's own; a merged linear of both, a run in each
LINEARS = [f"model.layers.{layer}.{name}" for layer in (0, 1)
           for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
W4A16_FORMATS = dict.fromkeys(LINEARS, Int4SuperblockWeight) | {
    "model.layers.0.self_attn.qkv_proj": (Int4SuperblockWeight, Int6SuperblockWeight),
    "model.layers.1.mlp.down_proj": Int6SuperblockWeight,
    "lm_head": Int6SuperblockWeight}
# the tensor types a format takes code for code; a shard of any other is quantized by its rule
TAKEN_AS_CODES = {Int4Weight: set(), Int8Weight: set(), Int4SuperblockWeight: {Q.Q4_K},
                  Int6SuperblockWeight: {Q.Q6_K}}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("q6k") / "mixed.gguf", MIX, tied=True)


@needs_int_kernels
def test_w4a16_holds_each_tensor_in_its_own_format(mixed_path):
    model, linears, stored = load_in_formats(mixed_path, W4A16_FORMATS)
    assert linears["model.layers.1.mlp.down_proj"].weight_format.nbytes == stored["blk.1.ffn_down.weight"]
    # the tied head is the embedding's Q6_K matrix, held once, and the lookups read the file's values
    embedding = model.model.embed_tokens
    assert embedding.weight_format is model.lm_head.weight_format and embedding.weight.is_meta
    assert model.lm_head.weight_format.nbytes == stored["token_embd.weight"]
    [blocks] = [t.data for t in open_gguf(mixed_path).tensors if t.name == "token_embd.weight"]
    ids = torch.tensor([0, 17, 255, 3])
    assert torch.equal(embedding(ids).double(), exact_values(Q.Q6_K, blocks)[ids])


@needs_int_kernels
def test_the_q6_k_matrices_load_without_a_float(mixed_path, monkeypatch):
    """Their tensors' bytes go to codes as they are: none of them is dequantized on the way."""
    dequantized = dequantized_in_a_load(mixed_path, monkeypatch)
    q6_k = {"token_embd.weight", *_gguf_names("model.layers.1.mlp.down_proj")}
    assert not q6_k & dequantized
    # nor the shards of the merged linear of both (Q4_K q and k, a Q6_K v: a run in each)
    assert not set(_gguf_names("model.layers.0.self_attn.qkv_proj")) & dequantized


@needs_int_kernels
def test_int4_mode_keeps_requantizing_q6_k(mixed_path):
    """int4 (int8 activations) has no wide-code kernel: a Q6_K linear and the head are int8, from rows."""
    assert_int4_mode_holds(mixed_path, W4A16_FORMATS, {Int6SuperblockWeight: Int8Weight,
                                                       Int4SuperblockWeight: Int4Weight,
                                                       (Int4SuperblockWeight, Int6SuperblockWeight): Int8Weight})


@needs_int_kernels
def test_the_mixed_model_computes_each_tensor_s_values(mixed_path):
    """The logits of the w4a16 load against float32 on the file's dequantized values, a linear's shard set to
    its format's values where the format does not take its type's codes (tests/test_gguf_q4_k.py): the Q6_K
    matrices (the head and the embedding too) computed from their own codes give the file's values, so only the
    order of the sums differs."""
    assert_w4a16_logits_match(mixed_path, W4A16_FORMATS, TAKEN_AS_CODES)
