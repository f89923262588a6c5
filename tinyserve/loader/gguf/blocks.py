"""A GGUF tensor's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks as our group codes (layers/quant.py, GroupCodes), bytes to
bytes: no float on the way, so the kernels compute from the file's own codes and scales, and a load costs a
few integer ops per weight instead of a dequantization and a second quantization.

ggml's blocks, 32 weights each, rows of whole blocks:
- Q4_0 (18 bytes): float16 d, then 16 bytes of 4-bit codes q (weight j in byte j's low nibble, weight j + 16
  in its high nibble); w = (q - 8) * d: GroupCodes' symmetric rule (scale d, no minimums). The kernels'
  q * d + (-8 * d), in float32, is exact: (q - 8) * d.
- Q4_1 (20 bytes): float16 d and m, then the codes as Q4_0's; w = q * d + m: GroupCodes' rule with minimums.
- Q5_0 (22 bytes) and Q5_1 (24 bytes): Q4_0's and Q4_1's, with 4 bytes qh (a little-endian word: bit j the high
  bit of weight j) before the 16 bytes of low 4 bits; w = (q - 16) * d (no minimums: the kernels' q * d - 16 * d
  is exact) or q * d + m, q 0..31.
- Q8_0 (34 bytes): float16 d, then 32 int8 codes; w = q * d. Our Int8Weight stores q + 128 in a byte,
  which is q's bits with the sign bit flipped.

And Q4_K's super-blocks as SuperblockCodes (Int4SuperblockWeight's, for W4A16), also bytes to bytes:
- Q4_K (144 bytes, 256 weights): float16 d and dmin; 12 bytes packing the 6-bit scale sc_j and minimum m_j
  of each sub-block j of 32 (j < 4: the low 6 bits of byte j (sc) and of byte 4 + j (m); j >= 4: byte 4 + j's
  low (sc) and high (m) nibble, below the top 2 bits of byte j - 4 (sc) and of byte j (m)); 128 bytes of
  4-bit codes, sub-blocks 2s and 2s + 1 in the low and high nibbles of bytes 32s .. 32s + 31.
  w = q * (d * sc_j) - dmin * m_j.
And Q5_K's as Int5SuperblockCodes (Int5SuperblockWeight's, for W4A16):
- Q5_K (176 bytes, 256 weights): Q4_K's d, dmin and 12 bytes of 6-bit values, then 32 bytes qh (byte l: bit j
  the high bit of input l of sub-block j), then Q4_K's 128 bytes of low 4 bits. w = q * (d * sc_j) - dmin * m_j.
And Q6_K's as Int6SuperblockCodes (Int6SuperblockWeight's, for W4A16):
- Q6_K (210 bytes, 256 weights): 128 bytes ql of low 4 bits, 64 bytes qh of high 2 bits, 16 int8 scales (one
  per 16 weights), float16 d. Per half n of 128 weights and input l < 32 of its quarter q (weight 128n + 32q + l):
  the low nibble (q = 0, 1: low; 2, 3: high) of ql byte 64n + 32 (q % 2) + l, bits 2q, 2q + 1 of qh byte 32n + l.
  w = d * sc * (q - 32).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tinyserve.layers import ops
from tinyserve.layers.quant import GroupCodes, Int5SuperblockCodes, Int6SuperblockCodes, NibbleCodes, SuperblockCodes

# each type converted here -> the bits of the group codes it becomes
CODE_BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q5_0: 5,
             GGMLQuantizationType.Q5_1: 5, GGMLQuantizationType.Q8_0: 8}
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q5_0: 22,
                GGMLQuantizationType.Q5_1: 24, GGMLQuantizationType.Q8_0: 34}
_WITH_MINIMUMS = {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1}  # the others: w = (q - 2^(bits - 1)) d


def file_codes(tensor_type: GGMLQuantizationType, data: np.ndarray) -> GroupCodes | NibbleCodes:
    """data: the tensor's rows as bytes, uint8 [rows, bytes per row] (GGUFTensor.data or rows of it) -> the codes
    of the same rows as the formats take them: Q4_0's and Q4_1's packed (nibble_codes), the others' a byte each
    (group_codes)."""
    if CODE_BITS[tensor_type] == 4:
        return nibble_codes(tensor_type, data)
    return group_codes(tensor_type, data)


def group_codes(tensor_type: GGMLQuantizationType, data: np.ndarray) -> GroupCodes:
    """data: the tensor's rows as bytes, uint8 [rows, bytes per row] (GGUFTensor.data or rows of it) -> the
    group codes of the same rows."""
    if CODE_BITS[tensor_type] == 4:
        return nibble_codes(tensor_type, data).unpacked()
    rows = data.shape[0]
    blocks = _byte_rows(data).reshape(rows, -1, _BLOCK_BYTES[tensor_type])
    scales = _halves(blocks[..., 0:2])
    if tensor_type == GGMLQuantizationType.Q8_0:
        words = blocks[..., 2:].contiguous().view(torch.int32)
        return GroupCodes(8, _bytes(words ^ _per_byte(0x80), rows), scales, None)  # int8 q -> q + 128
    bits, at, minimums = CODE_BITS[tensor_type], 2, None
    if tensor_type in _WITH_MINIMUMS:
        minimums, at = _halves(blocks[..., 2:4]), 4
    # Q5_x: the high bits' word qh, then weights 0..15 in the low nibbles of the 16 bytes and 16..31 in the high
    # ones; on 4-byte words (a fourth of the elements of a byte-wise pass)
    packed = blocks[..., at + 4:].contiguous().view(torch.int32)
    low = _per_byte(0x0F)
    codes = torch.cat([packed & low, (packed >> 4) & low], dim=-1).view(torch.uint8)
    qh = blocks[..., at:at + 4].contiguous().view(torch.int32)  # weight j's high bit: bit j of the word qh
    codes |= ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8) << 4
    return GroupCodes(bits, codes.reshape(rows, -1), scales, minimums)


def nibble_codes(tensor_type: GGMLQuantizationType, data: np.ndarray) -> NibbleCodes:
    """A Q4_0 / Q4_1 tensor's rows as bytes (as group_codes takes them) -> their NibbleCodes. A block's 16 code
    bytes hold weight j in byte j's low nibble and weight 16 + j in its high one; the kernels' chunk c, byte b
    holds weights 8c + b (low) and 8c + b + 4 (high). On the block's four 4-byte words W0-W3 (byte b of Wm is
    the block's byte 4m + b) that is chunk 0 = lo(W0) | lo(W1) << 4, chunk 1 = lo(W2) | lo(W3) << 4, chunk 2 =
    hi(W0) >> 4 | hi(W1), chunk 3 = hi(W2) >> 4 | hi(W3), lo and hi the low and high nibble of each byte.
    Where our kernels are built, one C++ pass does it (csrc/gguf_nibbles.cpp: the same bytes)."""
    if ops.has_cpu_kernels():
        codes, scales, *minimums = ops.cpu_kernels.q4_nibble_codes(_byte_rows(data), tensor_type in _WITH_MINIMUMS)
        return NibbleCodes(codes, scales, minimums[0] if minimums else None)
    return _nibble_codes_in_torch(tensor_type, data)


def _nibble_codes_in_torch(tensor_type: GGMLQuantizationType, data: np.ndarray) -> NibbleCodes:
    """nibble_codes in torch ops, where our kernels are not built."""
    rows = data.shape[0]
    blocks = _byte_rows(data).reshape(rows, -1, _BLOCK_BYTES[tensor_type])
    scales, minimums, at = _halves(blocks[..., 0:2]), None, 2
    if tensor_type in _WITH_MINIMUMS:
        minimums, at = _halves(blocks[..., 2:4]), 4
    w0, w1, w2, w3 = blocks[..., at:].contiguous().view(torch.int32).unbind(-1)
    low, high = _per_byte(0x0F), _per_byte(0xF0)
    chunks = torch.stack([(w0 & low) | ((w1 & low) << 4), (w2 & low) | ((w3 & low) << 4),
                          ((w0 >> 4) & low) | (w1 & high), ((w2 >> 4) & low) | (w3 & high)], dim=-1)
    return NibbleCodes(_bytes(chunks, rows), scales, minimums)


_Q4_K_WORDS = 36  # 144 bytes: words 0 (d, dmin), 1-3 (the packed 6-bit values), 4-35 (the codes)


def superblock_codes(data: np.ndarray) -> SuperblockCodes:
    """data: a Q4_K tensor's rows as bytes, uint8 [rows, 144 * super-blocks] -> their SuperblockCodes. The bit
    work runs on 4-byte words (the masks repeat per byte; x86 is little-endian, so a word's byte k is the
    block's byte 4w + k): a fourth of the ops of a byte-wise pass, on wider rows. Where our kernels are built, one
    C++ pass does it (csrc/gguf_nibbles.cpp: the same bytes), as for the three below."""
    if ops.has_cpu_kernels():
        return SuperblockCodes(*ops.cpu_kernels.q45_k_codes(_byte_rows(data), False))
    return _superblock_codes_in_torch(data)


def _superblock_codes_in_torch(data: np.ndarray) -> SuperblockCodes:
    """superblock_codes in torch ops, where our kernels are not built."""
    rows = data.shape[0]
    blocks = _byte_rows(data).reshape(rows, -1, _Q4_K_WORDS * 4)
    words = blocks.view(torch.int32)  # [rows, super-blocks, 36]
    codes = _nibble_runs(words[..., 4:])  # [row, super-block, s, sub-block 2s + (0, 1), c]
    return SuperblockCodes(_bytes(codes, rows), *_superblock_scales(blocks, words))


def _superblock_scales(blocks: torch.Tensor, words: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K's (and Q5_K's) bytes 0-15 ([rows, super-blocks, bytes] and their int32 words) -> d, dmin [rows,
    super-blocks] float16 and the sub-blocks' 6-bit scales and minimums [rows, groups] uint8."""
    rows = blocks.shape[0]
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
    scales, mins, nibbles = words[..., 1], words[..., 2], words[..., 3]
    top = _per_byte(0x03)  # the 2 high bits of sub-blocks 4-7's values, kept in bits 6-7 of bytes 0-7
    low = _per_byte(0x0F)
    sub_scales = torch.stack([scales & _per_byte(0x3F), (nibbles & low) | (((scales >> 6) & top) << 4)], dim=-1)
    sub_mins = torch.stack([mins & _per_byte(0x3F), ((nibbles >> 4) & low) | (((mins >> 6) & top) << 4)], dim=-1)
    return d, dmin, _bytes(sub_scales, rows), _bytes(sub_mins, rows)


_Q5_K_WORDS = 44  # 176 bytes: Q4_K's words 0-3, then 4-11 (qh), 12-43 (the low 4 bits)


def int5_superblock_codes(data: np.ndarray) -> Int5SuperblockCodes:
    """data: a Q5_K tensor's rows as bytes, uint8 [rows, 176 * super-blocks] -> their Int5SuperblockCodes, on
    4-byte words as superblock_codes."""
    if ops.has_cpu_kernels():
        return Int5SuperblockCodes(*ops.cpu_kernels.q45_k_codes(_byte_rows(data), True))
    return _int5_superblock_codes_in_torch(data)


def _int5_superblock_codes_in_torch(data: np.ndarray) -> Int5SuperblockCodes:
    """int5_superblock_codes in torch ops, where our kernels are not built."""
    rows = data.shape[0]
    blocks = _byte_rows(data).reshape(rows, -1, _Q5_K_WORDS * 4)
    words = blocks.view(torch.int32)  # [rows, super-blocks, 44]
    codes = _nibble_runs(words[..., 12:])
    # qh byte l holds input l of sub-block j at bit j; the high plane's word for sub-block j holds its inputs
    # 4m + k in byte k, bit m: qh's word m, byte k, moved by m - j
    qh = words[..., 4:12].reshape(rows, -1, 1, 8)  # [.., 1, m]
    positions = torch.arange(8, dtype=torch.int32)
    bits = ((qh >> positions.reshape(8, 1)) & _per_byte(0x01)) << positions
    high_bits = bits.sum(-1, dtype=torch.int32)  # [.., j]: the m's bits do not overlap, their sum is their OR
    return Int5SuperblockCodes(_bytes(codes, rows), *_superblock_scales(blocks, words), _bytes(high_bits, rows))


def _nibble_runs(words: torch.Tensor) -> torch.Tensor:
    """[rows, super-blocks, 32] int32: 128 bytes of 4-bit codes in runs of 32 bytes, run s holding one group's
    codes in its low nibbles and another's in its high (byte 32s + i: input i of both) -> the int4 kernels' order
    within each group (byte 4c + b: inputs 8c + b in the low nibble, 8c + b + 4 in the high), as int32 words
    [rows, super-blocks, run s, low / high nibbles' group, c]."""
    rows = words.shape[0]
    # the kernel's byte 4c + b of a group: bytes 32s + 8c + b (first word) and + 4 (second) of the run
    pairs = words.reshape(rows, -1, 4, 4, 2)  # [row, super-block, s, c, first / second word]
    first, second = pairs[..., 0].contiguous(), pairs[..., 1].contiguous()
    low, high = _per_byte(0x0F), _per_byte(0xF0)
    even, odd = (first & low) | ((second << 4) & high), ((first >> 4) & low) | (second & high)
    return torch.stack([even, odd], dim=3)


_Q6_K_BYTES = 210  # ql 0-127, qh 128-191, scales 192-207, d 208-209


def int6_superblock_codes(data: np.ndarray) -> Int6SuperblockCodes:
    """data: a Q6_K tensor's rows as bytes, uint8 [rows, 210 * super-blocks] -> their Int6SuperblockCodes, on
    4-byte words as superblock_codes."""
    if ops.has_cpu_kernels():
        return Int6SuperblockCodes(*ops.cpu_kernels.q6_k_codes(_byte_rows(data)))
    return _int6_superblock_codes_in_torch(data)


def _int6_superblock_codes_in_torch(data: np.ndarray) -> Int6SuperblockCodes:
    """int6_superblock_codes in torch ops, where our kernels are not built."""
    rows = data.shape[0]
    blocks = _byte_rows(data).reshape(rows, -1, _Q6_K_BYTES)
    d = _halves(blocks[..., 208:210])
    sub_scales = blocks[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)
    # ql's runs of 32 bytes hold quarters (0, 2), (1, 3) of the first half, then of the second: groups
    # 4n + 2 * nibble + run % 2
    runs = _nibble_runs(blocks[..., :128].contiguous().view(torch.int32))  # [row, super-block, run, nibble, c]
    codes = runs.reshape(rows, -1, 2, 2, 2, 4).transpose(3, 4)  # [row, super-block, n, nibble, run % 2, c]
    # qh byte 32n + l holds input l of groups 4n + q at bits 2q, 2q + 1; the high plane's word for half h of a
    # group holds its inputs 16h + 4m + k in byte k, bits 2m: qh's word 8n + 4h + m, byte k, moved by 2m - 2q
    qh = blocks[..., 128:192].contiguous().view(torch.int32).reshape(rows, -1, 2, 1, 2, 4)  # [.., n, 1, h, m]
    quarters = (2 * torch.arange(4, dtype=torch.int32)).reshape(4, 1, 1)
    pairs = ((qh >> quarters) & _per_byte(0x03)) << (2 * torch.arange(4, dtype=torch.int32))  # [.., n, q, h, m]
    high_bits = pairs.sum(-1, dtype=torch.int32)  # the m's bits do not overlap: their sum is their OR
    return Int6SuperblockCodes(_bytes(codes, rows), _bytes(high_bits, rows), d, sub_scales)


# the K-quant types whose super-blocks convert to a W4A16 format's codes here -> the conversion
SUPERBLOCK_CODES = {GGMLQuantizationType.Q4_K: superblock_codes, GGMLQuantizationType.Q5_K: int5_superblock_codes,
                    GGMLQuantizationType.Q6_K: int6_superblock_codes}


def _byte_rows(data: np.ndarray) -> torch.Tensor:
    """A tensor's rows of bytes as the C++ passes take them: uint8 [rows, bytes per row], contiguous."""
    return torch.from_numpy(np.ascontiguousarray(data)).reshape(data.shape[0], -1)


def _per_byte(mask: int) -> int:
    """The int32 whose 4 bytes are each `mask`."""
    word = mask * 0x01010101
    return word - (1 << 32) if word >= 1 << 31 else word


def _bytes(words: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 words -> their bytes in memory order, [rows, ...]."""
    return words.contiguous().view(torch.uint8).reshape(rows, -1)


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 2] bytes -> [rows, blocks] float16 (little-endian, as x86 reads them)."""
    return pairs.contiguous().view(torch.float16).squeeze(-1)

