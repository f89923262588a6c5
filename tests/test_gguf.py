"""GGUF loading: a tiny Llama written to GGUF (llama.cpp names, Q/K rows permuted as llama.cpp's converter
does) loads to transformers' logits, whole or in pieces of row blocks; every supported tensor type
dequantizes to the right shape and values; bad files give one clear error."""

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader import model_loader, weights
from tinyserve.loader.model_loader import build_model, build_model_in_pieces

transformers = pytest.importorskip("transformers")

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name):
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[module]}.{kind}"


def _permute_like_llama_cpp(w, heads):
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def write_random_llama(path, types, quantize, tied: bool = False):
    """A tiny random Llama whose matrices take 256 inputs or more (a K-quant super-block), written with
    `types` (GGUF name -> type) by _write, each matrix's blocks by quantize(w, type); tied: its head is the
    embedding (no output.weight)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    return _write(path, transformers.LlamaForCausalLM(config).eval(), types=types, quantize=quantize,
                  drop=("output.weight",) if tied else ())


def _write(path, model, qtype=Q.F32, arch="llama", drop=(), edit=None, types=None, quantize=gguf.quants.quantize):
    """model as llama.cpp's converter writes it, its matrices in qtype (or types[GGUF name], a K-quant-like
    mix), the rest in F32; edit(writer) may then overwrite metadata (forged files); quantize(w, type): the
    blocks of a matrix (gguf-py's, which has no K-quants)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if edit is not None:
        edit(writer)
    for name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        if ".q_proj." in name:
            w = _permute_like_llama_cpp(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = _permute_like_llama_cpp(w, cfg.num_key_value_heads)
        gname = _gguf_name(name)
        if gname in drop:
            continue
        kind = (types or {}).get(gname, qtype) if w.ndim == 2 else Q.F32
        data = w if kind == Q.F32 else quantize(w, kind)
        writer.add_tensor(gname, data, raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path):
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    return build_model(config, gguf_tensors(reader, config), torch.float32, torch.device("cpu"))


def test_float32_gguf_matches_transformers(tmp_path, tiny_llama):
    ours = _load(_write(tmp_path / "tiny.gguf", tiny_llama))
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = tiny_llama(torch.tensor([ids])).logits[0]
    assert (forward_sequence(ours, ids) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])
def test_a_model_built_in_pieces_of_row_blocks_has_the_file_s_values(tmp_path, tiny_llama, qtype, monkeypatch):
    """Pieces of 4,096 values: every 2-d tensor but Q and K (whose rows llama.cpp permuted: read whole)
    loads in blocks of rows, one piece each, and the model still matches transformers (float32) and the
    library's dequantized values (Q8_0)."""
    monkeypatch.setattr(weights, "PIECE_VALUES", 4096)
    path = _write(tmp_path / f"tiny-{qtype.name}.gguf", tiny_llama, qtype)
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    job = build_model_in_pieces(config, gguf_tensors(reader, config), torch.float32, torch.device("cpu"))
    num_pieces = 0
    while True:
        try:
            next(job)
        except StopIteration as done:
            ours = done.value
            break
        num_pieces += 1
    assert num_pieces > len(reader.tensors) + 8  # the 256 x 128 embedding alone is 8 blocks
    stored = {t.name: t for t in reader.tensors}["token_embd.weight"]
    expected = gguf.quants.dequantize(stored.data, stored.tensor_type)
    assert np.array_equal(ours.model.embed_tokens.weight.numpy(), expected)
    if qtype == Q.F32:
        ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
        with torch.no_grad():
            ref = tiny_llama(torch.tensor([ids])).logits[0]
        assert (forward_sequence(ours, ids) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_types_dequantize_to_the_library_values(tmp_path, tiny_llama, qtype):
    path = _write(tmp_path / f"tiny-{qtype.name}.gguf", tiny_llama, qtype)
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    ours = dict(gguf_tensors(reader, config))
    by_name = {t.name: t for t in reader.tensors}
    w = ours["model.layers.0.mlp.gate_proj.weight"]()
    stored = by_name["blk.0.ffn_gate.weight"]
    expected = gguf.quants.dequantize(stored.data, stored.tensor_type)
    assert tuple(w.shape) == (256, 128) and np.array_equal(w.numpy(), expected)
    hf = tiny_llama.state_dict()["model.layers.0.mlp.gate_proj.weight"]
    assert (w - hf).abs().max().item() < 0.25 * hf.abs().max().item()  # quantized, but the same matrix
    _load(path)  # and the whole model loads


def _k_quant_bytes(qtype, rows, cols, rng):
    """Random K-quant blocks with small finite fp16 scales (gguf-py cannot quantize K-quants)."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    data = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:  # d is the last field
        data[..., -2:] = scale
    else:  # d and dmin lead the block
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_dequantize_with_the_right_shape(tmp_path, qtype):
    rng = np.random.default_rng(0)
    path = tmp_path / f"k-{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    data = _k_quant_bytes(qtype, 8, 512, rng)
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=qtype)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    reader = open_gguf(path)
    [(name, produce)] = [(n, p) for n, p in gguf_tensors(reader, None)]
    w = produce()
    assert name == "model.layers.0.mlp.up_proj.weight" and tuple(w.shape) == (8, 512)
    assert torch.isfinite(w).all()
    assert np.array_equal(w.numpy(), gguf.quants.dequantize(reader.tensors[0].data, qtype))


def test_truncated_and_corrupt_files_fail_with_one_line(tmp_path, tiny_llama):
    good = _write(tmp_path / "good.gguf", tiny_llama).read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(good[: len(good) // 2])
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 100)
    for name in ("trunc.gguf", "junk.gguf"):
        with pytest.raises(ModelLoadError, match=name) as exc:
            _load(tmp_path / name)
        assert "\n" not in str(exc.value), str(exc.value)


def test_missing_tensor_and_unknown_architecture(tmp_path, tiny_llama):
    with pytest.raises(ModelLoadError, match="missing tensor.*layers.1.mlp.down_proj"):
        _load(_write(tmp_path / "missing.gguf", tiny_llama, drop={"blk.1.ffn_down.weight"}))
    with pytest.raises(ModelLoadError, match="'falcon' is not supported.*llama"):
        _load(_write(tmp_path / "falcon.gguf", tiny_llama, arch="falcon"))


def test_cli_reports_a_bad_model_in_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    result = subprocess.run([sys.executable, "-m", "tinyserve.cli", "generate", "hi", "--model", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "bad.gguf" in lines[0], result.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda w: w.add_head_count(0), "num_attention_heads must be in"),  # was a ZeroDivisionError
    (lambda w: w.add_head_count([4, 4]), "llama.attention.head_count must be a number"),  # per-layer counts
    (lambda w: w.add_block_count(10**6), "num_hidden_layers must be in"),
    (lambda w: w.add_vocab_size(1 << 30), "vocab_size must be in"),
    (lambda w: w.add_layer_norm_rms_eps(0.0), "norm_eps must be > 0"),
    (lambda w: w.add_uint32("llama.attention.key_length", 33), "head_dim must be even"),
])
def test_absurd_metadata_is_refused_naming_the_field(tmp_path, tiny_llama, edit, message):
    path = _write(tmp_path / "forged.gguf", tiny_llama, edit=edit)
    with pytest.raises(ModelLoadError, match=message):
        gguf_model_config(open_gguf(path))


def test_metadata_that_does_not_describe_the_tensors_is_refused_before_allocation(tmp_path, tiny_llama, monkeypatch):
    """Within every bound, but 2**16-wide layers beside a file of 128-wide ones: refused from the tensors'
    headers, before the model's memory is allocated."""
    def fail(*_):
        raise AssertionError("the model was allocated before the file was checked")

    monkeypatch.setattr(model_loader, "_materialize", fail)
    def forge(writer):
        writer.add_embedding_length(1 << 16)
        writer.add_key_length(32)  # the file's own head size, so that only the width is wrong

    path = _write(tmp_path / "forged.gguf", tiny_llama, edit=forge)
    with pytest.raises(ModelLoadError, match=r"has shape \(256, 128\), expected \(256, 65536\)"):
        _load(path)
