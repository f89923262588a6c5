"""A GGUF's Q5_0 and Q5_1 tensors computed from their own codes (issue 45 piece 5): the file's bytes into 5-bit
GroupCodes without a float (loader/gguf/blocks.py), Int5Weight holding them at ~the file's size, its W4A16
kernel (csrc/quantized_matmul_a16.cpp) against float64 on the file's values and the same bits for a token in any
batch, and a file mixing them with Q4_0 and Q8_0 loaded in w4a16 mode with each tensor in its own format."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_q4_k import (ALL_Q4_K, _gguf_names, assert_int4_mode_holds, assert_the_same_bits_in_any_batch,
                            assert_w4a16_logits_match, assert_within_the_bound, dequantized_in_a_load,
                            exact_values, load_in_formats, random_rows, write_tiny_llama)
from test_gguf_q6_k import LINEARS

from tinyserve.layers import ops
from tinyserve.layers.quant import Int4SuperblockWeight, Int4Weight, Int5Weight, Int8Weight
from tinyserve.loader.gguf.blocks import group_codes

COLS = 256  # 8 groups a row (random_rows: 21 rows, two blocks of 16, the second padded)
TYPES = [Q.Q5_0, Q.Q5_1]
needs_int_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="our C++ kernels are not built")


def _weight(qtype: Q, blocks: np.ndarray) -> Int5Weight:
    return Int5Weight.from_codes(group_codes(qtype, blocks))


def _matmul(x: torch.Tensor, weight: Int5Weight) -> torch.Tensor:
    from tinyserve.layers.kernels.cpu_kernels import w5a16_matmul

    return w5a16_matmul(x, weight.codes, weight.high_bits, weight.scales, weight.minimums, weight.out_features)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_codes_stand_for_the_file_s_values_exactly(qtype):
    """ggml's float32 values bit for bit; Q5_0's are exact ((q - 16) * d), Q5_1's rounded once (q * d + m)."""
    blocks = random_rows(qtype, 0, cols=COLS)
    codes = group_codes(qtype, blocks)
    assert (codes.minimums is None) == (qtype == Q.Q5_0)  # Q5_0: w = (q - 16) * d, nothing stored beside d
    values = codes.dequantized()
    assert torch.equal(values, torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    exact = exact_values(qtype, blocks)
    assert ((values.double() - exact).abs() <= 2.0 ** -24 * exact.abs()).all()
    if qtype == Q.Q5_0:
        assert torch.equal(values.double(), exact)


@needs_int_kernels
def test_a_q5_0_scale_over_4094_loads():
    """-16 * d has no float16 for |d| over 4094: refused while the loader stored it as a minimum; the kernel
    computes it in float32, within the bound of the file's values."""
    blocks = random_rows(Q.Q5_0, 1, cols=COLS)
    blocks[0, 0:2] = np.frombuffer(np.float16(5000).tobytes(), dtype=np.uint8)
    codes = group_codes(Q.Q5_0, blocks)
    assert codes.minimums is None and torch.equal(codes.dequantized().double(), exact_values(Q.Q5_0, blocks))
    weight = Int5Weight.from_codes(codes)
    assert_within_the_bound(lambda x: _matmul(x, weight), exact_values(Q.Q5_0, blocks), 3, torch.float32, COLS + 2)


@needs_int_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q5_0_gives_the_bits_it_gave_with_minus_16_d_stored(dtype):
    """The kernel's offset -16 * d in float32 is exact, as the float16 minimum the loader stored before: the
    same bits for every token count across the kernel's passes."""
    codes = group_codes(Q.Q5_0, random_rows(Q.Q5_0, 5, cols=COLS))
    symmetric, explicit = Int5Weight.from_codes(codes), Int5Weight.from_codes(codes.with_minimums())
    assert symmetric.minimums is None and explicit.minimums is not None
    x = torch.randn(13, COLS, generator=torch.Generator().manual_seed(5)).to(dtype)
    for tokens in (1, 3, 4, 5, 13):
        assert torch.equal(_matmul(x[:tokens], symmetric), _matmul(x[:tokens], explicit)), tokens


@needs_int_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 7, 13])
def test_the_kernel_computes_with_the_file_s_values(qtype, tokens, dtype):
    """Against float64 on the file's exact values (tests/test_gguf_q4_k.py's bound)."""
    blocks = random_rows(qtype, 2, cols=COLS)
    weight = _weight(qtype, blocks)
    assert_within_the_bound(lambda x: _matmul(x, weight), exact_values(qtype, blocks), tokens, dtype, COLS + 2)


