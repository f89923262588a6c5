"""A GGUF file's metadata and tensor table, read in one pass of plain Python over the mapped file; the
tensors' bytes stay in the mapping (numpy views, read when a tensor is dequantized).

Why not `gguf.GGUFReader`: it builds numpy views for every item of every array, which for SmolLM2's
49,152-token vocabulary and 48,900 merges is seconds of Python in one call (docs/PERFORMANCE.md,
"Several models"). A model loads on the step thread in pieces, between other models' steps
(engine/loop/step_loop.py), and no step can run inside one call; this reads the same header in well under a
second. The `gguf` library still names the types and dequantizes (`gguf.quants`).

Little-endian files of GGUF versions 2 and 3, what llama.cpp writes. Every count and length is checked
against the bytes left before it is used, so a forged header is an error, not a huge loop or allocation.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 4  # arrays of arrays: llama.cpp writes none; a forged file must not recurse without end
# scalar value types -> their struct (and numpy) code, little-endian
_SCALAR_CODES = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# tensor types stored as plain numbers (in numpy's dtype and the tensor's shape); the others are blocks of bytes
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch's order, rows first (the file lists dimensions fastest first)
    # a read-only view of the mapped file: plain types in their dtype and `shape`, quantized ones as uint8
    # [*shape[:-1], bytes per row] (gguf.quants.dequantize's input)
    data: np.ndarray
    offset: int  # of its first byte in the file


class GGUFFile:
    """`metadata`: key -> value (str, int, float, bool, or a list of them); `tensors` in file order.
    Raises ValueError (or struct.error) for a file that is not a well-formed GGUF."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._bytes(4) != _MAGIC:
            raise ValueError("no GGUF magic")
        version = self._u32()
        if version not in _VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            endian = " (a big-endian file: not supported)" if swapped in _VERSIONS else ""
            raise ValueError(f"GGUF version {version} is not supported{endian}")
        num_tensors, num_fields = self._u64(), self._u64()
        self.metadata: dict[str, Any] = {}
        for _ in range(self._count(num_fields, 13)):  # a key of length 0, a type, a 1-byte value
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.metadata[key] = self._value(self._u32(), 0)
        infos = [self._tensor_info() for _ in range(self._count(num_tensors, 32))]  # a name, 1 dimension, type, offset
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        file_bytes = np.frombuffer(self._buf, dtype=np.uint8)
        self.tensors = [self._tensor(info, file_bytes, data_start) for info in infos]
        names = {t.name for t in self.tensors}
        if len(names) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the mapping's pages of the tensor from this process (madvise DONTNEED; they stay in the page
        cache): a loaded tensor's bytes, read once, then count in no resident memory. The pages it shares
        with its neighbours stay. A later read of the tensor maps them again."""
        first = -(-tensor.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (tensor.offset + tensor.data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._buf.madvise(mmap.MADV_DONTNEED, first, last - first)

    # the cursor over the header

    def _bytes(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError(f"the file ends inside its header (at byte {len(self._buf)})")
        data, self._pos = self._buf[self._pos:end], end
        return data

    def _u32(self) -> int:
        (value,) = _U32.unpack_from(self._buf, self._pos)
        self._pos += 4
        return value

    def _u64(self) -> int:
        (value,) = _U64.unpack_from(self._buf, self._pos)
        self._pos += 8
        return value

    def _count(self, count: int, min_item_bytes: int) -> int:
        if count * min_item_bytes > len(self._buf) - self._pos:
            raise ValueError(f"a count of {count} items does not fit in the file")
        return count

    def _string(self) -> str:
        return self._bytes(self._u64()).decode("utf-8")

    def _value(self, value_type: int, depth: int) -> Any:
        kind = GGUFValueType(value_type)
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            return self._array(self._u32(), self._u64(), depth + 1)
        code = _SCALAR_CODES[kind]
        (value,) = struct.unpack_from("<" + code, self._buf, self._pos)
        self._pos += struct.calcsize(code)
        return value

    def _array(self, item_type: int, count: int, depth: int) -> list:
        kind = GGUFValueType(item_type)
        if kind == GGUFValueType.STRING:
            return self._strings(self._count(count, 8))
        if kind == GGUFValueType.ARRAY:
            if depth >= _MAX_NESTING:
                raise ValueError("metadata arrays nested too deep")
            return [self._value(item_type, depth) for _ in range(self._count(count, 12))]
        dtype = np.dtype("<" + _SCALAR_CODES[kind])
        values = np.frombuffer(self._buf, dtype=dtype, count=self._count(count, dtype.itemsize), offset=self._pos)
        self._pos += count * dtype.itemsize
        return values.tolist()

    def _strings(self, count: int) -> list[str]:
        """The hot loop of a vocabulary (tens of thousands of tokens and merges): locals only."""
        buf, pos, end, unpack = self._buf, self._pos, len(self._buf), _U64.unpack_from
        strings = []
        for _ in range(count):
            (length,) = unpack(buf, pos)
            start, pos = pos + 8, pos + 8 + length
            if pos > end:
                raise ValueError(f"the file ends inside its header (at byte {end})")
            strings.append(buf[start:pos].decode("utf-8"))
        self._pos = pos
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        num_dims = self._u32()
        if not 1 <= num_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {num_dims} dimensions")
        dims = [self._u64() for _ in range(num_dims)]
        tensor_type = GGMLQuantizationType(self._u32())
        return name, tuple(reversed(dims)), tensor_type, self._u64()

    def _tensor(self, info, file_bytes: np.ndarray, data_start: int) -> GGUFTensor:
        name, shape, tensor_type, offset = info
        block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
        if shape[-1] % block_size:
            raise ValueError(f"tensor {name!r}: rows of {shape[-1]} values are not whole blocks of {block_size}")
        row_bytes = shape[-1] // block_size * block_bytes
        num_bytes = math.prod(shape[:-1]) * row_bytes  # Python ints: forged dimensions cannot overflow
        start = data_start + offset
        if start + num_bytes > len(file_bytes):
            raise ValueError(f"tensor {name!r}'s data lies outside the file")
        data = file_bytes[start:start + num_bytes]
        plain = _PLAIN_DTYPES.get(tensor_type)
        data = data.view(plain).reshape(shape) if plain is not None else data.reshape(*shape[:-1], row_bytes)
        return GGUFTensor(name, tensor_type, shape, data, start)
