"""`--quantization int4` on a GGUF with a K-quant-like mix of tensor types: a linear the file stores at more
than 4 bits (Q5_0, Q5_1, Q8_0; Q5_K, Q6_K) is quantized to int8, one stored at 4 bits (Q4_0, Q4_1, Q4_K) or
in a float type to int4; a merged linear goes to int8 if any shard is stored above 4 bits. A tiny random Llama
written with a chosen type per tensor, loaded in each mode, checked against a table written here."""

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import _gguf_name, _k_quant_bytes, _write, tiny_llama  # tiny_llama: its random HF Llama (a fixture)

from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.layers import ops
from tinyserve.layers.linear import Linear, TiedLMHead
from tinyserve.layers.quant import Int4Weight, Int5Weight, Int8ChannelWeight, Int8Weight
from tinyserve.layers.weight_format import StackedWeight
from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader.model_loader import build_model
from tinyserve.loader.weights import match_tensors


needs_int_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(),
                                       reason="without our C++ kernels int weights stay dense (dequantized)")

# GGUF name -> type, as a Q4_K_M file mixes them (gguf-py cannot quantize to K-quants; their bits are checked
# one tensor at a time below). Layer 0's q and k are 4-bit and its v 8-bit: the merged qkv goes to int8.
MIX = {
    "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1, "blk.0.attn_v.weight": Q.Q8_0,
    "blk.0.attn_output.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q4_1, "blk.0.ffn_up.weight": Q.Q4_0,
    "blk.0.ffn_down.weight": Q.Q5_0,
    "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q4_0, "blk.1.attn_v.weight": Q.Q4_1,
    "blk.1.attn_output.weight": Q.Q8_0, "blk.1.ffn_gate.weight": Q.Q5_1, "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.F16,
    "token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_0,  # the head: its file's Q4_x codes, else int8
}
# our module -> its format under --quantization int4
INT4_MIX_FORMATS = {  # a merged linear of several types: a tuple, its runs' (StackedWeight)
    "model.layers.0.self_attn.qkv_proj": (Int4Weight, Int8Weight), "model.layers.0.self_attn.o_proj": Int4Weight,
    "model.layers.0.mlp.gate_up_proj": Int4Weight, "model.layers.0.mlp.down_proj": Int8Weight,
    "model.layers.1.self_attn.qkv_proj": Int4Weight, "model.layers.1.self_attn.o_proj": Int8Weight,
    "model.layers.1.mlp.gate_up_proj": (Int8Weight, Int4Weight), "model.layers.1.mlp.down_proj": Int4Weight,
    "lm_head": Int4Weight,  # Q4_0 in the file: its own codes (int8 mode: int8)
}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory, tiny_llama):
    return _write(tmp_path_factory.mktemp("mix") / "mixed.gguf", tiny_llama, types=MIX)


def _build(path, dtype=torch.bfloat16, quantization=None):
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    return build_model(config, gguf_tensors(reader, config), dtype, torch.device("cpu"), quantization=quantization)


def _formats(model) -> dict[str, type | tuple[type, ...]]:
    """By module name, its weight format's type; a StackedWeight's as its runs' types."""
    return {name: tuple(type(p) for p in m.weight_format.parts) if isinstance(m.weight_format, StackedWeight)
            else type(m.weight_format) for name, m in model.named_modules() if isinstance(m, (Linear, TiedLMHead))}


def test_each_tensor_carries_the_bits_its_type_stores(mixed_path):
    reader = open_gguf(mixed_path)
    by_name = {t.name: t for t in reader.tensors}
    bits = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.F16: None, Q.F32: None}
    sources = dict(gguf_tensors(reader, gguf_model_config(reader)))
    for hf_name, source in sources.items():
        assert source.stored_bits == bits[by_name[_gguf_name(hf_name)].tensor_type], hf_name


