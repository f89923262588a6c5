"""A GGUF's Q4_K tensors computed from their own codes and super-block scales (issue 45 piece 4): the file's
bytes into SuperblockCodes without a float (loader/gguf/blocks.py), Int4SuperblockWeight holding them at ~the
file's size, its W4A16 kernel (csrc/quantized_matmul_a16.cpp) against float64 on the file's values and the
same bits for a token in any batch, and a Q4_K_M-like mix (Q4_K, Q6_K, Q4_0) loaded in w4a16 mode with each
tensor in its own format."""

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import write_random_llama
from test_gguf_dequant import REFERENCES, random_blocks
from test_gguf_quant_mix import _build, _formats, a16_inputs, assert_logits_match_the_formats_values

from tinyserve.engine.memory.sizing import weight_bytes_by_format
from tinyserve.layers import ops
from tinyserve.layers.linear import Linear
from tinyserve.layers.quant import (Int4SuperblockWeight, Int4Weight, Int5SuperblockWeight, Int5Weight,
                                   Int6SuperblockWeight, Int8Weight, int4_group_codes)
from tinyserve.loader.gguf.blocks import (_int5_superblock_codes_in_torch, _int6_superblock_codes_in_torch,
                                          _superblock_codes_in_torch, group_codes, int5_superblock_codes,
                                          int6_superblock_codes, superblock_codes)
from tinyserve.loader.gguf.checkpoint import open_gguf

ROWS, COLS = 21, 512  # odd rows (two blocks of 16, the second padded), two super-blocks a row
BLOCK_BYTES = 144  # a Q4_K super-block: 256 weights
needs_int_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="our C++ kernels are not built")


def _blocks(seed: int) -> np.ndarray:
    """[ROWS, bytes per row]: random codes, 6-bit scales and minimums, finite float16 d and dmin of either sign."""
    return random_rows(Q.Q4_K, seed)


