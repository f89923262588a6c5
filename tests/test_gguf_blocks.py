"""A GGUF's Q4_0 / Q4_1 / Q8_0 blocks straight into our group codes (loader/gguf/blocks.py) and a quantized
model loaded through them one Linear at a time (loader/staged_linears.py): the codes stand for exactly the
file's values (the references follow ggml's block layouts: tests/test_gguf_dequant.py), the kernels compute
with them, the formats hold the file's bytes, and the file's pages leave the process once read."""

import dataclasses
import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import _write, tiny_llama  # noqa: F401 (tiny_llama: a fixture)
from test_gguf_dequant import REFERENCES, random_blocks
from test_gguf_quant_mix import a16_inputs

from tinyserve.layers import ops
from tinyserve.layers.linear import Linear
from tinyserve.layers.quant import Int4Weight, Int8Weight, NibbleCodes
from tinyserve.loader import staged_linears
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader.gguf.blocks import _nibble_codes_in_torch, file_codes, group_codes
from tinyserve.loader.model_loader import build_model

ROWS, COLS = 5, 96  # odd rows, three blocks a row
FORMATS = {Q.Q4_0: Int4Weight, Q.Q4_1: Int4Weight, Q.Q8_0: Int8Weight}
needs_int_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="our C++ kernels are not built")