@needs_int_kernels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_token_s_output_is_the_same_bits_in_any_batch(qtype):
    """Each (token, row) sum runs over the inputs in one order whatever the step's size or tiling."""
    weight = _weight(qtype, random_rows(qtype, 3, cols=COLS))
    assert_the_same_bits_in_any_batch(lambda x: _matmul(x, weight), COLS, seed=3)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_format_holds_the_file_s_bytes_per_32_weights(qtype):
    """Q5_1's 24 bytes per 32 weights of a row, Q5_0's 22 (no minimum: -16 d comes from d). ROWS pads to 32
    rows (the kernel's blocks of 16), so per row."""
    blocks = random_rows(qtype, 4, cols=COLS)
    weight = _weight(qtype, blocks)
    assert weight.nbytes / (weight.codes.shape[0] * 16) == COLS // 32 * (22 if qtype == Q.Q5_0 else 24)


# Q4_K beside Q5_0 and Q5_1 linears (whole, or a shard beside a Q4_K one), a Q5_0 head
MIX = ALL_Q4_K | {"blk.0.attn_output.weight": Q.Q5_0, "blk.1.ffn_down.weight": Q.Q5_1,
                  "blk.0.ffn_gate.weight": Q.Q5_1, "blk.0.ffn_up.weight": Q.Q5_1, "blk.1.attn_v.weight": Q.Q5_0,
                  "output.weight": Q.Q5_0}
W4A16_FORMATS = dict.fromkeys(LINEARS, Int4SuperblockWeight) | {
    "model.layers.0.self_attn.o_proj": Int5Weight, "model.layers.1.mlp.down_proj": Int5Weight,
    "model.layers.0.mlp.gate_up_proj": Int5Weight,
    "model.layers.1.self_attn.qkv_proj": (Int4SuperblockWeight, Int5Weight),
    "lm_head": Int8Weight}
TAKEN_AS_CODES = {Int4Weight: set(), Int8Weight: set(), Int4SuperblockWeight: {Q.Q4_K}, Int5Weight: {Q.Q5_0, Q.Q5_1}}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("q5") / "mixed.gguf", MIX)


@needs_int_kernels
def test_w4a16_holds_each_tensor_in_its_own_format(mixed_path):
    """Q5_0 and Q5_1 linears in Int5Weight (a merged one where every shard is either), each in its file's
    bytes; a Q5_0 head stays int8."""
    _, linears, stored = load_in_formats(mixed_path, W4A16_FORMATS)
    assert linears["model.layers.1.mlp.down_proj"].weight_format.nbytes == stored["blk.1.ffn_down.weight"]
    q5_0 = linears["model.layers.0.self_attn.o_proj"].weight_format
    assert q5_0.minimums is None and q5_0.nbytes == stored["blk.0.attn_output.weight"]


@needs_int_kernels
def test_the_q5_linears_load_without_a_float(mixed_path, monkeypatch):
    """Their tensors' bytes go to codes as they are: none of them is dequantized on the way."""
    dequantized = dequantized_in_a_load(mixed_path, monkeypatch)
    assert not {"blk.0.attn_output.weight", "blk.1.ffn_down.weight", "blk.0.ffn_gate.weight"} & dequantized
    # nor those of the merged linear of Q4_K q and k beside a Q5_0 v (a run in each)
    assert not set(_gguf_names("model.layers.1.self_attn.qkv_proj")) & dequantized


@needs_int_kernels
def test_the_mixed_model_computes_each_tensor_s_values(mixed_path):
    """The logits of the w4a16 load against float32 on the file's dequantized values (tests/test_gguf_q4_k.py)."""
    assert_w4a16_logits_match(mixed_path, W4A16_FORMATS, TAKEN_AS_CODES)


@needs_int_kernels
def test_int4_mode_keeps_requantizing_q5_0_and_q5_1(mixed_path):
    """int4 (int8 activations) has no wide-code kernel: a Q5_0 / Q5_1 linear is int8, from rows."""
    assert_int4_mode_holds(mixed_path, W4A16_FORMATS, {Int4SuperblockWeight: Int4Weight, Int5Weight: Int8Weight,
                                                       (Int4SuperblockWeight, Int5Weight): Int8Weight})