@pytest.mark.parametrize("qtype, bits", [(Q.Q4_K, 4), (Q.Q5_K, 5), (Q.Q6_K, 6)])
def test_k_quant_tensors_carry_their_bits(tmp_path, qtype, bits):
    path = tmp_path / f"k-{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", _k_quant_bytes(qtype, 8, 512, np.random.default_rng(0)), raw_dtype=qtype)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    [(_, source)] = list(gguf_tensors(open_gguf(path), None))
    assert source.stored_bits == bits


@needs_int_kernels
def test_int4_keeps_the_linears_the_file_stores_above_4_bits_at_int8(mixed_path, caplog):
    with caplog.at_level(logging.INFO, logger="tinyserve"):
        model = _build(mixed_path, quantization="int4")
    assert _formats(model) == INT4_MIX_FORMATS
    assert caplog.messages.count("int4: 4 of 8 linears kept at int8 (the file stores them at 5-8 bits)") == 1
    # layer 0's v shard (Q8_0) keeps the file's values exactly, in its own run of int8 beside q and k's int4 codes
    qkv = model.model.layers[0].self_attn.qkv_proj
    start, size = qkv.shard_offset(2)
    stored = _build(mixed_path, dtype=torch.float32).model.layers[0].self_attn.qkv_proj.weight[start:start + size]
    assert torch.equal(qkv.weight_format.parts[1].rows(torch.arange(size)), stored)


@needs_int_kernels
def test_a_float_gguf_goes_to_int4_everywhere_but_the_head(tmp_path, tiny_llama):
    """A float file chose no precision per tensor: the user's int4 applies to every block linear."""
    model = _build(_write(tmp_path / "f32.gguf", tiny_llama), quantization="int4")
    assert _formats(model) == {name: Int8Weight if name == "lm_head" else Int4Weight for name in INT4_MIX_FORMATS}


@needs_int_kernels
def test_int8_mode_keeps_q8_0_and_puts_the_rest_in_int8_per_row(mixed_path):
    """int8 everywhere: per group (Q8_0) where the file stores a shard as Q8_0 (its own values) and for the
    head, one scale per row (the faster prefill: layers/quant.py) for the rest."""
    q8_0 = {"model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj", "lm_head"}
    assert _formats(_build(mixed_path, quantization="int8")) == {
        name: Int8Weight if name in q8_0 else Int8ChannelWeight for name in INT4_MIX_FORMATS}


# the tensor types a format takes code for code (loader/gguf/blocks.py); any other is quantized by its rule
TAKEN_AS_CODES = {Int4Weight: {Q.Q4_0, Q.Q4_1}, Int8Weight: {Q.Q8_0}, Int5Weight: {Q.Q5_0, Q.Q5_1}}
# w4a16 holds what int4 holds, but a linear the file stores all in Q5_0 / Q5_1 in its own codes
# (tests/test_gguf_q5_0_q5_1.py)
W4A16_MIX_FORMATS = INT4_MIX_FORMATS | {"model.layers.0.mlp.down_proj": Int5Weight,
                                        "model.layers.1.mlp.gate_up_proj": (Int5Weight, Int4Weight)}


@needs_int_kernels
@pytest.mark.parametrize("quantization, dtype, tolerance, formats", [
    ("int4", torch.bfloat16, 0.05, INT4_MIX_FORMATS), ("w4a16", torch.float32, 1e-5, W4A16_MIX_FORMATS)])
def test_mixed_model_computes_its_mixed_quantized_values(mixed_path, quantization, dtype, tolerance, formats):
    """The logits of the quantized load against float32: the file's dequantized values, each shard of a linear
    then set to its format's values in the table: the file's own where the format takes its type's codes as
    they are (Q4_0 / Q4_1 into int4, Q8_0 into int8, Q5_0 / Q5_1 into w4a16's Int5Weight), else its format's
    rule (as tests/test_quant.py checks a uniform mode). w4a16 at float32 computes those values with unrounded
    activations: only the order of the sums differs."""
    model = _build(mixed_path, dtype=dtype, quantization=quantization)
    assert _formats(model) == formats
    assert_logits_match_the_formats_values(model, mixed_path, formats, TAKEN_AS_CODES, tolerance,
                                           a16=quantization == "w4a16")
    # all Q4_0: no minimums (w = (q - 8) * d); a Q4_0 shard beside Q4_1 ones, or float rows: minimums
    held_minimums = {name: m.weight_format.minimums is not None for name, m in model.named_modules()
                     if isinstance(getattr(m, "weight_format", None), Int4Weight)}
    assert held_minimums == {"model.layers.0.self_attn.o_proj": False, "lm_head": False,
                             "model.layers.0.mlp.gate_up_proj": True, "model.layers.1.self_attn.qkv_proj": True,
                             "model.layers.1.mlp.down_proj": True}


