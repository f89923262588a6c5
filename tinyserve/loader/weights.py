"""Copy checkpoint tensors into a model, strictly: every parameter (and every shard of a merged one)
filled exactly once with the right shape, no tensor left over. Errors name the tensor.

The names and shapes are matched twice: first against the model on the meta device, from the files'
headers alone, so that a checkpoint whose config does not describe its tensors is refused before any
memory is allocated for it (a config is a few bytes of text: one declaring 10^12 parameters beside a
1 MB file would otherwise be allocated before the first tensor is found missing); then each tensor as
it is read and copied."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from tinyserve.layers.linear import Linear, MergedLinear
from tinyserve.layers.quant import GroupCodes, NibbleCodes
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.file_reads import FileReads
from tinyserve.loader.names import to_param_name
from tinyserve.loader.staged_linears import FileCodes, ShardBits, StagedLinear, StagedStack
from tinyserve.parallel.shard import CheckpointSlice
from tinyserve.types import Job

# A checkpoint tensor: its Hugging Face name and a function producing it (lazily, so at most one
# tensor's temporary copy exists at a time). The loaders' producers are TensorSources.
NamedTensor = tuple[str, Callable[[], torch.Tensor]]
Rows = tuple[int, int] | None  # rows [start, stop) of a tensor; None: all of it


# A large tensor loads in blocks of rows of about this many values (8 MiB of float32), each one piece of a
# load in pieces: about as long to read as one of SmolLM2's MLP projections (docs/PERFORMANCE.md, "Several
# models"), where its 28M-value embedding read whole was the longest piece of all.
PIECE_VALUES = 1 << 21


@dataclass(frozen=True)
class TensorSource:
    """A checkpoint tensor not read yet: its shape as it will be produced, from the file's header, and
    how to read it: whole, or (`read_rows`, where the file can) rows [start, stop) of it alone.
    `stored_bits`: the bits per weight of the codes the file stores it in, where the file chose a quantized
    type for it (a GGUF's Q8_0: 8, Q6_K: 6, Q4_K: 4); None for a float tensor, which made no such choice. A
    Linear that receives its weight keeps it (Linear.stored_bits) for `--quantization int4`.
    `fetch` and `decode`, where the source splits a read in two (`read` is then decode(fetch(None), None)):
    fetch(rows) copies the file's bytes of the tensor (rows [start, stop), or None: all), the part a load
    runs on its I/O thread (loader/file_reads.py); decode(fetched, rows) makes the tensor of them
    (dequantizing, reordering), the CPU work, which stays on the step thread with the model's other pieces.
    Without them, `read` and `read_rows` run whole on the I/O thread.
    `code_bits` and `decode_codes`, where the file's codes convert to our group codes without a float
    (a GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: loader/gguf/blocks.py): decode_codes(fetched, rows) -> their codes
    of those bits (blocks.file_codes: Q4_x's as NibbleCodes, the others' as GroupCodes). `decode_superblocks`,
    where the file's codes are a K-quant's super-blocks: decode_superblocks(fetched, rows) -> their codes (Q4_K's
    SuperblockCodes, Q5_K's Int5SuperblockCodes, Q6_K's Int6SuperblockCodes: w4a16's formats). `release`: drops
    the file's pages of the tensor from the process once it is read (GGUFFile.release)."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    read_rows: Callable[[int, int], torch.Tensor] | None = None
    stored_bits: int | None = None
    fetch: Callable[[Rows], Any] | None = None
    decode: Callable[[Any, Rows], torch.Tensor] | None = None
    code_bits: int | None = None
    decode_codes: Callable[[Any, Rows], GroupCodes | NibbleCodes] | None = None
    release: Callable[[], None] | None = None
    decode_superblocks: Callable[[Any, Rows], FileCodes] | None = None

    def __call__(self) -> torch.Tensor:
        return self.read()


def _expected_slots(model: nn.Module) -> dict[tuple[str, int | None], str]:
    """Every (parameter, shard) the checkpoint must provide -> a readable name for errors."""
    slots = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, MergedLinear):
                for shard in range(len(module.output_sizes)):
                    slots[(full, shard)] = f"{full}[shard {shard}]"
            else:
                slots[(full, None)] = full
    return slots


@dataclass(frozen=True)
class Match:
    """A checkpoint tensor and where it goes: the parameter (or the shard of one) it fills, the part of it
    this rank holds (tensor parallel; None: all), and the Linear whose weight that is, if any."""

    hf_name: str
    produce: Callable[[], torch.Tensor]
    target: torch.Tensor
    part: CheckpointSlice | None
    linear: Linear | None
    linear_row: int = 0  # the first row of the Linear's weight that target is (a merged one's shard: its offset)
    owner: nn.Module | None = None  # the module whose `weight` target is (a Linear, an Embedding); None: another

    def read(self) -> torch.Tensor:
        return self.checked(self.produce())

    def checked(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor read, its shape checked, narrowed to this rank's part."""
        _check_shape(self.hf_name, tuple(tensor.shape), self.target, self.part)  # the data, whatever the header said
        part = self.part
        return tensor if part is None else tensor.narrow(part.dim, part.start, part.length)


def _target(model: nn.Module, param_name: str,
            shard: int | None) -> tuple[torch.Tensor, CheckpointSlice | None, nn.Module, str, int]:
    module_name, _, attr = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, attr)
    part = module.checkpoint_slice(attr, shard) if hasattr(module, "checkpoint_slice") else None
    if shard is None:
        return param.data, part, module, attr, 0
    start, size = module.shard_offset(shard)
    return param.data.narrow(0, start, size), part, module, attr, start


def _check_shape(hf_name: str, shape: tuple[int, ...], target: torch.Tensor, part: CheckpointSlice | None) -> None:
    expected = list(target.shape)
    if part is not None:  # the checkpoint holds every rank's part
        expected[part.dim] = part.full
    if shape != tuple(expected):
        raise ModelLoadError(f"tensor {hf_name!r} has shape {shape}, expected {tuple(expected)}")


def match_tensors(model: nn.Module, tensors: Iterable[NamedTensor],
                  ignore: Callable[[str], bool] = lambda _: False) -> list[Match]:
    """A Match for every checkpoint tensor not ignored, or the error of the first unexpected, repeated,
    missing or (where its producer knows its shape) misshapen one. Reads no tensor, so it runs on the
    meta device too. A model that is one rank's shard (`model.shard`) skips the tensors of other ranks'
    layers, unread."""
    packed = getattr(model, "packed_modules", {})
    shard = getattr(model, "shard", None)
    missing = _expected_slots(model)
    matched = []
    for hf_name, produce in tensors:
        if ignore(hf_name):
            continue
        param_name, index = to_param_name(hf_name, packed)
        if shard is not None and not shard.holds_param(param_name):
            continue
        if (param_name, index) not in missing:
            seen = "loaded twice" if param_name in dict(model.named_parameters()) else "unexpected"
            raise ModelLoadError(f"tensor {hf_name!r} is {seen} for {type(model).__name__}")
        target, part, module, attr, linear_row = _target(model, param_name, index)
        owner = module if attr == "weight" else None
        linear = owner if isinstance(owner, Linear) else None
        if isinstance(produce, TensorSource):
            _check_shape(hf_name, produce.shape, target, part)
        del missing[(param_name, index)]
        matched.append(Match(hf_name, produce, target, part, linear, linear_row, owner))
    if missing:
        names = sorted(missing.values())
        more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        raise ModelLoadError(f"checkpoint is missing tensor(s): {', '.join(names[:5])}{more}")
    return matched


def note_stored_bits(matches: list[Match]) -> None:
    """A Linear's `stored_bits` becomes the most its weight's tensors (the shards of a merged one) are
    stored at (TensorSource.stored_bits)."""
    for match in matches:
        produce, linear = match.produce, match.linear
        if linear is not None and isinstance(produce, TensorSource) and produce.stored_bits is not None:
            linear.stored_bits = max(produce.stored_bits, linear.stored_bits or 0)


def file_code_bits(matches: list[Match]) -> dict[nn.Module, int | None]:
    """By the module whose `weight` the matches fill: the bits of the file's codes that convert to ours as they
    are (TensorSource.code_bits), where every tensor of it has the same (each read whole for this rank); else
    None."""
    return _by_owner(matches, lambda source: source.code_bits)


def file_superblock_bits(matches: list[Match]) -> dict[nn.Module, int]:
    """The modules whose `weight` the file stores all in super-blocks of one K-quant type that converts to a
    format's codes (TensorSource.decode_superblocks), each tensor read whole for this rank -> its bits (Q4_K: 4,
    Q5_K: 5, Q6_K: 6)."""
    held = _by_owner(matches, _superblock_bits)
    return {owner: bits for owner, bits in held.items() if bits is not None}


def file_shard_bits(matches: list[Match]) -> dict[nn.Module, list[ShardBits]]:
    """The merged linears whose projections the file stores in different types (each read whole for this rank)
    -> each projection's ShardBits, first rows first (loader/staged_linears.py holds each run in its format)."""
    shards: dict[nn.Module, list[ShardBits]] = {}
    partial = set()  # merged linears with a shard not read whole here (tensor parallel) or not from a file
    for match in matches:
        source = match.produce if isinstance(match.produce, TensorSource) else None
        if match.owner is None or not isinstance(match.linear, MergedLinear):
            continue
        if source is None or match.part is not None:
            partial.add(match.owner)
            continue
        shards.setdefault(match.owner, []).append(
            ShardBits(match.linear_row, match.target.shape[0], source.code_bits, _superblock_bits(source)))
    return {owner: sorted(bits, key=lambda b: b.first_row) for owner, bits in shards.items()
            if owner not in partial and len({(b.code_bits, b.superblock_bits) for b in bits}) > 1}


def _superblock_bits(source: TensorSource) -> int | None:
    """The bits of the K-quant a source's tensor is stored in where its super-blocks convert to a format's codes."""
    return source.stored_bits if source.decode_superblocks is not None else None


def _by_owner(matches: list[Match], key: Callable[[TensorSource], Any]) -> dict[nn.Module, Any]:
    """By the module whose `weight` the matches fill: key(source) where every tensor of it (each read whole for
    this rank) has the same; else None."""
    values: dict[nn.Module, set] = {}
    for match in matches:
        if match.owner is not None:
            value = key(match.produce) if isinstance(match.produce, TensorSource) else None
            values.setdefault(match.owner, set()).add(value if match.part is None else None)
    return {owner: next(iter(v)) if len(v) == 1 else None for owner, v in values.items()}


def load_weights_in_pieces(model: nn.Module, tensors: Iterable[NamedTensor],
                           ignore: Callable[[str], bool] = lambda _: False,
                           reads: FileReads | None = None,
                           staged: Mapping[nn.Module, StagedLinear | StagedStack] | None = None) -> Job[None]:
    """Fill `model` (already materialized on its device and dtype) from checkpoint tensors, yielding after
    each tensor, or after each block of PIECE_VALUES of a larger one that its source can read by rows (a
    rank's rows of a tensor-parallel one alone). Linears' `stored_bits` are noted (note_stored_bits).
    `reads`: the load's I/O thread, where every tensor is read (loader/file_reads.py), the copy into the
    model alone done here; None: read here. `staged`: the matrices loaded straight into their quantized
    formats (loader/staged_linears.py; a StagedStack: a merged linear's runs of rows, each in its format), by the
    module whose `weight` stays on meta; each finished once its rows are in."""
    matches = match_tensors(model, tensors, ignore)
    note_stored_bits(matches)
    staged = staged or {}
    for match in matches:
        source = match.produce if isinstance(match.produce, TensorSource) else None
        staging = staged.get(match.owner) if match.owner is not None else None
        run, first_row = staging, match.linear_row  # where this tensor's rows go (a stack's run: its own rows)
        if isinstance(staging, StagedStack):
            run, first_row = staging.run_at(match.linear_row)
        as_codes = None
        if run is not None and source is not None and match.part is None:
            as_codes = run.codes_decoder(source.code_bits, source.decode_codes, source.decode_superblocks)
        for fetch, finish, rows in _pieces(match, as_codes):
            if reads is None:
                fetched = fetch()
            else:
                fetched = yield from reads.read(fetch, f"tensor {match.hf_name!r}")
            piece = finish(fetched)
            del fetched
            target = match.target if rows is None else match.target[rows[0]:rows[1]]
            _check_piece(match.hf_name, piece, target)
            if staging is None:
                target.copy_(piece)
            else:
                run.write(first_row + (0 if rows is None else rows[0]), piece)
            del piece
            yield
        if source is not None and source.release is not None:
            source.release()
        if staging is not None and staging.rows_left == 0:
            staging.finish()
            yield


def _pieces(match: Match, as_codes: Callable[[Any, Rows], Any] | None = None,
            ) -> Iterator[tuple[Callable[[], Any], Callable[[Any], Any], Rows]]:
    """(the read for the I/O thread, what makes the tensor of its result here, the rows [start, stop) of the
    target they fill, None: all of it): for the whole tensor, or for each block of PIECE_VALUES values of it.
    as_codes: the source's decoder into a format's codes (StagedLinear.codes_decoder; a whole rank's tensor),
    which makes the pieces; None: its float values."""
    produce, target, part = match.produce, match.target, match.part
    source = produce if isinstance(produce, TensorSource) else None
    split = source is not None and source.fetch is not None and source.decode is not None
    decode = as_codes or (source.decode if source is not None else None)
    read_rows = source.read_rows if source is not None else None
    by_rows = read_rows is not None and target.dim() >= 2 and (part is None or part.dim == 0)
    if not by_rows or (part is None and target.numel() <= PIECE_VALUES):
        if as_codes is not None:
            yield partial(source.fetch, None), partial(_decode_rows, decode, None), None
        elif split:
            yield partial(source.fetch, None), lambda fetched: match.checked(source.decode(fetched, None)), None
        else:
            yield produce, match.checked, None
        return
    first_row = 0 if part is None else part.start
    num_rows = target.shape[0]
    rows_per_piece = max(1, PIECE_VALUES * num_rows // target.numel())
    for start in range(0, num_rows, rows_per_piece):
        rows = (first_row + start, first_row + min(start + rows_per_piece, num_rows))
        piece = (start, rows[1] - first_row)
        if split:
            yield partial(source.fetch, rows), partial(_decode_rows, decode, rows), piece
        else:
            yield partial(read_rows, *rows), _as_is, piece


def _decode_rows(decode: Callable[[Any, Rows], torch.Tensor], rows: Rows, fetched: Any) -> torch.Tensor:
    return decode(fetched, rows)


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _check_piece(hf_name: str, piece: torch.Tensor | FileCodes, target: torch.Tensor) -> None:
    """A tensor (or codes) read against the part of the model it fills: the data, whatever the header said."""
    shape = tuple(piece.shape)
    if shape != tuple(target.shape):
        raise ModelLoadError(f"tensor {hf_name!r} has shape {shape}, expected {tuple(target.shape)}")