def random_rows(qtype: Q, seed: int, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """[rows, bytes per row] of random blocks of qtype (test_gguf_dequant.random_blocks: random codes, finite
    float16 scales of either sign)."""
    return random_blocks(qtype, rows * cols, np.random.default_rng(seed)).reshape(rows, -1)


def exact_values(qtype: Q, blocks: np.ndarray) -> torch.Tensor:
    """float64 [rows, in]: the file's values, by the test's own reading of ggml's format (test_gguf_dequant)."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    return torch.from_numpy(REFERENCES[qtype](blocks.reshape(-1, block_bytes))).reshape(blocks.shape[0], -1)


def _matmul(x: torch.Tensor, weight: Int4SuperblockWeight) -> torch.Tensor:
    from tinyserve.layers.kernels.cpu_kernels import w4a16_superblock_matmul

    return w4a16_superblock_matmul(x, weight.codes, weight.d, weight.dmin, weight.sub_scales, weight.sub_mins,
                                   weight.out_features)


def test_superblock_codes_stand_for_the_file_s_values_exactly():
    """ggml's float32 values bit for bit (d * sc and dmin * m are exact, then one rounding), and float64's exact
    value rounded once to float32."""
    blocks = _blocks(0)
    values = superblock_codes(blocks).dequantized()
    assert torch.equal(values, torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q4_K)))
    exact = torch.from_numpy(REFERENCES[Q.Q4_K](blocks.reshape(-1, BLOCK_BYTES))).reshape(ROWS, COLS)
    assert ((values.double() - exact).abs() <= 2.0 ** -24 * exact.abs()).all()


@needs_int_kernels
@pytest.mark.parametrize("qtype, fast, torch_ops", [
    (Q.Q4_K, superblock_codes, _superblock_codes_in_torch),
    (Q.Q5_K, int5_superblock_codes, _int5_superblock_codes_in_torch),
    (Q.Q6_K, int6_superblock_codes, _int6_superblock_codes_in_torch)], ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("rows", [1, 3, ROWS])
def test_the_c_plus_plus_pass_gives_the_torch_ops_bytes(qtype, fast, torch_ops, rows):
    """The K-quants' one C++ pass (csrc/gguf_nibbles.cpp, where the kernels are built) against their torch ops:
    every field the same, bit for bit (float16 fields compared as their bits)."""
    blocks = random_rows(qtype, seed=7)[:rows]
    got, want = fast(blocks), torch_ops(blocks)
    assert type(got) is type(want)
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        assert a.dtype == b.dtype and a.shape == b.shape, field.name
        bits = torch.int16 if a.dtype == torch.float16 else a.dtype
        assert torch.equal(a.view(bits), b.view(bits)), field.name


@needs_int_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 7, 13])
def test_the_kernel_computes_with_the_file_s_values(tokens, dtype):
    """Against float64 on the file's exact values. Each weight is rounded once to float32 (relative 2^-24) and
    each of the COLS products is added into a float32 sum with one rounding (FMA), so the error is at most
    (COLS + 2) * 2^-24 * sum_k |x_k w_k| (the classic bound for a recursive sum, with a term to spare); a
    bfloat16 output adds its own rounding, 2^-8 of the value."""
    blocks = _blocks(1)
    weight = Int4SuperblockWeight.from_codes(superblock_codes(blocks))
    values = torch.from_numpy(REFERENCES[Q.Q4_K](blocks.reshape(-1, BLOCK_BYTES))).reshape(ROWS, COLS)
    assert_within_the_bound(lambda x: _matmul(x, weight), values, tokens, dtype, COLS + 2)


def assert_within_the_bound(matmul, values: torch.Tensor, tokens: int, dtype: torch.dtype, terms: int) -> None:
    """matmul(x) for random x [tokens, in] of dtype against float64 on values [out, in] and x as the kernel
    reads it (a16_inputs): within terms * 2^-24 * sum_k |x_k| m_k, m_k = |w_k| (plus, where the kernel folds,
    20 times the largest |w| of input k's group: at least the 128 * scale each code carries in the fold's sums,
    random codes spanning their range), plus
    2^-8 of the value for a bfloat16 output."""
    x = torch.randn(tokens, values.shape[1], generator=torch.Generator().manual_seed(tokens)).to(dtype)
    got = matmul(x)
    assert got.dtype == dtype and tuple(got.shape) == (tokens, values.shape[0])
    read = a16_inputs(x).double()
    exact = read @ values.T
    magnitude = values.abs()
    if ops.cpu_kernels.w4a16_rounds_to_bfloat16():
        group_max = magnitude.reshape(values.shape[0], -1, 32).amax(-1, keepdim=True)
        magnitude = magnitude + 20 * group_max.expand(-1, -1, 32).reshape(values.shape)
    bound = terms * 2.0 ** -24 * (read.abs() @ magnitude.T)
    if dtype == torch.bfloat16:
        bound += 2.0 ** -8 * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()


@needs_int_kernels
def test_a_token_s_output_is_the_same_bits_in_any_batch():
    """Each (token, row) sum runs over the inputs in one order whatever the step's size or tiling."""
    weight = Int4SuperblockWeight.from_codes(superblock_codes(_blocks(2)))
    assert_the_same_bits_in_any_batch(lambda x: _matmul(x, weight), COLS, seed=2)


def _a16_weight(qtype: Q, blocks: np.ndarray):
    """blocks of qtype in the format w4a16 mode holds them in (each computed by csrc/quantized_matmul_a16.cpp)."""
    match qtype:
        case Q.Q4_1:
            return dataclasses.replace(Int4Weight.from_codes(group_codes(qtype, blocks)), int8_inputs=False)
        case Q.Q8_0:
            return dataclasses.replace(Int8Weight.from_codes(group_codes(qtype, blocks)), int8_inputs=False)
        case Q.Q5_1:
            return Int5Weight.from_codes(group_codes(qtype, blocks))
        case Q.Q4_K:
            return Int4SuperblockWeight.from_codes(superblock_codes(blocks))
        case Q.Q5_K:
            return Int5SuperblockWeight.from_codes(int5_superblock_codes(blocks))
        case Q.Q6_K:
            return Int6SuperblockWeight.from_codes(int6_superblock_codes(blocks))


@needs_int_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_every_a16_format_gives_a_token_the_same_bits_in_steps_of_one_to_four(qtype):
    """Steps of 1-4 tokens take the kernel's fused path, several blocks of 16 rows side by side (4 for one token
    on AVX2); 69 rows make a full run of blocks and a padded tail. A token's output must be the same bits as in
    a 64-token step (the staged path)."""
    weight = _a16_weight(qtype, random_rows(qtype, 5, rows=69))
    assert_the_same_bits_in_any_batch(lambda x: ops.linear(x, weight), COLS, seed=5)


def assert_the_same_bits_in_any_batch(matmul, cols: int, seed: int) -> None:
    """matmul(x) on 64 random tokens of `cols` inputs: each token's output the same bits in any prefix of them
    and alone."""
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(seed))
    full = matmul(x)
    for n in range(1, 65):
        assert torch.equal(matmul(x[:n]), full[:n]), n
    for t in (1, 30, 63):
        assert torch.equal(matmul(x[t:t + 1]), full[t:t + 1]), t