def a16_inputs(x: torch.Tensor) -> torch.Tensor:
    """x as the W4A16 kernels of 4- to 6-bit codes read it: rounded to bfloat16 where the CPU folds
    (csrc/a16_fold.h: cpu_kernels.w4a16_rounds_to_bfloat16), else as it is."""
    return x.bfloat16().to(x.dtype) if ops.cpu_kernels.w4a16_rounds_to_bfloat16() else x


# The logits of a w4a16 load where the kernels fold, against float32: an input rounded to bfloat16 a float32
# sum order away from the reference's rounds one bfloat16 step (2^-8) apart, and that carries through the
# layers (measured on these models: 2.2e-3 to 3.4e-3 of the largest logit; still 0.7e-3 to 2.5e-3 against a
# reference that rounds its linears' inputs too). Elsewhere only the sums' order differs: 1e-5.
FOLDED_LOGITS_TOLERANCE = 1e-2


def assert_logits_match_the_formats_values(model, path, formats: dict[str, type], taken: dict[type, set],
                                           tolerance: float, a16: bool = False) -> None:
    """model's logits (40 random tokens) against float32 on the file's dequantized values, each shard of a
    linear then set to its format's values (formats: by module name) unless the format takes its type's codes
    as they are (taken: the types, by format). a16: model is a w4a16 load (FOLDED_LOGITS_TOLERANCE where its
    kernels fold)."""
    reference = _build(path, dtype=torch.float32)
    if a16 and ops.cpu_kernels.w4a16_rounds_to_bfloat16():
        tolerance = FOLDED_LOGITS_TOLERANCE
    reader = open_gguf(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    linears = {m: name for name, m in reference.named_modules()}
    for match in match_tensors(reference, gguf_tensors(reader, gguf_model_config(reader))):
        if match.linear is None:
            continue
        name = linears[match.linear]
        fmt = formats[name]
        if isinstance(fmt, tuple):  # a StackedWeight: the shard's run's format
            fmt = _run_format(model.get_submodule(name).weight_format, match.linear_row)
        if types[_gguf_name(match.hf_name)] not in taken[fmt]:
            match.target.copy_(fmt.quantize(match.target)[1])
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got, exact = forward_sequence(model, ids), forward_sequence(reference, ids)
    assert (got.float() - exact).abs().max() <= tolerance * exact.abs().max()


def _run_format(stacked: StackedWeight, row: int) -> type:
    """The format of the run of a StackedWeight that holds row `row`."""
    for part in stacked.parts:
        if row < part.out_features:
            return type(part)
        row -= part.out_features
    raise IndexError(row)


def test_a_file_counts_as_quantized_only_when_every_block_matrix_is(tmp_path, mixed_path, tiny_llama):
    """--quantization auto's test of a GGUF: all of its blocks' matrices in quantized types (the head and
    embedding may be anything); one F16 matrix (the mix's layer 1 down) or a float file: not quantized."""
    from tinyserve.loader.gguf.checkpoint import gguf_linears_quantized

    quantized = {**MIX, "blk.1.ffn_down.weight": Q.Q8_0, "token_embd.weight": Q.F16}
    assert gguf_linears_quantized(open_gguf(_write(tmp_path / "q.gguf", tiny_llama, types=quantized)))
    assert not gguf_linears_quantized(open_gguf(mixed_path))
    assert not gguf_linears_quantized(open_gguf(_write(tmp_path / "f32.gguf", tiny_llama)))
