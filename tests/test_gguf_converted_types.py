"""GGUF types that none of our formats holds as they are (Q2_K, Q3_K, IQ4_NL, ...: loader/gguf/checkpoint.py's
_CONVERTED_TYPE_BITS) load through a conversion: their values come from the gguf library's dequantization,
the float path takes them as they are, a quantized mode quantizes them again by its format's rule (int4 per
32), and the load says so, per type, with the file's bytes. A type we cannot read is refused before any
tensor is read, naming the tensor and its type."""

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import write_random_llama
from test_gguf_quant_mix import _build, _formats, assert_logits_match_the_formats_values

from tinyserve.layers import ops
from tinyserve.layers.quant import Int4Weight, Int8Weight
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf

# each type -> the byte offsets of its float16 scale fields (random bytes there could be inf or NaN)
SCALE_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_NL: (0,)}
_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# layer 0 in Q3_K but its MLP in Q2_K, layer 1 in IQ4_NL but its attention output in Q4_0; the head at Q8_0
MIX = {f"blk.{layer}.{part}.weight": (Q.Q3_K, Q.IQ4_NL)[layer] for layer in (0, 1) for part in _PARTS} | {
    "blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.Q2_K, "blk.0.ffn_down.weight": Q.Q2_K,
    "blk.1.attn_output.weight": Q.Q4_0, "output.weight": Q.Q8_0, "token_embd.weight": Q.Q3_K}


def _quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The converted types as random blocks (codes and scales; float16 scales of 1e-4 to 3e-4: weights within
    ~0.05); the rest gguf-py's."""
    if qtype not in SCALE_FIELDS:
        return gguf.quants.quantize(w, qtype)
    rows, cols = w.shape
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(rows * cols + int(qtype))
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    for at in SCALE_FIELDS[qtype]:
        scales = rng.uniform(1e-4, 3e-4, len(blocks)).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("converted") / "mixed.gguf", MIX, _quantize)


def test_the_float_path_reads_the_gguf_library_s_values(mixed_path):
    reader = open_gguf(mixed_path)
    tensors = {t.name: t for t in reader.tensors}
    sources = dict(gguf_tensors(reader, gguf_model_config(reader)))
    for gguf_name, hf_name in (("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight"),
                               ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
                               ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")):
        tensor = tensors[gguf_name]
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tensor.shape)
        assert np.isfinite(expected).all() and np.abs(expected).max() > 0
        assert torch.equal(sources[hf_name](), torch.from_numpy(expected))


def test_the_load_names_each_converted_type_with_its_bytes(mixed_path, caplog):
    reader = open_gguf(mixed_path)
    with caplog.at_level(logging.WARNING, logger="tinyserve.loader.gguf.checkpoint"):
        list(gguf_tensors(reader, gguf_model_config(reader)))
    lines = [r.getMessage() for r in caplog.records if "no format of their own" in r.getMessage()]
    assert len(lines) == 1
    for qtype in (Q.Q3_K, Q.Q2_K, Q.IQ4_NL):
        tensors = [t for t in reader.tensors if t.tensor_type == qtype]
        mib = sum(t.data.nbytes for t in tensors) / (1 << 20)
        assert f"{qtype.name} ({len(tensors)} tensors, {mib:.0f} MiB in the file)" in lines[0]
    assert "Q4_0" not in lines[0] and "Q8_0" not in lines[0]


@pytest.mark.skipif(not ops.has_cpu_kernels(), reason="our C++ kernels are not built")
def test_w4a16_quantizes_them_again_by_int4_s_rule(mixed_path):
    """Every block linear is int4 (the converted types by the rule, the Q4_0 shard from its codes); the Q8_0
    head keeps its codes; the logits are those of float32 on the file's values set to each format's."""
    model = _build(mixed_path, dtype=torch.float32, quantization="w4a16")
    formats = _formats(model)
    assert formats.pop("lm_head") is Int8Weight
    assert set(formats.values()) == {Int4Weight}
    formats["lm_head"] = Int8Weight
    taken = {Int4Weight: {Q.Q4_0, Q.Q4_1}, Int8Weight: {Q.Q8_0}}
    assert_logits_match_the_formats_values(model, mixed_path, formats, taken, 1e-5, a16=True)


def test_a_type_we_cannot_read_is_refused_before_any_tensor_is_read(tmp_path):
    path = tmp_path / "i32.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 32), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(path)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.ffn_up.weight' has type I32, which tinyserve does "
                                             r"not read \(supported: F32, "):
        next(iter(gguf_tensors(reader, None)))