def test_the_format_holds_the_file_s_bytes_and_2_8_percent_more():
    """148 bytes per 256 weights of a row for the file's 144: the 12 bytes of packed 6-bit values kept as 16,
    a byte each. ROWS pads to 32 rows (the kernel's blocks of 16), so per row."""
    blocks = _blocks(3)
    weight = Int4SuperblockWeight.from_codes(superblock_codes(blocks))
    per_row = weight.nbytes / (weight.codes.shape[0] * 16)
    assert per_row == blocks.shape[1] * 148 / 144 <= blocks.shape[1] * 1.03


def q4_k_bytes(w: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer (gguf-py has none): per sub-block of 32, scale (max - min) / 15 and minimum -min
    (min clipped to <= 0); per super-block, d and dmin the largest of those / 63, each sub-block's a 6-bit
    multiple of them; codes rounded to the nearest step. Packed as ggml's blocks (loader/gguf/blocks.py)."""
    rows, cols = w.shape
    tiny = np.float32(1e-30)
    sub = w.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, minimum = (sub.max(-1) - low) / 15, -low
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (minimum.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), tiny)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(minimum / np.maximum(dmin.astype(np.float32), tiny)[..., None]), 0, 63).astype(np.uint8)
    step, offset = d.astype(np.float32)[..., None] * sc, dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.round((sub + offset[..., None]) / np.maximum(step, tiny)[..., None]), 0, 15).astype(np.uint8)
    packed = [sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
              (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)]
    nibbles = q.reshape(rows, cols // 256, 4, 2, 32)
    qs = (nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)).reshape(rows, cols // 256, 128)
    block = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), *packed, qs], axis=-1)
    return block.reshape(rows, -1)