def _blocks(qtype, seed=0) -> np.ndarray:
    """[ROWS, bytes per row] of random codes and finite scales of either sign; Q8_0 codes include -128."""
    blocks = random_blocks(qtype, ROWS * COLS, np.random.default_rng(seed))
    if qtype == Q.Q8_0:
        blocks[0, 2] = 0x80  # -128: outside llama.cpp's quantizer's range, still a valid code
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_group_codes_stand_for_the_file_s_values_exactly(qtype):
    blocks = _blocks(qtype)
    codes = group_codes(qtype, blocks)
    expected = torch.from_numpy(REFERENCES[qtype](blocks.reshape(-1, blocks.shape[1] // (COLS // 32))))
    assert codes.bits == (8 if qtype == Q.Q8_0 else 4)
    assert (codes.minimums is None) == (qtype != Q.Q4_1)  # Q4_0 and Q8_0: w = (q - zero_code) * d
    assert torch.equal(codes.dequantized(), expected.reshape(ROWS, COLS).float())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_nibble_codes_are_the_group_codes_packed_as_the_kernels_read_them(qtype):
    """The loader's way in for Q4_x (file_codes: packed in word operations) against the codes a byte each packed
    by Int4Weight's own rule (GroupCodes.packed), and the same Int4Weight from either."""
    blocks = _blocks(qtype, seed=2)
    nibbles, codes = file_codes(qtype, blocks), group_codes(qtype, blocks)
    assert isinstance(nibbles, NibbleCodes) and nibbles.shape == codes.shape == (ROWS, COLS)
    assert torch.equal(nibbles.codes, codes.packed().codes) and torch.equal(nibbles.unpacked().codes, codes.codes)
    assert torch.equal(nibbles.dequantized(), codes.dequantized())
    a, b = Int4Weight.from_codes(nibbles), Int4Weight.from_codes(codes)
    assert all(torch.equal(x, y) for x, y in ((a.codes, b.codes), (a.scales, b.scales)))
    assert (a.minimums is None) == (b.minimums is None) == (qtype == Q.Q4_0)


@needs_int_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, ROWS])
def test_the_c_plus_plus_nibble_pass_gives_the_torch_ops_bytes(qtype, rows):
    """nibble_codes' one C++ pass (csrc/gguf_nibbles.cpp, where the kernels are built) against its torch ops:
    the same codes, scales and minimums, bit for bit."""
    blocks = _blocks(qtype, seed=4)[:rows]
    fast, torch_ops = file_codes(qtype, blocks), _nibble_codes_in_torch(qtype, blocks)
    assert fast.codes.shape == (rows, COLS // 2) and torch.equal(fast.codes, torch_ops.codes)
    assert torch.equal(fast.scales.view(torch.int16), torch_ops.scales.view(torch.int16))
    if qtype == Q.Q4_0:
        assert fast.minimums is None and torch_ops.minimums is None
    else:
        assert torch.equal(fast.minimums.view(torch.int16), torch_ops.minimums.view(torch.int16))


@needs_int_kernels
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_the_kernels_compute_with_the_file_s_values(qtype):
    """w4a16 / w8a16 at float32 on the converted codes against float64 on the file's values and x as the kernel
    reads it (w8a16 as it is; w4a16: a16_inputs)."""
    from tinyserve.layers.kernels.cpu_kernels import w4a16_matmul, w8a16_matmul

    blocks = _blocks(qtype, seed=1)
    weight = FORMATS[qtype].from_codes(group_codes(qtype, blocks))
    values = torch.from_numpy(REFERENCES[qtype](blocks.reshape(ROWS * COLS // 32, -1))).reshape(ROWS, COLS)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(0))
    if qtype == Q.Q8_0:
        got, read = w8a16_matmul(x, weight.codes, weight.scales, ROWS), x
    else:
        got, read = w4a16_matmul(x, weight.codes, weight.scales, weight.minimums, ROWS), a16_inputs(x)
    exact = read.double() @ values.T
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def _int4_products(weight: Int4Weight, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x times the weight in both int4 kernels: int8-rounded activations (int4 mode) and unrounded (w4a16)."""
    return {name: ops.linear(x, dataclasses.replace(weight, int8_inputs=int8_inputs))
            for name, int8_inputs in (("int4", True), ("w4a16", False))}


@needs_int_kernels
def test_q4_0_computes_the_gguf_library_s_values_and_the_bits_it_did_with_stored_minimums():
    """Against float64 on gguf-py's dequantization (tolerances: the w4a16 one above, int4's rounded activations
    tests/test_quant.py's), and bit for bit what the same codes gave held with the minimum -8 * d."""
    blocks = _blocks(Q.Q4_0, seed=2)
    codes = group_codes(Q.Q4_0, blocks)
    values = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q4_0)).double()
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ values.T
    got = _int4_products(Int4Weight.from_codes(codes), x)
    read = a16_inputs(x).double() @ values.T
    assert (got["w4a16"].double() - read).abs().max() <= 1e-5 * read.abs().max()
    assert (got["int4"].double() - exact).abs().max() <= 0.03 * exact.abs().max()
    with_minimums = _int4_products(Int4Weight.from_codes(codes.with_minimums()), x)
    assert all(torch.equal(got[name], with_minimums[name]) for name in got)


@needs_int_kernels
def test_a_q4_0_scale_over_8188_loads():
    """-8 * d has no float16 for |d| over 8188: refused while the loader stored it as a minimum; now the kernels
    compute it in float32, and the file's values come out as they are."""
    blocks = _blocks(Q.Q4_0)
    blocks[1, 0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)
    codes = group_codes(Q.Q4_0, blocks)
    values = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q4_0))
    assert codes.minimums is None and torch.equal(codes.dequantized(), values)
    weight = Int4Weight.from_codes(codes)
    assert torch.equal(weight.rows(torch.arange(ROWS)), values)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(3))
    for name, got in _int4_products(weight, x).items():
        exact = (a16_inputs(x) if name == "w4a16" else x).double() @ values.double().T
        tolerance = 1e-5 if name == "w4a16" else 0.03
        assert torch.isfinite(got).all() and (got.double() - exact).abs().max() <= tolerance * exact.abs().max()


def _staged_int4(pieces) -> Int4Weight:
    """An Int4Weight staged from group codes by blocks of rows (loader/staged_linears.py), as a merged linear's
    shards arrive."""
    holder, row = torch.nn.Module(), 0
    staged = staged_linears.StagedLinear((holder,), Int4Weight, True, (sum(p.shape[0] for p in pieces), COLS))
    for piece in pieces:
        staged.write(row, piece)
        row += piece.shape[0]
    staged.finish()
    return holder.weight_format


def test_a_matrix_merging_q4_0_and_q4_1_shards_holds_minimums_and_the_file_s_values():
    """A Q4_0 shard beside a Q4_1 one: the weight holds minimums, the Q4_0 rows' -8 * d; all Q4_0: none. A
    Q4_0 scale whose -8 * d float16 cannot hold is refused in such a merge, not held as inf."""
    q4_0, q4_1 = group_codes(Q.Q4_0, _blocks(Q.Q4_0, 4)), group_codes(Q.Q4_1, _blocks(Q.Q4_1, 5))
    values = torch.cat([q4_0.dequantized(), q4_1.dequantized()])
    merged = _staged_int4([q4_0, q4_1])
    assert merged.minimums is not None and torch.equal(merged.rows(torch.arange(2 * ROWS)), values)
    assert _staged_int4([q4_0, q4_0]).minimums is None
    big = _blocks(Q.Q4_0, 4)
    big[1, 0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)
    with pytest.raises(ModelLoadError, match="Q4_0 scale over 8188"):
        _staged_int4([q4_1, group_codes(Q.Q4_0, big)])


def _load(path, quantization="w4a16", dtype=torch.float32):
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    return build_model(config, gguf_tensors(reader, config), dtype, torch.device("cpu"), quantization=quantization)


@needs_int_kernels
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_a_quantized_model_holds_its_file_s_bytes_and_no_float_linear(tmp_path, tiny_llama, qtype):
    """Every Linear's weight stays the meta placeholder; the block linears' formats hold as many bytes as the
    file's blocks of them: the same layout's bytes (Q4_0: 18 a block of 32, its scale and codes, no minimums)."""
    path = _write(tmp_path / "model.gguf", tiny_llama, qtype=qtype)
    model = _load(path)
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name.startswith("model.layers")]
    assert linears and all(m.weight.is_meta for m in linears)
    held = sum(t.nbytes for m in linears for t in (m.weight_format.codes, m.weight_format.scales,
                                                    getattr(m.weight_format, "minimums", None)) if t is not None)
    stored = sum(t.data.nbytes for t in open_gguf(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    assert held == stored
    assert all((getattr(m.weight_format, "minimums", None) is None) == (qtype != Q.Q4_1) for m in linears)


@needs_int_kernels
def test_linears_are_staged_one_at_a_time(tmp_path, tiny_llama, monkeypatch):
    """A quantized load holds at most the buffers of the Linears whose tensors are being read (a merged one's
    shards may lie apart in the file), never all of them."""
    path = _write(tmp_path / "model.gguf", tiny_llama, qtype=Q.Q4_0)
    live, most = set(), [0]
    start_buffers, finish = staged_linears.StagedLinear._buffers, staged_linears.StagedLinear.finish

    def buffers(self, device):
        live.add(id(self))
        most[0] = max(most[0], len(live))
        start_buffers(self, device)

    def finished(self):
        live.discard(id(self))
        finish(self)

    monkeypatch.setattr(staged_linears.StagedLinear, "_buffers", buffers)
    monkeypatch.setattr(staged_linears.StagedLinear, "finish", finished)
    model = _load(path)
    num_linears = sum(isinstance(m, Linear) for m in model.modules())
    assert not live and num_linears == 9 and 1 <= most[0] <= 2


def _mapping_rss_kib(path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@needs_int_kernels
def test_a_tensor_s_pages_leave_the_process_once_read(tmp_path, tiny_llama):
    path = _write(tmp_path / "model.gguf", tiny_llama, qtype=Q.Q8_0)
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    sources = [source for _, source in gguf_tensors(reader, config)]
    for source in sources:
        source.fetch(None)
    read_all = _mapping_rss_kib(path)
    for source in sources:
        source.release()
    assert read_all >= path.stat().st_size // 1024 // 2  # the data was mapped in by the reads
    page_kib = 4
    # what is left: the pages a tensor shares with its neighbours (at most 2 each), and the header's
    assert _mapping_rss_kib(path) <= page_kib * (2 * len(sources) + 2) < read_all


@needs_int_kernels
def test_a_tied_head_keeps_its_file_s_4_bit_codes_and_the_embedding_looks_up_in_them(tmp_path, tiny_llama):
    """Q4_0 token_embd, no output.weight (tied): the head is int4 from the file's codes, the embedding reads
    its rows from the same codes (no float copy of the matrix), each row the file's values exactly."""
    path = _write(tmp_path / "tied.gguf", tiny_llama, qtype=Q.Q4_0, drop=("output.weight",))
    model = _load(path)
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head.weight_format, Int4Weight) and embedding.weight_format is head.weight_format
    assert embedding.weight.is_meta
    [blocks] = [t.data for t in open_gguf(path).tensors if t.name == "token_embd.weight"]
    values = torch.from_numpy(REFERENCES[Q.Q4_0](blocks.reshape(-1, 18))).reshape(blocks.shape[0], -1).float()
    ids = torch.tensor([0, 17, 255, 3])
    assert torch.equal(embedding(ids), values[ids])


@needs_int_kernels
@pytest.mark.parametrize("qtype, fmt", [(Q.Q4_0, Int4Weight), (Q.Q8_0, Int8Weight)], ids=["Q4_0", "Q8_0"])
def test_an_untied_embedding_is_held_in_its_file_s_codes(tmp_path, tiny_llama, qtype, fmt):
    """An untied embedding whose file codes convert is looked up in them (no float copy of vocab x hidden),
    each row the file's values exactly; a float one keeps its float matrix."""
    path = _write(tmp_path / "untied.gguf", tiny_llama, qtype=qtype)
    embedding = _load(path).model.embed_tokens
    assert isinstance(embedding.weight_format, fmt) and embedding.weight.is_meta
    [blocks] = [t.data for t in open_gguf(path).tensors if t.name == "token_embd.weight"]
    block_bytes = 18 if qtype == Q.Q4_0 else 34
    values = torch.from_numpy(REFERENCES[qtype](blocks.reshape(-1, block_bytes))).reshape(blocks.shape[0], -1).float()
    ids = torch.tensor([0, 17, 255, 3])
    assert torch.equal(embedding(ids), values[ids])
    float_file = _write(tmp_path / "f32.gguf", tiny_llama)
    assert type(_load(float_file, quantization="w4a16").model.embed_tokens.weight_format).__name__ == "DenseWeight"
