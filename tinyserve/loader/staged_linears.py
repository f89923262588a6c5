"""A quantized model's linears loaded straight into their formats, one at a time: each Linear's codes are
assembled as its checkpoint tensors (or their blocks of rows) are read, and the Linear takes its kernel
layout as soon as its last rows are in. A tied LM head is the embedding's matrix: staged by the embedding
module, whose lookups then read the head's codes (layers/embedding.py). No float copy of the model exists at any time: beside the formats
already built, at most one Linear's codes (a byte per weight) and one block of rows in float32.

A tensor whose file codes convert to ours without a float (a GGUF's Q4_0 / Q4_1 into int4, its Q8_0 into
int8, in w4a16 mode its Q5_0 / Q5_1 into Int5Weight, its Q4_K, Q5_K and Q6_K into Int4-, Int5- and
Int6SuperblockWeight, a Q6_K head or embedding too: loader/gguf/blocks.py; in int4 mode its Q4_K into Int4Weight,
each group's scale and minimum rounded to float16) is copied code for code. Any other (a float tensor, a
tensor-parallel rank's columns, a Q5_K / Q6_K or Q5_x in another mode) is read as float32 rows and
quantized by its format's rule (layers/quant.py), which is the same for a block of rows as for the whole matrix:
each group of 32 inputs is one row's.
Int8ChannelWeight (the int8 mode's per-row scale) is quantized from the whole matrix in float32 instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tinyserve.layers.embedding import Embedding
from tinyserve.layers.linear import Linear, QuantizedFormat, TiedLMHead, log_kept_at_int8, quantized_format
from tinyserve.layers.quant import (GROUP, GroupCodes, Int4SuperblockWeight, Int4Weight, Int5SuperblockCodes,
                                    Int5SuperblockWeight, Int5Weight, Int6SuperblockCodes, Int6SuperblockWeight,
                                    Int8ChannelWeight, Int8Weight, NibbleCodes, SuperblockCodes, int4_group_codes,
                                    int8_group_codes, symmetric_minimums, zero_code)
from tinyserve.layers.weight_format import StackedWeight
from tinyserve.loader.errors import ModelLoadError

# a file's codes, before a format's interleaving
FileCodes = GroupCodes | NibbleCodes | SuperblockCodes | Int6SuperblockCodes
Decoder = Callable[[Any, Any], FileCodes]  # (fetched bytes, rows) -> codes
_RULES = {Int4Weight: int4_group_codes, Int8Weight: int8_group_codes}  # float rows -> group codes
_BITS = {Int4Weight: 4, Int5Weight: 5, Int8Weight: 8}  # the bits of the group codes each format holds
# the formats of a K-quant's super-blocks (w4a16 alone) -> the codes they are made of
_SUPERBLOCK_CODES = {Int4SuperblockWeight: SuperblockCodes, Int5SuperblockWeight: Int5SuperblockCodes,
                     Int6SuperblockWeight: Int6SuperblockCodes}


@dataclass(frozen=True)
class ShardBits:
    """One projection of a merged linear as the file stores it: its rows, and the bits of its codes that convert
    as they are (file_code_bits) or of its K-quant (file_superblock_bits), None where it has none."""

    first_row: int
    rows: int
    code_bits: int | None
    superblock_bits: int | None


@dataclass
class StagedLinear:
    """One Linear's weight on its way from the checkpoint to its format: `codes` filled by rows (Int4Weight's
    NibbleCodes, Int5Weight's and Int8Weight's GroupCodes; the super-block formats' SuperblockCodes,
    Int5SuperblockCodes, Int6SuperblockCodes), or `values`
    (Int8ChannelWeight, float32 [out, in])."""

    holders: tuple[nn.Module, ...]  # the modules that take the format: a Linear; a tied head and its embedding
    fmt: QuantizedFormat
    int8_inputs: bool
    shape: tuple[int, int]  # [out, in]
    rows_left: int = field(init=False)  # of the weight, not written yet
    codes: FileCodes | None = None
    values: torch.Tensor | None = None
    # 4 and 5 bits: the rows of pieces without minimums ([start, stop) each: Q4_0, Q5_0). If every row is such
    # a piece's, the format holds none (the symmetric rule); else these rows get theirs at build, -zero_code *
    # scale, which overflows float16 for a scale over 65504 / zero_code
    symmetric_rows: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self):
        self.rows_left = self.shape[0]

    @classmethod
    def start(cls, matrix: Linear | TiedLMHead | Embedding, quantization: str,
              file_code_bits: int | None, superblock_bits: int | None = None) -> StagedLinear:
        """Its format chosen (file_code_bits: the bits of the file's codes that convert as they are, for
        every tensor of it; None: not all do; superblock_bits: every tensor of it is the K-quant of these bits,
        Q4_K, Q5_K or Q6_K); its buffers come with its first rows (_buffers), so that at most one matrix's are held at
        a time."""
        fmt = quantized_format(matrix, quantization, file_code_bits, superblock_bits)
        if isinstance(matrix, TiedLMHead):
            holders, shape = (matrix, matrix.embedding), tuple(matrix.embedding.weight.shape)
        elif isinstance(matrix, Embedding):
            holders, shape = (matrix,), tuple(matrix.weight.shape)
        else:
            holders, shape = (matrix,), (matrix.out_features, matrix.in_features)
        if fmt is not Int8ChannelWeight and shape[1] % GROUP:
            raise ValueError(f"quantization needs in_features divisible by {GROUP}, got {shape[1]}")
        return cls(holders, fmt, quantization != "w4a16", shape)

    def _buffers(self, device: torch.device) -> None:
        rows, inputs = self.shape
        if self.fmt is Int8ChannelWeight:
            self.values = torch.empty(rows, inputs, dtype=torch.float32, device=device)
            return
        if self.fmt in _SUPERBLOCK_CODES:
            self.codes = _SUPERBLOCK_CODES[self.fmt].empty(rows, inputs, device)
            return
        bits, groups = _BITS[self.fmt], inputs // GROUP
        halves = dict(dtype=torch.float16, device=device)
        scales, minimums = torch.empty(rows, groups, **halves), torch.empty(rows, groups, **halves)
        if bits == 4:  # packed as they come from the file (float rows' codes are packed on the way in)
            self.codes = NibbleCodes(torch.empty(rows, inputs // 2, dtype=torch.uint8, device=device), scales, minimums)
        else:
            self.codes = GroupCodes(bits, torch.empty(rows, inputs, dtype=torch.uint8, device=device), scales,
                                    minimums if bits != 8 else None)

    def codes_decoder(self, code_bits: int | None, decode_codes: Decoder | None,
                      decode_superblocks: Decoder | None) -> Decoder | None:
        """Of a source's decoders (TensorSource's fields of these names), the one into codes this format copies
        in as they are (group codes of its bits, or a K-quant's super-blocks); None: its rows come as float32."""
        if self.fmt in _SUPERBLOCK_CODES:
            return decode_superblocks
        if self.fmt is Int4Weight and decode_superblocks is not None:  # int4 mode: a Q4_K's codes under Q4_1's rule
            return lambda fetched, rows: _as_nibble_codes(decode_superblocks(fetched, rows))
        return decode_codes if code_bits == _BITS.get(self.fmt) else None

    def write(self, row: int, piece: torch.Tensor | FileCodes) -> None:
        """Rows [row, row + len(piece)) of the weight: float32 values, or codes of this format's kind."""
        coded = not isinstance(piece, torch.Tensor)
        if self.fmt is not Int8ChannelWeight and not coded:
            piece = _RULES[self.fmt](piece)
            coded = True
        rows = piece.codes if coded else piece
        if self.codes is None and self.values is None:
            self._buffers(rows.device)
        stop = row + rows.shape[0]
        if self.values is not None:
            self.values[row:stop].copy_(piece)
        else:
            if isinstance(self.codes, NibbleCodes) and isinstance(piece, GroupCodes):
                piece = piece.packed()
            if isinstance(piece, (GroupCodes, NibbleCodes)) and piece.bits != 8:
                if piece.minimums is None:
                    self.symmetric_rows.append((row, stop))
            for part in dataclasses.fields(piece):  # codes, scales, ...; a GroupCodes' bits and absent minimums
                value = getattr(piece, part.name)
                if isinstance(value, torch.Tensor):
                    getattr(self.codes, part.name)[row:stop].copy_(value)
        self.rows_left -= rows.shape[0]

    def finish(self) -> None:
        """The holders take the format (their `weight` stays the meta placeholder they were built with)."""
        weight = self.build()
        for holder in self.holders:
            holder.weight_format = weight

    def build(self) -> Any:
        """The format from the rows written (all of them), its buffers released."""
        if self.values is not None:
            weight, _ = Int8ChannelWeight.quantize(self.values)
        else:
            weight = self.fmt.from_codes(self._symmetric_or_checked(self.codes))
            if not self.int8_inputs and self.fmt in (Int4Weight, Int8Weight):  # the others are W4A16 alone
                weight = dataclasses.replace(weight, int8_inputs=False)
        self.codes = self.values = None
        return weight

    def _symmetric_or_checked(self, codes: FileCodes) -> FileCodes:
        """4- or 5-bit codes without minimums where no piece had them; else with them (the symmetric pieces'
        computed now), if every one is finite."""
        if not isinstance(codes, (GroupCodes, NibbleCodes)) or codes.bits == 8:
            return codes
        if sum(stop - start for start, stop in self.symmetric_rows) == self.shape[0]:
            return dataclasses.replace(codes, minimums=None)
        for start, stop in self.symmetric_rows:
            scales = codes.scales[start:stop]
            minimums = symmetric_minimums(scales, codes.bits)
            if bool((minimums.isinf() & scales.isfinite()).any()):
                zero = zero_code(codes.bits)
                raise ModelLoadError(f"a matrix merging Q{codes.bits}_0 shards with others (held with float16 "
                                     f"minimums) has a Q{codes.bits}_0 scale over {65504 // zero}: its minimum "
                                     f"-{zero} * d overflows")
            codes.minimums[start:stop].copy_(minimums)
        return codes


def _as_nibble_codes(codes: FileCodes) -> NibbleCodes | torch.Tensor:
    """A K-quant's super-blocks for Int4Weight: Q4_K's codes under Q4_1's rule (SuperblockCodes.as_nibble_codes),
    else (a scale overflowing float16, a wider K-quant) its values as float32 rows, which write() quantizes."""
    nibble_codes = codes.as_nibble_codes() if type(codes) is SuperblockCodes else None
    return nibble_codes if nibble_codes is not None else codes.dequantized()


@dataclass
class StagedStack:
    """A merged linear whose projections the file stores in different types (ShardBits): consecutive
    projections of one format staged together as a run, each run a StagedLinear of its rows; the Linear takes a
    StackedWeight of the runs' formats once every row is in."""

    linear: Linear
    runs: list[tuple[int, StagedLinear]]  # (first row, the run), first rows first

    @classmethod
    def start(cls, linear: Linear, quantization: str, shards: list[ShardBits]) -> StagedStack | StagedLinear:
        """Its runs; a single StagedLinear where every projection takes the same format anyway. A run's
        projections need not share a type: codes_decoder picks each tensor's way in (its codes where they are
        the format's, else float rows), and a super-block format is only ever chosen for its own K-quant."""
        runs: list[tuple[int, StagedLinear]] = []
        for shard in shards:
            fmt = quantized_format(linear, quantization, shard.code_bits, shard.superblock_bits)
            if runs and runs[-1][1].fmt is fmt:
                last = runs[-1][1]
                last.shape = (last.shape[0] + shard.rows, last.shape[1])
                last.rows_left += shard.rows
            else:
                runs.append((shard.first_row, StagedLinear((), fmt, quantization != "w4a16",
                                                           (shard.rows, linear.in_features))))
        if len(runs) == 1:
            return dataclasses.replace(runs[0][1], holders=(linear,))
        return cls(linear, runs)

    @property
    def rows_left(self) -> int:
        return sum(run.rows_left for _, run in self.runs)

    def run_at(self, row: int) -> tuple[StagedLinear, int]:
        """The run that holds the linear's row `row`, and that row's index in it."""
        first, run = next((first, run) for first, run in reversed(self.runs) if first <= row)
        return run, row - first

    def finish(self) -> None:
        self.linear.weight_format = StackedWeight(tuple(run.build() for _, run in self.runs), self.linear.out_features)


def stage_linears(model: nn.Module, quantization: str, file_code_bits: Mapping[nn.Module, int | None],
                  superblock_bits: Mapping[nn.Module, int] | None = None,
                  shard_bits: Mapping[nn.Module, list[ShardBits]] | None = None
                  ) -> dict[nn.Module, StagedLinear | StagedStack]:
    """A StagedLinear for every Linear and tied LM head of the model (built on meta, its `stored_bits` set
    from the checkpoint's headers), by the module whose `weight` it fills; file_code_bits: by that module,
    the bits of the file's codes that convert as they are (loader/weights.py, file_code_bits); superblock_bits:
    by module, the bits of the K-quant the file stores it all in (file_superblock_bits). An untied embedding
    whose file codes convert is held in them too (its rows looked up there: layers/embedding.py), not in a
    float copy of vocab x hidden; any other keeps its float matrix. shard_bits: the merged linears whose
    projections the file stores in different types (file_shard_bits), staged by runs (StagedStack)."""
    superblock_bits, shard_bits = superblock_bits or {}, shard_bits or {}
    heads = [m for m in model.modules() if isinstance(m, (Linear, TiedLMHead))]
    tied = {id(m.embedding) for m in heads if isinstance(m, TiedLMHead)}
    staged = {}
    for module in heads:
        owner = module.embedding if isinstance(module, TiedLMHead) else module
        if owner in shard_bits:
            staged[owner] = StagedStack.start(module, quantization, shard_bits[owner])
        else:
            staged[owner] = StagedLinear.start(module, quantization, file_code_bits.get(owner),
                                               superblock_bits.get(owner))
    for module in model.modules():
        held = _held_in_file_codes(module, quantization, file_code_bits, superblock_bits)
        if isinstance(module, Embedding) and id(module) not in tied and held:
            staged[module] = StagedLinear.start(module, quantization, file_code_bits.get(module),
                                                superblock_bits.get(module))
    log_kept_at_int8(quantization, [_block_format(s) for s in staged.values()
                                    if isinstance(s, StagedStack) or isinstance(s.holders[0], Linear)
                                    and not s.holders[0].is_lm_head])
    return staged


def _block_format(staged: StagedLinear | StagedStack) -> QuantizedFormat:
    """A block linear's format for log_kept_at_int8: a stack's counts as int8 where one of its runs is."""
    if isinstance(staged, StagedLinear):
        return staged.fmt
    formats = [run.fmt for _, run in staged.runs]
    return Int8Weight if Int8Weight in formats else formats[0]


def _held_in_file_codes(embedding: Embedding, quantization: str, file_code_bits: Mapping[nn.Module, int | None],
                        superblock_bits: Mapping[nn.Module, int]) -> bool:
    """Whether an untied embedding's format takes the file's codes as they are (quantized_format): Q4_0 / Q4_1
    / Q8_0 in every mode, Q4_K and Q6_K in w4a16."""
    in_w4a16 = quantization == "w4a16" and superblock_bits.get(embedding) in (4, 6)
    return file_code_bits.get(embedding) in (4, 8) or in_w4a16