_SMALL_SCALES = {Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # the float16 fields _quantize sets in random K-quant blocks


def _quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """Q4_K by q4_k_bytes; Q5_K and Q6_K as random codes with small d (and dmin) (weights within ~0.05); the rest
    gguf-py's."""
    if qtype == Q.Q4_K:
        return q4_k_bytes(w)
    if qtype in _SMALL_SCALES:
        rows, cols = w.shape
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        data = np.random.default_rng(rows * cols).integers(0, 256, size=(rows, cols // 256, block_bytes),
                                                           dtype=np.uint8)
        for at in _SMALL_SCALES[qtype]:
            data[..., at:at + 2] = np.frombuffer(np.float16(1e-5).tobytes(), dtype=np.uint8)
        return data.reshape(rows, -1)
    return gguf.quants.quantize(w, qtype)


def test_the_test_s_quantizer_writes_q4_k_near_its_input():
    w = np.random.default_rng(0).normal(0, 0.02, size=(4, 512)).astype(np.float32)
    values = gguf.quants.dequantize(q4_k_bytes(w), Q.Q4_K).reshape(w.shape)
    assert np.abs(values - w).max() <= 0.1 * np.abs(w).max()


# a Q4_K_M-like mix: Q4_K but for a V and a down projection and the head at Q6_K and two tensors at Q4_0
_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ALL_Q4_K = {f"blk.{layer}.{part}.weight": Q.Q4_K for layer in (0, 1) for part in _PARTS}  # write_tiny_llama's
MIX = ALL_Q4_K | {
    "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K, "output.weight": Q.Q6_K,
    "blk.1.attn_output.weight": Q.Q4_0, "blk.1.ffn_up.weight": Q.Q4_0, "token_embd.weight": Q.Q4_K}
# our module -> its format in w4a16 mode: Q4_K's (Q6_K's) own where every shard is Q4_K (Q6_K: the head too,
# tests/test_gguf_q6_k.py); a merged linear of several types, each run of shards in its own type's format (a
# tuple: StackedWeight's runs); else int4, where a Q4_0 shard keeps its own codes
# and a Q4_K shard is quantized by int4's rule
W4A16_FORMATS = {
    "model.layers.0.self_attn.qkv_proj": (Int4SuperblockWeight, Int6SuperblockWeight),
    "model.layers.0.self_attn.o_proj": Int4SuperblockWeight,
    "model.layers.0.mlp.gate_up_proj": Int4SuperblockWeight, "model.layers.0.mlp.down_proj": Int6SuperblockWeight,
    "model.layers.1.self_attn.qkv_proj": Int4SuperblockWeight, "model.layers.1.self_attn.o_proj": Int4Weight,
    "model.layers.1.mlp.gate_up_proj": (Int4SuperblockWeight, Int4Weight),
    "model.layers.1.mlp.down_proj": Int4SuperblockWeight,
    "lm_head": Int6SuperblockWeight,
}
# the tensor types a format takes code for code; a shard of any other is quantized by its rule
TAKEN_AS_CODES = {Int4Weight: {Q.Q4_0, Q.Q4_1}, Int8Weight: {Q.Q8_0}, Int4SuperblockWeight: {Q.Q4_K},
                  Int6SuperblockWeight: {Q.Q6_K}}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("q4k") / "mixed.gguf", MIX)


def write_tiny_llama(path, types: dict, tied: bool = False):
    """write_random_llama with _quantize's blocks (GGUF name -> type in `types`)."""
    return write_random_llama(path, types, _quantize, tied)


@needs_int_kernels
def test_w4a16_holds_each_tensor_in_its_own_format(mixed_path):
    _, linears, stored = load_in_formats(mixed_path, W4A16_FORMATS)
    # the Q4_K linears hold their file's bytes and 148/144 of them (every row count here a multiple of 16)
    for name, fmt in W4A16_FORMATS.items():
        if fmt is Int4SuperblockWeight:
            file_bytes = sum(stored[gguf_name] for gguf_name in _gguf_names(name))
            assert linears[name].weight_format.nbytes == file_bytes * 148 // 144


@needs_int_kernels
def test_a_merged_linear_of_two_types_holds_each_in_its_file_s_size(mixed_path):
    """Layer 0's QKV (Q4_K q and k, a Q6_K v; in a Q4_K_M file most layers' are so) in a run of Q4_K's format
    and a run of Q6_K's, not int8 for all three (272 bytes per 256 weights for the file's 144 and 210), and the
    start-up log's weight figure (weight_bytes_by_format) counts both runs."""
    model, linears, stored = load_in_formats(mixed_path, W4A16_FORMATS)
    q, k, v = (stored[name] for name in _gguf_names("model.layers.0.self_attn.qkv_proj"))
    q_and_k, v_run = linears["model.layers.0.self_attn.qkv_proj"].weight_format.parts
    assert (q_and_k.nbytes, v_run.nbytes) == ((q + k) * 148 // 144, v)
    held = {}
    for module in model.modules():
        weight_format = getattr(module, "weight_format", None)
        for part in getattr(weight_format, "parts", (weight_format,)):
            if part is not None and hasattr(part, "nbytes"):
                held[id(part)] = (type(part).__name__.removesuffix("Weight").lower(), part.nbytes)
    by_format = weight_bytes_by_format(model)
    for name in ("int4superblock", "int6superblock"):
        assert by_format[name] == sum(n for fmt, n in held.values() if fmt == name)


@needs_int_kernels
def test_the_q4_k_linears_load_without_a_float(mixed_path, monkeypatch):
    """Their tensors' bytes go to codes as they are: none of them is dequantized on the way."""
    dequantized = dequantized_in_a_load(mixed_path, monkeypatch)
    superblock_tensors = {gguf_name for name, fmt in W4A16_FORMATS.items() if fmt is Int4SuperblockWeight
                          for gguf_name in _gguf_names(name)}
    assert superblock_tensors and not superblock_tensors & dequantized
    # and a merged linear of two types (Q4_K q and k, a Q6_K v) takes each in its own codes
    assert not set(_gguf_names("model.layers.0.self_attn.qkv_proj")) & dequantized


def load_in_formats(path, formats: dict) -> tuple:
    """The file loaded in w4a16 mode, its modules in `formats` (by name) and no float copy of a linear left:
    (the model, its Linears by name, the file's bytes by GGUF tensor name)."""
    model = _build(path, dtype=torch.float32, quantization="w4a16")
    assert _formats(model) == formats
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert all(m.weight.is_meta for m in linears.values())
    return model, linears, {t.name: t.data.nbytes for t in open_gguf(path).tensors}


def dequantized_in_a_load(path, monkeypatch, quantization: str = "w4a16", dtype=torch.float32) -> set[str]:
    """The GGUF tensors a load of the file in `quantization` reads as floats (the others: as codes)."""
    from tinyserve.loader.gguf import checkpoint

    dequantized, dequantize = set(), checkpoint._dequantize

    def recorded(tensor, *args, **kwargs):
        dequantized.add(tensor.name)
        return dequantize(tensor, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "_dequantize", recorded)
    _build(path, dtype=dtype, quantization=quantization)
    return dequantized


def _gguf_names(module: str) -> list[str]:
    """A block linear's GGUF tensors (a merged one's shards)."""
    _, _, layer, rest = module.split(".", 3)
    parts = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
             "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}[rest]
    return [f"blk.{layer}.{part}.weight" for part in parts]


@needs_int_kernels
def test_int4_mode_takes_q4_k_codes_as_they_are(mixed_path, monkeypatch):
    """int4 (int8 activations) has no super-block kernel: a Q4_K linear goes to Int4Weight in its own codes, each
    group's scale d * sc and minimum -dmin * m rounded to float16 (a Q6_K one to Int8Weight, requantized), and its
    tensors are never dequantized on the way."""
    assert_int4_mode_holds(mixed_path, W4A16_FORMATS, {
        Int4SuperblockWeight: Int4Weight, Int6SuperblockWeight: Int8Weight,
        (Int4SuperblockWeight, Int6SuperblockWeight): Int8Weight, (Int4SuperblockWeight, Int4Weight): Int4Weight})
    dequantized = dequantized_in_a_load(mixed_path, monkeypatch, "int4", torch.bfloat16)
    q4_k_linears = [name for name, fmt in W4A16_FORMATS.items()
                    if fmt in (Int4SuperblockWeight, (Int4SuperblockWeight, Int4Weight))]
    assert q4_k_linears and not {g for name in q4_k_linears for g in _gguf_names(name)} & dequantized


def test_q4_k_codes_under_q4_1_s_rule_stand_for_the_file_s_values_within_float16_rounding():
    """The codes are the file's, packed as they are; each group's scale and minimum off by at most 2^-11 of
    itself (one float16 rounding of the exact float32 products), so each value by at most
    15 * |scale| * 2^-11 + |minimum| * 2^-11."""
    codes = superblock_codes(_blocks(3))
    nibbles = codes.as_nibble_codes()
    assert torch.equal(nibbles.codes, codes.codes) and nibbles.bits == 4
    assert torch.equal(nibbles.unpacked().codes, codes.code_values())
    exact = exact_values(Q.Q4_K, _blocks(3)).float()
    scale, minimum = nibbles.scales.float(), nibbles.minimums.float()
    bound = (15 * scale.abs() + minimum.abs()) * 2.0**-11
    error = (nibbles.dequantized() - exact).reshape(ROWS, -1, 32).abs().amax(-1)
    assert (error <= bound * 1.0001 + 1e-30).all() and error.amax() > 0  # rounded, not requantized
    requantized = int4_group_codes(exact)  # what int4 mode held before: the values' own min and max
    assert not torch.equal(requantized.codes, nibbles.unpacked().codes)
    huge = dataclasses.replace(codes, d=torch.full_like(codes.d, 60000.0))  # d * sc overflows float16
    assert huge.as_nibble_codes() is None


def assert_int4_mode_holds(path, w4a16_formats: dict, int4_formats: dict) -> None:
    """The file loaded in int4 mode (bfloat16) holds its modules in w4a16's formats (by name) changed by
    int4_formats (w4a16's format -> int4's; a merged linear of several types by its runs' formats: int4 holds it
    in one, int8 where a shard is stored above 4 bits)."""
    expected = {name: int4_formats.get(fmt, fmt) for name, fmt in w4a16_formats.items()}
    assert _formats(_build(path, dtype=torch.bfloat16, quantization="int4")) == expected


@needs_int_kernels
def test_the_mixed_model_computes_each_tensor_s_values(mixed_path):
    """The logits of the w4a16 load against float32 on the file's dequantized values, each shard of a linear
    then set to its format's values where the format does not take its type's codes as they are (its rule, as
    tests/test_quant.py checks a uniform mode): Q4_K linears computed from their own codes give the file's
    values, so only the order of the sums differs."""
    assert_w4a16_logits_match(mixed_path, W4A16_FORMATS, TAKEN_AS_CODES)


def assert_w4a16_logits_match(path, formats: dict, taken: dict) -> None:
    """The file's w4a16 load (float32) against the reference on its formats' values (within 1e-5)."""
    model = _build(path, dtype=torch.float32, quantization="w4a16")
    assert_logits_match_the_formats_values(model, path, formats, taken, 1e-5, a16=True)


@needs_int_kernels
def test_an_untied_q4_k_embedding_is_held_in_its_codes_and_looks_up_the_file_s_values(mixed_path):
    """w4a16: the embedding stays at the file's size (a 128K-row float32 table was 2 GiB of the 8B's), and a
    lookup gives the file's values exactly."""
    model = _build(mixed_path, dtype=torch.float32, quantization="w4a16")
    embedding = model.model.embed_tokens
    assert type(embedding.weight_format) is Int4SuperblockWeight
    tensor = next(t for t in open_gguf(mixed_path).tensors if t.name == "token_embd.weight")
    assert embedding.weight_format.nbytes == tensor.data.nbytes * 148 // 144
    ids = torch.tensor([0, 5, 17, 255, 5])
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, Q.Q4_K).reshape(tensor.shape))[ids]
    assert torch.equal(embedding(ids), expected)
