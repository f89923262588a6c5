"""Weight-only quantization of the linear layers (CPU): int8 and int4 in groups of 32 inputs.

Why: a decode step with a few tokens is bound by reading the weights, so fewer bytes per weight is
faster. Our kernels (csrc/quantized_matmul.cpp) beat torch's int4 kernel at one token and oneDNN's
packed bfloat16 at every step size measured, from one token to 512 (docs/PERFORMANCE.md, "Speed modes"),
so a quantized layer has one layout, the kernel's, for every step; ops.linear multiplies by it. The
kernels round each group of 32 activations to int8, as llama.cpp's do: that is part of the quantized
model.

The formats are GGUF's: int4 is Q4_1 (code 0..15, float16 scale and minimum per group) or, without minimums,
Q4_0 (w = (code - 8) * scale), int8 is Q8_0 (code -127..127, float16 scale per group), so a checkpoint in those
formats keeps its own codes (tests/test_quant.py checks Q4_1's against the file's blocks). W4A16 also holds a
GGUF's Q4_K matrices in their own codes and super-block scales (Int4SuperblockWeight). The int8 mode's block
linears take a third, Int8ChannelWeight (one scale per row), where the file does not store them as Q8_0: its kernel
prefills at 1.6-2x bfloat16's rate, where the per-group ones run near bfloat16's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from tinyserve.config import QUANTIZATIONS

GROUP = 32  # inputs per scale (and minimum)
SPAN = 32  # inputs per activation scale in Int8ChannelWeight's kernel
KERNEL_ROWS = 16  # the kernels interleave the weights of 16 output rows, one per vector lane
_TINY = torch.finfo(torch.float32).tiny  # keeps an all-zero group from dividing by zero


def kernel_layout(chunks: torch.Tensor, values: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Blocks of 16 rows (zero rows pad the last), interleaved per group as our matmul kernels read them
    (csrc/quantized_matmul.cpp, csrc/bf16_matmul.cpp). chunks [rows, groups, chunks, 4] uint8: a row's
    bytes of one group, 4 per vector lane (or another count: a wide code's high bits, 1 or 2 bytes a chunk);
    values: per-group scales or minimums [rows, groups] (or per super-block: [rows, any count]) ->
    [blocks, count * 16] each."""
    rows, groups = chunks.shape[:2]
    blocks = -(-rows // KERNEL_ROWS)
    pad = blocks * KERNEL_ROWS - rows

    def padded(t: torch.Tensor) -> torch.Tensor:  # rows to whole blocks (F.pad copies even when pad is 0)
        return F.pad(t, (0,) * (2 * t.dim() - 1) + (pad,)) if pad else t

    lane_type = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[chunks.shape[-1]]
    lanes = padded(chunks.contiguous().view(lane_type).squeeze(-1))  # a lane's bytes of a chunk: one element
    codes = lanes.reshape(blocks, KERNEL_ROWS, groups, -1).permute(0, 2, 3, 1).contiguous()
    return codes.view(torch.uint8).reshape(blocks, -1), [
        padded(v).reshape(blocks, KERNEL_ROWS, -1).transpose(1, 2).reshape(blocks, -1).contiguous() for v in values]


def _grouped(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"quantization needs in_features divisible by {GROUP}, got {in_features}")
    return weight.float().reshape(out_features, in_features // GROUP, GROUP)


@dataclass(frozen=True)
class GroupCodes:
    """A matrix's codes per group of 32 inputs, before the kernels' interleaving: the formats' common form,
    which a file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks convert to without any float (loader/gguf/blocks.py)
    and float weights quantize to (int4_group_codes, int8_group_codes), a block of rows at a time.

    With minimums (4 and 5 bits, Q4_1's and Q5_1's rule): w = code * scale + minimum, code 0..15 (0..31).
    Without (the symmetric rule): w = (code - zero_code(bits)) * scale: Q4_0's and Q5_0's (code - 8) * d and
    (code - 16) * d, and 8 bits' Q8_0, its code stored plus 128 in a byte (the kernels multiply unsigned bytes).
    The symmetric rule's offset, -zero_code * scale, is exact in float32, so the kernels compute it from the
    scale; held as a float16 minimum it cost 2 bytes per 32 weights and overflowed for Q4_0's d over 8188."""

    bits: int
    codes: torch.Tensor  # [rows, in] uint8
    scales: torch.Tensor  # [rows, in / 32] float16
    minimums: torch.Tensor | None  # [rows, in / 32] float16, or None: the symmetric rule (always at 8 bits)

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, in] of the matrix."""
        return tuple(self.codes.shape)

    def dequantized(self) -> torch.Tensor:
        """The values the codes stand for, float32 [rows, in], as the kernels compute them."""
        rows, in_features = self.codes.shape
        groups = self.codes.reshape(rows, in_features // GROUP, GROUP).float()
        scale = self.scales.float()[..., None]
        if self.minimums is None:
            return ((groups - zero_code(self.bits)) * scale).reshape(rows, in_features)
        return (groups * scale + self.minimums.float()[..., None]).reshape(rows, in_features)

    def packed(self) -> NibbleCodes:
        """4-bit codes two a byte in the int4 kernels' order (NibbleCodes)."""
        if self.bits != 4:
            raise ValueError(f"only 4-bit codes pack into nibbles, got {self.bits}-bit")
        return NibbleCodes(_nibble_chunks(self.codes).reshape(self.codes.shape[0], -1), self.scales, self.minimums)

    def with_minimums(self) -> GroupCodes:
        """Symmetric 4- or 5-bit codes under Q4_1's rule: minimums -zero_code * scale, exact in float16 where
        they do not overflow (inf there): the same weights as without them (a matrix whose shards mix the rules
        holds them so: loader/staged_linears.py writes symmetric_minimums for its symmetric rows)."""
        if self.minimums is not None:
            return self
        return dataclasses.replace(self, minimums=symmetric_minimums(self.scales, self.bits))


@dataclass(frozen=True)
class NibbleCodes:
    """4-bit group codes packed two a byte in the int4 kernels' order within each group (byte 4c + b of a group
    holds inputs 8c + b and 8c + b + 4: Int4Weight's chunks, before the interleaving of rows), with GroupCodes'
    scales and minimums and rule: what Int4Weight is made of. A file's Q4_0 / Q4_1 blocks become these in a few
    word operations (loader/gguf/blocks.py, nibble_codes) and a Q4_K's codes as they are
    (SuperblockCodes.as_nibble_codes): no pass at a byte per weight on the way (GroupCodes.packed from those)."""

    bits: ClassVar[int] = 4
    codes: torch.Tensor  # [rows, in / 2] uint8
    scales: torch.Tensor  # [rows, in / 32] float16
    minimums: torch.Tensor | None  # [rows, in / 32] float16, or None: w = (code - 8) * scale

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, in] of the matrix."""
        return self.codes.shape[0], self.codes.shape[1] * 2

    def unpacked(self) -> GroupCodes:
        """The same codes a byte each, in input order."""
        return GroupCodes(4, unpacked_nibbles(self.codes), self.scales, self.minimums)

    def dequantized(self) -> torch.Tensor:
        return self.unpacked().dequantized()

    def with_minimums(self) -> NibbleCodes:
        """GroupCodes.with_minimums."""
        if self.minimums is not None:
            return self
        return dataclasses.replace(self, minimums=symmetric_minimums(self.scales, self.bits))


def symmetric_minimums(scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The symmetric rule's offsets as Q4_1-style minimums: -zero_code * scale in float16 (inf where it overflows)."""
    return (scales.float() * -zero_code(bits)).to(torch.float16)


