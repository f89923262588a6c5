"""A GGUF's Q5_K tensors computed from their own codes and scales (issue 45 piece 5): the file's bytes into
Int5SuperblockCodes without a float (loader/gguf/blocks.py), Int5SuperblockWeight holding them at ~the file's
size, its W4A16 kernel (csrc/quantized_matmul_a16.cpp) against float64 on the file's values and the same bits
for a token in any batch, and a mix of Q4_K, Q5_K and Q6_K loaded in w4a16 mode with each tensor in its own
format."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_q4_k import (ALL_Q4_K, COLS, ROWS, assert_int4_mode_holds, assert_the_same_bits_in_any_batch,
                            assert_w4a16_logits_match, assert_within_the_bound, dequantized_in_a_load,
                            exact_values, load_in_formats, random_rows, write_tiny_llama)
from test_gguf_q6_k import LINEARS

from tinyserve.layers import ops
from tinyserve.layers.quant import (Int4SuperblockWeight, Int4Weight, Int5SuperblockWeight, Int6SuperblockWeight,
                                    Int8Weight)
from tinyserve.loader.gguf.blocks import int5_superblock_codes

needs_int_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="our C++ kernels are not built")


def _matmul(x: torch.Tensor, weight: Int5SuperblockWeight) -> torch.Tensor:
    from tinyserve.layers.kernels.cpu_kernels import w5a16_superblock_matmul

    return w5a16_superblock_matmul(x, weight.codes, weight.high_bits, weight.d, weight.dmin, weight.sub_scales,
                                   weight.sub_mins, weight.out_features)


def test_the_codes_stand_for_the_file_s_values_exactly():
    """ggml's float32 values bit for bit (d * sc and dmin * m are exact, then one rounding), and float64's exact
    value rounded once to float32."""
    blocks = random_rows(Q.Q5_K, 0)
    values = int5_superblock_codes(blocks).dequantized()
    assert torch.equal(values, torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q5_K)))
    exact = exact_values(Q.Q5_K, blocks)
    assert ((values.double() - exact).abs() <= 2.0 ** -24 * exact.abs()).all()


@needs_int_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 7, 13])
def test_the_kernel_computes_with_the_file_s_values(tokens, dtype):
    """Against float64 on the file's exact values: each weight rounded once to float32, each of the COLS products
    added with one rounding (tests/test_gguf_q4_k.py's bound)."""
    blocks = random_rows(Q.Q5_K, 1)
    weight = Int5SuperblockWeight.from_codes(int5_superblock_codes(blocks))
    assert_within_the_bound(lambda x: _matmul(x, weight), exact_values(Q.Q5_K, blocks), tokens, dtype, COLS + 2)


@needs_int_kernels
def test_a_token_s_output_is_the_same_bits_in_any_batch():
    """Each (token, row) sum runs over the inputs in one order whatever the step's size or tiling."""
    weight = Int5SuperblockWeight.from_codes(int5_superblock_codes(random_rows(Q.Q5_K, 2)))
    assert_the_same_bits_in_any_batch(lambda x: _matmul(x, weight), COLS, seed=2)


def test_the_format_holds_the_file_s_bytes_and_2_3_percent_more():
    """180 bytes per 256 weights of a row for the file's 176: Q4_K's 12 bytes of packed 6-bit values kept as 16.
    ROWS pads to 32 rows (the kernel's blocks of 16), so per row."""
    blocks = random_rows(Q.Q5_K, 3)
    weight = Int5SuperblockWeight.from_codes(int5_superblock_codes(blocks))
    per_row = weight.nbytes / (weight.codes.shape[0] * 16)
    assert per_row == blocks.shape[1] * 180 / 176 <= blocks.shape[1] * 1.025


# Q4_K_M's neighbour Q5_K_M: Q5_K but for a V and a down projection at Q6_K and a Q4_K gate (untied head: Q6_K)
MIX = {name: Q.Q5_K for name in ALL_Q4_K} | {
    "blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K, "blk.1.ffn_gate.weight": Q.Q4_K,
    "token_embd.weight": Q.Q5_K, "output.weight": Q.Q6_K}
# our module -> its format in w4a16 mode: each K-quant's own (a merged linear of two: a run in each)
W4A16_FORMATS = dict.fromkeys(LINEARS, Int5SuperblockWeight) | {
    "model.layers.0.self_attn.qkv_proj": (Int5SuperblockWeight, Int6SuperblockWeight),
    "model.layers.1.mlp.down_proj": Int6SuperblockWeight,
    "model.layers.1.mlp.gate_up_proj": (Int4SuperblockWeight, Int5SuperblockWeight), "lm_head": Int6SuperblockWeight}
TAKEN_AS_CODES = {Int4Weight: set(), Int8Weight: set(), Int4SuperblockWeight: {Q.Q4_K},
                  Int5SuperblockWeight: {Q.Q5_K}, Int6SuperblockWeight: {Q.Q6_K}}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("q5k") / "mixed.gguf", MIX)


@needs_int_kernels
def test_w4a16_holds_each_tensor_in_its_own_format(mixed_path):
    _, linears, stored = load_in_formats(mixed_path, W4A16_FORMATS)
    # the Q5_K linears hold their file's bytes and 180/176 of them (every row count here a multiple of 16)
    assert linears["model.layers.1.self_attn.o_proj"].weight_format.nbytes == \
        stored["blk.1.attn_output.weight"] * 180 // 176


@needs_int_kernels
def test_the_q5_k_linears_load_without_a_float(mixed_path, monkeypatch):
    """Their tensors' bytes go to codes as they are: none of them is dequantized on the way."""
    dequantized = dequantized_in_a_load(mixed_path, monkeypatch)
    assert not {"blk.1.attn_output.weight", "blk.0.ffn_down.weight", "blk.1.attn_q.weight"} & dequantized
    # nor those of the merged linears of two K-quants (a run in each)
    assert not {"blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.1.ffn_gate.weight"} & dequantized


@needs_int_kernels
def test_int4_mode_keeps_requantizing_q5_k(mixed_path):
    """int4 (int8 activations) has no wide-code kernel: a Q5_K or Q6_K linear is int8, from rows."""
    assert_int4_mode_holds(mixed_path, W4A16_FORMATS, {
        Int5SuperblockWeight: Int8Weight, Int6SuperblockWeight: Int8Weight,
        (Int5SuperblockWeight, Int6SuperblockWeight): Int8Weight, (Int4SuperblockWeight, Int5SuperblockWeight): Int8Weight})


@needs_int_kernels
def test_the_mixed_model_computes_each_tensor_s_values(mixed_path):
    """The logits of the w4a16 load against float32 on the file's dequantized values (tests/test_gguf_q4_k.py)."""
    assert_w4a16_logits_match(mixed_path, W4A16_FORMATS, TAKEN_AS_CODES)
