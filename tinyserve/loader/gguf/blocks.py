"""A GGUF tensor's Q4_0, Q4_1 and Q8_0 blocks as our group codes (layers/quant.py, GroupCodes), bytes to
bytes: no float on the way, so the kernels compute from the file's own codes and scales, and a load costs a
few integer ops per weight instead of a dequantization and a second quantization.

ggml's blocks, 32 weights each, rows of whole blocks:
- Q4_0 (18 bytes): float16 d, then 16 bytes of 4-bit codes q (weight j in byte j's low nibble, weight j + 16
  in its high nibble; GroupCodes keeps them two a byte in the kernels' order); w = (q - 8) * d. As Q4_1's rule that is scale d and minimum -8 * d, both exact in
  float16 (a power-of-two multiple), and the kernels' code * d + (-8 * d) rounds once to the exact (q - 8) * d.
- Q4_1 (20 bytes): float16 d and m, then the codes as Q4_0's; w = q * d + m: our Int4Weight's own rule.
- Q8_0 (34 bytes): float16 d, then 32 int8 codes; w = q * d. Our Int8Weight stores q + 128 in a byte,
  which is q's bits with the sign bit flipped.

And Q4_K's super-blocks as SuperblockCodes (Int4SuperblockWeight's, for W4A16), also bytes to bytes:
- Q4_K (144 bytes, 256 weights): float16 d and dmin; 12 bytes packing the 6-bit scale sc_j and minimum m_j
  of each sub-block j of 32 (j < 4: the low 6 bits of byte j (sc) and of byte 4 + j (m); j >= 4: byte 4 + j's
  low (sc) and high (m) nibble, below the top 2 bits of byte j - 4 (sc) and of byte j (m)); 128 bytes of
  4-bit codes, sub-blocks 2s and 2s + 1 in the low and high nibbles of bytes 32s .. 32s + 31.
  w = q * (d * sc_j) - dmin * m_j.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tinyserve.layers.quant import GroupCodes, SuperblockCodes
from tinyserve.loader.errors import ModelLoadError

# each type converted here -> the bits of the group codes it becomes
CODE_BITS = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


def group_codes(name: str, tensor_type: GGMLQuantizationType, data: np.ndarray) -> GroupCodes:
    """data: the tensor's rows as bytes, uint8 [rows, bytes per row] (GGUFTensor.data or rows of it) -> the
    group codes of the same rows. The bit work runs on 4-byte words, as superblock_codes' does (a fourth of
    the elements of a byte-wise pass: it was most of a Q4_0 model's load time)."""
    rows = data.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(rows, -1, _BLOCK_BYTES[tensor_type])
    scales = _halves(blocks[..., 0:2])
    if tensor_type == GGMLQuantizationType.Q8_0:
        words = blocks[..., 2:].contiguous().view(torch.int32)
        return GroupCodes(8, _bytes(words ^ _per_byte(0x80), rows), scales, None)  # int8 q -> q + 128
    if tensor_type == GGMLQuantizationType.Q4_1:
        minimums, packed = _halves(blocks[..., 2:4]), blocks[..., 4:]
    else:
        minimums, packed = (scales.float() * -8).to(torch.float16), blocks[..., 2:]
        if not bool(torch.isfinite(minimums).all()) and bool(torch.isfinite(scales).all()):
            raise ModelLoadError(f"tensor {name!r}: a Q4_0 scale over 8188 has no float16 minimum (-8 * d)")
    # byte j of a block holds weights j (low nibble) and j + 16 (high); the kernels' byte 4c + b of a group
    # holds its weights 8c + b (low) and 8c + b + 4 (high). In words w0..w3 (bytes 0-3 .. 12-15):
    w0, w1, w2, w3 = packed.contiguous().view(torch.int32).unbind(-1)
    low, high = _per_byte(0x0F), _per_byte(0xF0)
    chunks = torch.stack([(w0 & low) | ((w1 & low) << 4),  # weights 0-3 and 4-7
                          (w2 & low) | ((w3 & low) << 4),  # 8-11 and 12-15
                          ((w0 >> 4) & low) | (w1 & high),  # 16-19 and 20-23
                          ((w2 >> 4) & low) | (w3 & high)], dim=-1)  # 24-27 and 28-31
    return GroupCodes(4, _bytes(chunks, rows), scales, minimums)


_Q4_K_WORDS = 36  # 144 bytes: words 0 (d, dmin), 1-3 (the packed 6-bit values), 4-35 (the codes)


def superblock_codes(data: np.ndarray) -> SuperblockCodes:
    """data: a Q4_K tensor's rows as bytes, uint8 [rows, 144 * super-blocks] -> their SuperblockCodes. The bit
    work runs on 4-byte words (the masks repeat per byte; x86 is little-endian, so a word's byte k is the
    block's byte 4w + k): a fourth of the ops of a byte-wise pass, on wider rows."""
    rows = data.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(rows, -1, _Q4_K_WORDS * 4)
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
    words = blocks.view(torch.int32)  # [rows, super-blocks, 36]
    scales, mins, nibbles = words[..., 1], words[..., 2], words[..., 3]
    top = _per_byte(0x03)  # the 2 high bits of sub-blocks 4-7's values, kept in bits 6-7 of bytes 0-7
    low = _per_byte(0x0F)
    sub_scales = torch.stack([scales & _per_byte(0x3F), (nibbles & low) | (((scales >> 6) & top) << 4)], dim=-1)
    sub_mins = torch.stack([mins & _per_byte(0x3F), ((nibbles >> 4) & low) | (((mins >> 6) & top) << 4)], dim=-1)
    # sub-blocks 2s and 2s + 1 in the low and high nibbles of bytes 32s + i; the kernel's byte 4c + b of a group
    # holds its inputs 8c + b (low nibble) and 8c + b + 4 (high): bytes 32s + 8c + b (first word) and + 4 (second)
    pairs = words[..., 4:].reshape(rows, -1, 4, 4, 2)  # [row, super-block, s, c, first / second word]
    first, second = pairs[..., 0].contiguous(), pairs[..., 1].contiguous()
    high = _per_byte(0xF0)
    even, odd = (first & low) | ((second << 4) & high), ((first >> 4) & low) | (second & high)
    codes = torch.stack([even, odd], dim=3)  # [row, super-block, s, sub-block 2s + (0, 1), c]
    return SuperblockCodes(_bytes(codes, rows), d, dmin, _bytes(sub_scales, rows), _bytes(sub_mins, rows))


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