def zero_code(bits: int) -> int:
    """The code that stands for 0 under the symmetric rule (GroupCodes): 8, 16, 128 for 4, 5, 8 bits."""
    return 1 << (bits - 1)


def int8_group_codes(weight: torch.Tensor) -> GroupCodes:
    """Q8_0's rule per group of 32 inputs: scale = max |w| / 127, code = round(w / scale)."""
    groups = _grouped(weight)
    scale = (groups.abs().amax(dim=-1) / 127).to(torch.float16)
    codes = torch.round(groups / scale.float().clamp(min=_TINY)[..., None]).clamp(-127, 127)
    stored = (codes.to(torch.int32) + 128).to(torch.uint8).reshape(weight.shape)
    return GroupCodes(8, stored, scale, None)


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1's rule per group of 32 inputs: minimum = the group's min, scale = (max - min) / 15,
    code = round((w - minimum) / scale). Returns codes [out, in] int32, scale and minimum [out, groups]."""
    groups = _grouped(weight)
    minimum = groups.amin(dim=-1, keepdim=True)
    scale = ((groups.amax(dim=-1, keepdim=True) - minimum) / 15).clamp(min=_TINY)
    codes = torch.round((groups - minimum) / scale).clamp(0, 15).to(torch.int32).reshape(weight.shape)
    return codes, scale.squeeze(-1), minimum.squeeze(-1)


def int4_group_codes(weight: torch.Tensor) -> GroupCodes:
    """int4_codes with the scale and minimum rounded to float16, as Int4Weight keeps them."""
    codes, scale, minimum = int4_codes(weight)
    return GroupCodes(4, codes.to(torch.uint8), scale.to(torch.float16), minimum.to(torch.float16))


@dataclass(frozen=True)
class Int8Weight:
    """Symmetric int8 per group of 32 inputs (Q8_0): w = code * scale, code in [-127, 127]."""

    codes: torch.Tensor  # [blocks of 16 rows, in * 16] uint8: code + 128 (the kernel multiplies unsigned bytes)
    scales: torch.Tensor  # [blocks, groups * 16] float16
    out_features: int
    int8_inputs: bool = True  # the kernel rounds the activations to int8 (int8_matmul), else not (w8a16_matmul)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[Int8Weight, torch.Tensor]:
        """The quantized weight and its dequantized values (float32)."""
        codes = int8_group_codes(weight)
        return cls.from_codes(codes), codes.dequantized()

    @classmethod
    def from_codes(cls, codes: GroupCodes) -> Int8Weight:
        """The kernel's layout of 8-bit group codes (a file's Q8_0 blocks, or int8_group_codes')."""
        if codes.bits != 8:
            raise ValueError(f"Int8Weight takes 8-bit codes, got {codes.bits}-bit")
        rows, in_features = codes.codes.shape
        packed, (scales,) = kernel_layout(codes.codes.reshape(rows, in_features // GROUP, -1, 4), [codes.scales])
        return cls(packed, scales, rows)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ids [n] as float32 [n, in] (an embedding lookup), read from the kernel layout."""
        blocks = self.codes.shape[0]
        codes = self.codes.view(blocks, -1, KERNEL_ROWS, 4)  # [block, group and chunk, row, byte]
        scales = self.scales.view(blocks, -1, KERNEL_ROWS)  # [block, group, row]
        block, row = ids // KERNEL_ROWS, ids % KERNEL_ROWS
        groups = codes[block, :, row].reshape(len(ids), scales.shape[1], GROUP).float() - 128
        return (groups * scales[block, :, row].float()[..., None]).flatten(1)


@dataclass(frozen=True)
class Int8ChannelWeight:
    """Symmetric int8 per output row: w = code * scale, code in [-127, 127], one float32 scale per row.
    Its kernel (csrc/int8_channel_matmul.cpp) rounds the inputs to int8 per span of 32, as the per-group
    kernels do, but with the weight's scale per row its float work is one convert-and-add per 32 inputs
    and one multiply per output: its linears run at 1.6-2x bfloat16's rate from 64 rows, where Int8Weight's
    run at 1.3x (docs/PERFORMANCE.md, "Prefill at the integer rate"); it decodes as fast and is stored in
    a byte per weight (Q8_0: 1.06). Any in_features: the codes pad it to a multiple of 4 with zeros.

    For a checkpoint stored in Q8_0 that would be a second rounding of its values, so there Int8Weight
    stays (layers/linear.py)."""

    codes: torch.Tensor  # [blocks of 16 rows, ceil(in / 4) * 64] uint8: code + 128, Int8Weight's interleaving
    scales: torch.Tensor  # [blocks * 16] float32 (zero for the padding rows)
    out_features: int

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[Int8ChannelWeight, torch.Tensor]:
        """The quantized weight and its dequantized values (float32)."""
        out_features, in_features = weight.shape
        weight = weight.float()
        scale = weight.abs().amax(dim=1) / 127
        codes = torch.round(weight / scale.clamp(min=_TINY)[:, None]).clamp(-127, 127)
        dequantized = codes * scale[:, None]
        padded = F.pad(codes, (0, -in_features % 4))
        stored = (padded.to(torch.int32) + 128).to(torch.uint8)  # the kernel multiplies unsigned bytes
        packed, (scales,) = kernel_layout(stored.reshape(out_features, 1, -1, 4), [scale[:, None]])
        return cls(packed, scales.flatten(), out_features), dequantized


def _nibble_chunks(codes: torch.Tensor) -> torch.Tensor:
    """[rows, in] uint8 codes 0..15 -> [rows, groups, 4 chunks, 4 bytes], the int4 kernels' chunks: input i of a
    group = 8 * chunk + 4 * nibble + byte (the nibbles of a byte: inputs j and j + 4)."""
    rows = codes.shape[0]
    words = codes.contiguous().view(torch.int32).reshape(rows, -1, 4, 2)  # a chunk's 4 low, then 4 high codes
    return (words[..., 0] | (words[..., 1] << 4)).contiguous().view(torch.uint8).reshape(rows, -1, 4, 4)


def _scales_and_minimums(codes: GroupCodes | NibbleCodes) -> list[torch.Tensor]:
    """The per-group values kernel_layout interleaves: the scales, and the minimums where the codes have them."""
    return [codes.scales] if codes.minimums is None else [codes.scales, codes.minimums]


@dataclass(frozen=True)
class Int4Weight:
    """int4 per group of 32 inputs, code in [0, 15]: asymmetric (Q4_1), w = code * scale + minimum, 20 bytes per
    32 weights of a row, or without minimums symmetric (a file's Q4_0), w = (code - 8) * scale, 18: the file's."""

    codes: torch.Tensor  # [blocks of 16 rows, in * 8] uint8: two codes a byte (inputs j and j + 4)
    scales: torch.Tensor  # [blocks, groups * 16] float16
    minimums: torch.Tensor | None  # [blocks, groups * 16] float16, or None: w = (code - 8) * scale
    out_features: int
    int8_inputs: bool = True  # the kernel rounds the activations to int8 (int4_matmul), else not (w4a16_matmul)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[Int4Weight, torch.Tensor]:
        """The quantized weight and its dequantized values (float32)."""
        codes = int4_group_codes(weight)
        return cls.from_codes(codes), codes.dequantized()

    @classmethod
    def from_codes(cls, codes: GroupCodes | NibbleCodes) -> Int4Weight:
        """The kernel's layout of 4-bit group codes (a file's Q4_0 / Q4_1 blocks or Q4_K's codes as NibbleCodes,
        or int4_group_codes')."""
        if codes.bits != 4:
            raise ValueError(f"Int4Weight takes 4-bit codes, got {codes.bits}-bit")
        if isinstance(codes, GroupCodes):
            codes = codes.packed()
        rows = codes.codes.shape[0]
        packed, (scales, *minimums) = kernel_layout(codes.codes.reshape(rows, -1, 4, 4), _scales_and_minimums(codes))
        return cls(packed, scales, minimums[0] if minimums else None, rows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.minimums) if t is not None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ids [n] as float32 [n, in] (an embedding lookup), read from the kernel layout:
        code * scale + minimum (without minimums: + -8 * scale, exact), as the kernels widen them (code * scale
        is exact, so one rounding either way)."""
        blocks = self.codes.shape[0]
        codes = self.codes.view(blocks, -1, KERNEL_ROWS, 4)  # [block, group and chunk, row, byte]
        scales = self.scales.view(blocks, -1, KERNEL_ROWS)  # [block, group, row]
        block, row = ids // KERNEL_ROWS, ids % KERNEL_ROWS
        chunks = codes[block, :, row]  # [n, group and chunk, byte]: inputs 8 * chunk + byte (low), + 4 (high)
        nibbles = torch.stack([chunks & 0x0F, chunks >> 4], dim=-2)  # [n, group and chunk, nibble, byte]
        groups = nibbles.reshape(len(ids), scales.shape[1], GROUP).float()
        scale = scales[block, :, row].float()[..., None]  # [n, group, 1]
        if self.minimums is None:
            offset = scale * -zero_code(4)
        else:
            offset = self.minimums.view(blocks, -1, KERNEL_ROWS)[block, :, row].float()[..., None]
        return (groups * scale + offset).flatten(1)


@dataclass(frozen=True)
class Int5Weight:
    """GGUF Q5_0 and Q5_1 matrices in their own 5-bit codes (GroupCodes of 5 bits), for the W4A16 kernel
    (csrc/quantized_matmul_a16.cpp, w5a16_matmul): Int4Weight's interleaved nibbles of the low 4 bits and its
    float16 scales and minimums (Q5_1) or none (Q5_0: w = (code - 16) * scale), the high bit in a plane beside
    them (csrc/a16_formats.h). 24 bytes per 32 weights of a row for Q5_1, 22 for Q5_0: the file's."""

    codes: torch.Tensor  # [blocks of 16 rows, in * 8] uint8: Int4Weight's layout
    high_bits: torch.Tensor  # [blocks, in * 2] uint8: per group and row, a 32-bit word (csrc/a16_formats.h)
    scales: torch.Tensor  # [blocks, groups * 16] float16
    minimums: torch.Tensor | None  # [blocks, groups * 16] float16, or None: w = (code - 16) * scale
    out_features: int

    @classmethod
    def from_codes(cls, codes: GroupCodes) -> Int5Weight:
        """The kernel's layout of 5-bit group codes (a file's Q5_0 / Q5_1 blocks)."""
        if codes.bits != 5:
            raise ValueError(f"Int5Weight takes 5-bit codes, got {codes.bits}-bit")
        rows = codes.codes.shape[0]
        packed, (scales, *minimums) = kernel_layout(_nibble_chunks(codes.codes & 0x0F), _scales_and_minimums(codes))
        high_bits, _ = kernel_layout(packed_high_bits(codes.codes >> 4, 1).reshape(rows, -1, 1, 4), [])
        return cls(packed, high_bits, scales, minimums[0] if minimums else None, rows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.high_bits, self.scales, self.minimums) if t is not None)


SUPERBLOCK = 256  # inputs per super-block (GGUF's K-quants): 8 groups of 32


def unpacked_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[rows, in / 2] uint8 nibbles in the int4 kernels' order within each group (byte 4c + b: inputs 8c + b
    and 8c + b + 4) -> [rows, in] uint8, a code a byte in input order."""
    chunks = codes.reshape(codes.shape[0], -1, 1, 4)  # [row, group and chunk, 1, byte]
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=-2).reshape(codes.shape[0], -1)


def packed_high_bits(high: torch.Tensor, bits: int) -> torch.Tensor:
    """unpacked_high_bits' inverse: [rows, in] uint8 high bits in input order -> the high plane's bytes."""
    rows = high.shape[0]
    inputs = torch.arange(32 // bits, dtype=torch.int32)
    spans = high.reshape(rows, -1, 32 // bits).to(torch.int32) << (8 * (inputs % 4) + bits * (inputs // 4))
    return spans.sum(-1, dtype=torch.int32).view(torch.uint8).reshape(rows, -1)  # disjoint bits: sum = OR


def unpacked_high_bits(high_bits: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, in * bits / 8] uint8, a wide code's high plane before the kernel's interleaving of rows: per span of
    32 / bits inputs a 32-bit word (little-endian) whose byte k holds the high bits of the span's inputs 4m + k at
    bits bits * m (csrc/a16_formats.h) -> [rows, in] uint8, the high bits in input order."""
    rows = high_bits.shape[0]
    words = high_bits.contiguous().view(torch.int32).reshape(rows, -1, 1)  # [row, span, 1]
    inputs = torch.arange(32 // bits, dtype=torch.int32)
    shifts = 8 * (inputs % 4) + bits * (inputs // 4)
    return ((words >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(rows, -1)


@dataclass(frozen=True)
class SuperblockCodes:
    """A GGUF Q4_K matrix's own codes, before the kernel's interleaving of rows (loader/gguf/blocks.py makes them
    from the file's bytes, without a float): per super-block of 256 inputs and row, float16 d and dmin; per
    group of 32 inputs, 6-bit sc and m; w = code * (d * sc) - dmin * m, code 0..15. The codes come two a byte
    in the int4 kernels' order within a group (Int4Weight's chunks: byte 4c + b holds inputs 8c + b and
    8c + b + 4), which Q4_K's nibbles map to with a few byte ops."""

    codes: torch.Tensor  # [rows, in / 2] uint8
    d: torch.Tensor  # [rows, in / 256] float16
    dmin: torch.Tensor  # [rows, in / 256] float16
    sub_scales: torch.Tensor  # [rows, in / 32] uint8 0..63
    sub_mins: torch.Tensor  # [rows, in / 32] uint8 0..63

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, in] of the matrix."""
        return self.codes.shape[0], self.codes.shape[1] * 2

    @classmethod
    def empty(cls, rows: int, in_features: int, device: torch.device) -> SuperblockCodes:
        halves, bytes_ = dict(dtype=torch.float16, device=device), dict(dtype=torch.uint8, device=device)
        supers, groups = in_features // SUPERBLOCK, in_features // GROUP
        return cls(torch.empty(rows, in_features // 2, **bytes_), torch.empty(rows, supers, **halves),
                   torch.empty(rows, supers, **halves), torch.empty(rows, groups, **bytes_),
                   torch.empty(rows, groups, **bytes_))

    def dequantized(self) -> torch.Tensor:
        """The values the codes stand for, float32 [rows, in], as the kernel computes them (and ggml: d * sc
        and dmin * m are exact in float32, so each value is rounded once)."""
        rows, in_features = self.shape
        per_group = SUPERBLOCK // GROUP
        scale = self.d.float().repeat_interleave(per_group, 1) * self.sub_scales.float()
        offset = -(self.dmin.float().repeat_interleave(per_group, 1) * self.sub_mins.float())
        groups = self.code_values().reshape(rows, -1, GROUP).float()
        return torch.addcmul(offset[..., None], groups, scale[..., None]).reshape(rows, in_features)

    def code_values(self) -> torch.Tensor:
        """[rows, in] uint8, the codes in input order."""
        return unpacked_nibbles(self.codes)

    def as_nibble_codes(self) -> NibbleCodes | None:
        """Q4_K's codes under Q4_1's rule, for int4 mode's Int4Weight (its int8-activation kernel has no
        super-blocks): per group, scale d * sc and minimum -dmin * m, each exact in float32 and rounded once to
        float16 (2^-11 of it at most, where requantizing the values by rows moved each weight by up to half a
        step). The codes stay the file's, packed as they are. None where a scale or minimum overflows float16."""
        if type(self) is not SuperblockCodes:
            raise TypeError(f"{type(self).__name__} has codes wider than 4 bits")
        per_group = SUPERBLOCK // GROUP
        scales = (self.d.float().repeat_interleave(per_group, 1) * self.sub_scales.float()).to(torch.float16)
        minimums = (self.dmin.float().repeat_interleave(per_group, 1) * -self.sub_mins.float()).to(torch.float16)
        if not (scales.isfinite().all() and minimums.isfinite().all()):
            return None
        return NibbleCodes(self.codes, scales, minimums)


@dataclass(frozen=True)
class Int5SuperblockCodes(SuperblockCodes):
    """A GGUF Q5_K matrix's own codes (loader/gguf/blocks.py, without a float): Q4_K's (SuperblockCodes), the codes
    0..31 with their high bit in the kernel's high plane (unpacked_high_bits: per group a 32-bit word, byte k
    holding inputs 4m + k's at bit m)."""

    high_bits: torch.Tensor  # [rows, in / 8] uint8

    @classmethod
    def empty(cls, rows: int, in_features: int, device: torch.device) -> Int5SuperblockCodes:
        low = SuperblockCodes.empty(rows, in_features, device)
        return cls(low.codes, low.d, low.dmin, low.sub_scales, low.sub_mins,
                   torch.empty(rows, in_features // 8, dtype=torch.uint8, device=device))

    def code_values(self) -> torch.Tensor:
        return unpacked_nibbles(self.codes) | (unpacked_high_bits(self.high_bits, 1) << 4)


@dataclass(frozen=True)
class Int4SuperblockWeight:
    """A GGUF Q4_K matrix in its own codes and scales, for the W4A16 kernel (csrc/quantized_matmul_a16.cpp,
    w4a16_superblock_matmul: the activations unrounded): Int4Weight's interleaved nibbles, and per block of 16
    rows the rows' d and dmin per super-block and 6-bit sc and m per group, a byte each. 148 bytes per 256
    weights of a row where the file has 144 (its 12 bytes of packed 6-bit values kept as 16): 2.8% more."""

    codes: torch.Tensor  # [blocks of 16 rows, in * 8] uint8: Int4Weight's layout
    d: torch.Tensor  # [blocks, supers * 16] float16
    dmin: torch.Tensor  # [blocks, supers * 16] float16
    sub_scales: torch.Tensor  # [blocks, groups * 16] uint8
    sub_mins: torch.Tensor  # [blocks, groups * 16] uint8
    out_features: int

    @classmethod
    def from_codes(cls, codes: SuperblockCodes) -> Int4SuperblockWeight:
        rows = codes.codes.shape[0]
        packed, values = kernel_layout(codes.codes.reshape(rows, -1, 4, 4),
                                       [codes.d, codes.dmin, codes.sub_scales, codes.sub_mins])
        return cls(packed, *values, rows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.d, self.dmin, self.sub_scales, self.sub_mins))

    def row_codes(self, ids: torch.Tensor) -> SuperblockCodes:
        """The codes of rows ids [n], out of the kernel layout ([block, group and chunk, row, bytes])."""
        blocks, n = self.codes.shape[0], len(ids)
        block, row = ids // KERNEL_ROWS, ids % KERNEL_ROWS
        per_row = [t.view(blocks, -1, KERNEL_ROWS)[block, :, row] for t in (self.d, self.dmin, self.sub_scales,
                                                                             self.sub_mins)]
        return SuperblockCodes(self.codes.view(blocks, -1, KERNEL_ROWS, 4)[block, :, row].reshape(n, -1), *per_row)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ids [n] as float32 [n, in] (an untied Q4_K embedding's lookup): the file's values,
        exactly. Q4_K's alone: Int5SuperblockWeight's high plane is not read here (it holds no embedding)."""
        if type(self) is not Int4SuperblockWeight:
            raise TypeError(f"no row lookup for a {type(self).__name__}")
        return self.row_codes(ids).dequantized()


@dataclass(frozen=True)
class Int6SuperblockCodes:
    """A GGUF Q6_K matrix's own codes, before the kernel's interleaving of rows (loader/gguf/blocks.py makes them
    from the file's bytes, without a float): per super-block of 256 inputs and row, float16 d; per 16 inputs, an
    int8 sc; w = (code - 32) * (d * sc), code 0..63 = nibble | high << 4. The nibbles as SuperblockCodes' (the
    int4 kernels' order within a group); the high 2 bits as the kernel's high plane (unpacked_high_bits): per
    16 inputs a 32-bit word, byte k holding inputs 4m + k's at bits 2m."""

    codes: torch.Tensor  # [rows, in / 2] uint8: the low 4 bits
    high_bits: torch.Tensor  # [rows, in / 4] uint8: the high 2 bits
    d: torch.Tensor  # [rows, in / 256] float16
    sub_scales: torch.Tensor  # [rows, in / 16] int8

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, in] of the matrix."""
        return self.codes.shape[0], self.codes.shape[1] * 2

    @classmethod
    def empty(cls, rows: int, in_features: int, device: torch.device) -> Int6SuperblockCodes:
        bytes_ = dict(dtype=torch.uint8, device=device)
        return cls(torch.empty(rows, in_features // 2, **bytes_), torch.empty(rows, in_features // 4, **bytes_),
                   torch.empty(rows, in_features // SUPERBLOCK, dtype=torch.float16, device=device),
                   torch.empty(rows, in_features // 16, dtype=torch.int8, device=device))

    def dequantized(self) -> torch.Tensor:
        """The values the codes stand for, float32 [rows, in], as the kernel computes them (and ggml: every
        product is exact in float32, csrc/a16_formats.h says why)."""
        rows, in_features = self.shape
        codes = unpacked_nibbles(self.codes) | (unpacked_high_bits(self.high_bits, 2) << 4)
        scale = self.d.float().repeat_interleave(SUPERBLOCK // 16, 1) * self.sub_scales.float()  # [rows, in / 16]
        signed = codes.reshape(rows, -1, 16).float() - 32
        return (signed * scale[..., None]).reshape(rows, in_features)


@dataclass(frozen=True)
class Int6SuperblockWeight:
    """A GGUF Q6_K matrix in its own codes and scales, for the W4A16 kernel (csrc/quantized_matmul_a16.cpp,
    w6a16_superblock_matmul: the activations unrounded): Int4Weight's interleaved nibbles of the codes' low
    4 bits, their high 2 bits in a plane beside them (csrc/a16_formats.h), and per block of 16 rows the rows' d
    per super-block and int8 sc per 16 inputs. 210 bytes per 256 weights of a row, as the file's 210 (int8,
    which held them before: 272)."""

    codes: torch.Tensor  # [blocks of 16 rows, in * 8] uint8: Int4Weight's layout
    high_bits: torch.Tensor  # [blocks, in * 4] uint8: per 16 inputs and row, a 32-bit word (csrc/a16_formats.h)
    d: torch.Tensor  # [blocks, supers * 16] float16
    sub_scales: torch.Tensor  # [blocks, in / 16 * 16] int8
    out_features: int

    @classmethod
    def from_codes(cls, codes: Int6SuperblockCodes) -> Int6SuperblockWeight:
        rows = codes.codes.shape[0]
        packed, (d, sub_scales) = kernel_layout(codes.codes.reshape(rows, -1, 4, 4), [codes.d, codes.sub_scales])
        high_bits, _ = kernel_layout(codes.high_bits.reshape(rows, -1, 2, 4), [])  # [row, group, span, byte]
        return cls(packed, high_bits, d, sub_scales, rows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.high_bits, self.d, self.sub_scales))

    def row_codes(self, ids: torch.Tensor) -> Int6SuperblockCodes:
        """The codes of rows ids [n], out of the kernel layout ([block, group and chunk, row, bytes])."""
        blocks, n = self.codes.shape[0], len(ids)
        block, row = ids // KERNEL_ROWS, ids % KERNEL_ROWS
        codes = self.codes.view(blocks, -1, KERNEL_ROWS, 4)[block, :, row].reshape(n, -1)
        high_bits = self.high_bits.view(blocks, -1, KERNEL_ROWS, 4)[block, :, row].reshape(n, -1)
        d = self.d.view(blocks, -1, KERNEL_ROWS)[block, :, row]
        sub_scales = self.sub_scales.view(blocks, -1, KERNEL_ROWS)[block, :, row]
        return Int6SuperblockCodes(codes, high_bits, d, sub_scales)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ids [n] as float32 [n, in] (an embedding lookup): the file's values, exactly."""
        return self.row_codes(ids).dequantized()


@dataclass(frozen=True)
class Int5SuperblockWeight(Int4SuperblockWeight):
    """A GGUF Q5_K matrix in its own codes and scales, for the W4A16 kernel (csrc/quantized_matmul_a16.cpp,
    w5a16_superblock_matmul): Int4SuperblockWeight's nibbles and scales, the codes' high bit in a plane beside
    them (csrc/a16_formats.h). 180 bytes per 256 weights of a row where the file has 176 (Q4_K's 12 bytes of
    packed 6-bit values kept as 16): 2.3% more (int8, which held them before: 272).
    NOTE: a subclass, so that a match on Int4SuperblockWeight takes it too unless it asks for this one first."""

    high_bits: torch.Tensor  # [blocks, in * 2] uint8: per group and row, a 32-bit word (csrc/a16_formats.h)

    @classmethod
    def from_codes(cls, codes: Int5SuperblockCodes) -> Int5SuperblockWeight:
        low = Int4SuperblockWeight.from_codes(codes)
        high_bits, _ = kernel_layout(codes.high_bits.reshape(low.out_features, -1, 1, 4), [])  # [row, group, 1, byte]
        return cls(*(getattr(low, f.name) for f in dataclasses.fields(low)), high_bits)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.high_bits.nbytes


def check_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device) -> None:
    """On CPU: int4 and w4a16 at bfloat16 or float32 (int4's kernels round either to int8 per group; w4a16's
    widen the weights to float32); int8 at bfloat16 (its per-row kernel, int8_channel_matmul, reads bfloat16)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    dtypes = (torch.bfloat16,) if quantization == "int8" else (torch.bfloat16, torch.float32)
    if device.type != "cpu" or dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"quantization {quantization!r} runs on CPU with dtype {names} (or auto), "
                         f"got {device.type} and {dtype}")
