"""loader/gguf/file_format.py: our GGUF header reader against the `gguf` library's GGUFReader (the oracle) on the
default model's file and on a hand-made file with every value type; forged headers fail fast."""

import struct

import gguf
import numpy as np
import pytest

from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.checkpoint import open_gguf
from tinyserve.loader.gguf.file_format import GGUFFile


def _library_view(path) -> tuple[dict, list]:
    reader = gguf.GGUFReader(path)
    metadata = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [(t.name, t.tensor_type, tuple(reversed(t.shape.tolist())), np.asarray(t.data)) for t in reader.tensors]
    return metadata, tensors


def _assert_same_as_library(path) -> None:
    metadata, tensors = _library_view(path)
    ours = GGUFFile(path)
    assert ours.metadata == metadata
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [t[:3] for t in tensors]
    for t, (name, _, _, data) in zip(ours.tensors, tensors):
        assert t.data.shape == data.shape and t.data.dtype == data.dtype and np.array_equal(t.data, data), name


def test_the_default_model_reads_as_the_library_reads_it(smollm2_path):
    _assert_same_as_library(smollm2_path)


def test_every_value_type_reads_as_the_library_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200); writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000); writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000); writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5); writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.95); writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.yes", True); writer.add_bool("t.no", False)
    writer.add_string("t.text", "ünïcode ✓"); writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3]); writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strings", ["a", "", "ß c"]); writer.add_array("t.none", [])
    writer.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("half", np.arange(64, dtype=np.float16).reshape(2, 32))
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("q8", gguf.quants.quantize(values, q8_0), raw_dtype=q8_0)
    writer.add_tensor("vector", np.ones(7, dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    _assert_same_as_library(path)
    ours = GGUFFile(path)
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["t.strings"] == ["a", "", "ß c"]
    assert {t.name: t.shape for t in ours.tensors} == {"plain": (3, 4), "half": (2, 32), "q8": (4, 64), "vector": (7,)}


def _header(num_tensors: int, fields: bytes, num_fields: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_fields) + fields


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("data, message", [
    (b"GGML" + bytes(60), "no GGUF magic"),
    (_header(0, b"", 0, version=1), "version 1 is not supported"),
    (_header(0, b"", 0, version=3 << 24), "big-endian"),
    # a string array claiming 2**40 items in a few bytes: refused before any loop
    (_header(0, _string("k") + struct.pack("<IIQ", 9, 8, 1 << 40) + bytes(16), 1), "does not fit"),
    (_header(0, _string("k") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 50), 1), "ends inside its header"),
    (_header(0, (_string("k") + struct.pack("<II", 4, 1)) * 2, 2), "appears twice"),
    (_header(0, _string("general.alignment") + struct.pack("<II", 4, 24), 1), "power of two"),
    # one F32 tensor of 2**20 x 2**20 values in a file of a few bytes
    (_header(1, _string("w") + struct.pack("<IQQIQ", 2, 1 << 20, 1 << 20, 0, 0), 0), "outside the file"),
    (_header(1, _string("w") + struct.pack("<IQIQ", 1, 33, 8, 0), 0), "not whole blocks"),  # Q8_0 rows of 33
])
def test_forged_headers_fail_with_the_reason(tmp_path, data, message):
    path = tmp_path / "forged.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=message):
        open_gguf(path)
