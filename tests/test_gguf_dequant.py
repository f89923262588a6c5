"""GGUF dequantization against values computed here from ggml's block layouts (ggml-common.h, and
ggml-quants.c's dequantize_row_*): random codes and scales, packed by hand into the blocks of every
type the loader reads, written to a GGUF file and read back through loader/gguf/checkpoint.py. The loader
dequantizes with gguf-py, so these references follow the layouts, never that library.

Our int kernels do not read GGUF blocks: they quantize the loaded float32 weights again in their own
layout (layers/quant.py). For the two formats they share with GGUF (Q4_1 for int4, Q8_0 for int8),
the last test checks that this gives back a file's own values."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tinyserve.layers.quant import Int4Weight, Int8Weight
from tinyserve.loader.gguf.checkpoint import gguf_tensors, open_gguf

ROWS, COLS = 3, 512  # not square, two 256-value super-blocks per row: a transposed or flat read shows
TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of each block, as float64 [blocks, 1]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles are values 0..15, the high nibbles values 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int64)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes, a little-endian uint32 whose bit j is bit 4 of value j -> [blocks, 32] in {0, 16}."""
    word = qh.copy().view("<u4").astype(np.int64)  # [blocks, 1]
    return ((word >> np.arange(32)) & 1) * 16


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 6-bit scale and minimum of each of the 8 sub-blocks of 32 ([blocks, 8] each).
    Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); sub-blocks 4-7: a nibble of
    bytes 8-11 below the top 2 bits of bytes 0-3 (scales) or 4-7 (minimums)."""
    s = scales.astype(np.int64)
    low_scale, low_min = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_scale = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    high_min = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return np.concatenate([low_scale, high_scale], axis=1), np.concatenate([low_min, high_min], axis=1)


def _q8_0(b):  # d, 32 int8 codes
    return b[:, 2:34].view(np.int8) * _f16(b, 0)


def _q4_0(b):  # d, 16 bytes of nibbles; code - 8
    return (_nibbles(b[:, 2:18]) - 8) * _f16(b, 0)


def _q4_1(b):  # d, minimum, 16 bytes of nibbles
    return _nibbles(b[:, 4:20]) * _f16(b, 0) + _f16(b, 2)


def _q5_0(b):  # d, 4 bytes of fifth bits, 16 bytes of nibbles; code - 16
    return ((_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])) - 16) * _f16(b, 0)


def _q5_1(b):  # d, minimum, 4 bytes of fifth bits, 16 bytes of nibbles
    return (_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])) * _f16(b, 0) + _f16(b, 2)


def _q4_k(b):
    """d, dmin, 12 bytes of sub-block scales, 128 bytes of nibbles. Values 64c..64c+63 come from bytes
    32c..32c+31: low nibbles in sub-block 2c, then high nibbles in sub-block 2c + 1."""
    scale, minimum = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].astype(np.int64)
    codes = np.concatenate([part for c in range(4) for part in (qs[:, 32 * c:32 * c + 32] & 0xF,
                                                                  qs[:, 32 * c:32 * c + 32] >> 4)], axis=1)
    return _k_values(codes, b, scale, minimum)


def _q5_k(b):
    """Q4_K's layout with 32 bytes of fifth bits after the scales: in sub-block j, value l's fifth bit is
    bit j of byte l."""
    scale, minimum = _k_scales(b[:, 4:16])
    qh, qs = b[:, 16:48].astype(np.int64), b[:, 48:176].astype(np.int64)
    parts = []
    for c in range(4):
        ql = qs[:, 32 * c:32 * c + 32]
        parts += [(ql & 0xF) + 16 * ((qh >> (2 * c)) & 1), (ql >> 4) + 16 * ((qh >> (2 * c + 1)) & 1)]
    return _k_values(np.concatenate(parts, axis=1), b, scale, minimum)


def _k_values(codes, b, scale, minimum):
    """codes [blocks, 256] -> d * scale * code - dmin * minimum, per sub-block of 32."""
    sub = np.repeat(np.arange(8), 32)
    return _f16(b, 0) * scale[:, sub] * codes - _f16(b, 2) * minimum[:, sub]


def _q6_k(b):
    """128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values), d last.
    Each half of 128 values uses 64 low bytes, 32 high bytes and 8 scales: values 32r + l (r = 0..3,
    l = 0..31) take the low (r < 2) or high nibble of low byte l + 32 (r % 2), bits 2r..2r+1 of high
    byte l, and scale 2r + l // 16; code - 32."""
    ql, qh = b[:, 0:128].astype(np.int64), b[:, 128:192].astype(np.int64)
    scales = b[:, 192:208].view(np.int8).astype(np.int64)
    values = []
    for half in range(2):
        low, high = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32]
        for r in range(4):
            nibble = low[:, 32 * (r % 2):32 * (r % 2) + 32]
            nibble = nibble & 0xF if r < 2 else nibble >> 4
            code = (nibble | (((high >> (2 * r)) & 3) << 4)) - 32
            scale = scales[:, 8 * half + 2 * r + np.arange(32) // 16]
            values.append(scale * code)
    return np.concatenate(values, axis=1) * _f16(b, 208)


def _f16_values(b):
    return b.copy().view(np.float16).astype(np.float64)


def _bf16_values(b):  # bfloat16 is float32's top half
    return (b.copy().view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)


REFERENCES = {Q.F16: _f16_values, Q.BF16: _bf16_values, Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1,
              Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
# byte offsets of each block's float16 scales (random bytes there could be inf or NaN)
SCALE_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
                Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype, num_values: int, rng: np.random.Generator) -> np.ndarray:
    """[blocks, block bytes] uint8: random codes, and random finite scales of either sign."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F16, Q.BF16):
        floats = rng.normal(0, 1, num_values).astype(np.float32)
        raw = floats.astype(np.float16) if qtype == Q.F16 else (floats.view(np.uint32) >> 16).astype(np.uint16)
        return raw.view(np.uint8).reshape(-1, block_bytes)
    blocks = rng.integers(0, 256, size=(num_values // block_values, block_bytes), dtype=np.uint8)
    for at in SCALE_FIELDS[qtype]:
        scales = (rng.uniform(0.5, 2, len(blocks)) * rng.choice([-1, 1], len(blocks)) / 64).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks


def write_gguf(path, tensors: dict[str, tuple]) -> None:
    """tensors: GGUF name -> (type, raw blocks), each ROWS x COLS values."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, blocks) in tensors.items():
        writer.add_tensor(name, blocks.reshape(ROWS, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """type -> (reference float64 [ROWS, COLS], our float32 tensor), one tensor per type in one file,
    each named as layer i's up projection (a name the loader neither permutes nor skips)."""
    rng = np.random.default_rng(0)
    blocks = {qtype: random_blocks(qtype, ROWS * COLS, rng) for qtype in TYPES}
    path = tmp_path_factory.mktemp("gguf") / "hand-made.gguf"
    write_gguf(path, {f"blk.{i}.ffn_up.weight": (qtype, blocks[qtype]) for i, qtype in enumerate(TYPES)})
    ours = dict(gguf_tensors(open_gguf(path), None))
    return {qtype: (REFERENCES[qtype](blocks[qtype]).reshape(ROWS, COLS),
                    ours[f"model.layers.{i}.mlp.up_proj.weight"]()) for i, qtype in enumerate(TYPES)}


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantized_values_follow_the_block_layout(loaded, qtype):
    expected, got = loaded[qtype]
    assert got.dtype == torch.float32 and tuple(got.shape) == (ROWS, COLS)
    # ggml computes in float32 (a K-quant's d * scale first): a few roundings of the values' magnitude
    diff = np.abs(got.numpy().astype(np.float64) - expected)
    row, col = (int(i) for i in np.unravel_index(diff.argmax(), diff.shape))
    assert diff[row, col] <= 1e-6 * np.abs(expected).max(), (
        f"{qtype.name}: value [{row}, {col}] is {got[row, col].item()}, its block says {expected[row, col]}")


def _full_range_blocks(qtype, rng) -> np.ndarray:
    """Blocks as llama.cpp's quantizer writes them: Q4_1 with d > 0 and codes reaching 0 and 15, Q8_0
    with codes in [-127, 127] reaching +-127 (the values our int4 / int8 must keep exactly)."""
    blocks = random_blocks(qtype, ROWS * COLS, rng)
    blocks[:, 0:2] = np.abs(blocks[:, 0:2].copy().view(np.float16)).view(np.uint8)
    if qtype == Q.Q4_1:
        blocks[:, 4] = 0xF0  # value 0 has code 0, value 16 code 15
    else:
        codes = blocks[:, 2:34].view(np.int8)
        codes[codes == -128] = -127
        codes[:, 0] = rng.choice([-127, 127], len(blocks))
    return blocks


@pytest.mark.parametrize("qtype, fmt", [(Q.Q4_1, Int4Weight), (Q.Q8_0, Int8Weight)], ids=["Q4_1-int4", "Q8_0-int8"])
def test_int_formats_keep_a_file_s_own_values(tmp_path, qtype, fmt):
    blocks = _full_range_blocks(qtype, np.random.default_rng(1))
    path = tmp_path / "full-range.gguf"
    write_gguf(path, {"blk.0.ffn_up.weight": (qtype, blocks)})
    [(_, produce)] = list(gguf_tensors(open_gguf(path), None))
    weight = produce()
    expected = torch.from_numpy(REFERENCES[qtype](blocks).reshape(ROWS, COLS).astype(np.float32))
    assert torch.equal(weight, expected), f"loaded: max |diff| {(weight - expected).abs().max().item():.3g}"
    kept = fmt.quantize(weight)[1]
    assert torch.equal(kept, expected), f"{fmt.__name__}: max |diff| {(kept - expected).abs().max().item():.3g}"
