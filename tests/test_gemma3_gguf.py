"""Gemma 3 from GGUF, fast: a tiny random Gemma 3 written to GGUF as llama.cpp's converter writes it
(gguf-py's own tensor names for the architecture, 1 added to every norm weight, no Q/K permutation, the
metadata keys it writes and none it leaves out: no layer pattern, no local rotary base, no attention
scale) loads to transformers' logits within 1e-4 at every position; the real Gemma 3 270M file's metadata
and tensor table are read into the config and names the model needs. The real model's own logits are in
test_gemma3_270m.py (reliability)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_tokenizer import write_gguf

from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader.hf import hf_ignored, hf_model_config, hf_tensors
from tinyserve.loader.model_loader import build_model, load_model, resolve_model_path
from tinyserve.loader.weights import match_tensors
from tinyserve.models.gemma3 import Gemma3ForCausalLM

tf = pytest.importorskip("transformers")

WINDOW, NUM_LAYERS, HEAD_DIM = 16, 7, 32  # 7 layers: the 6th is global, as llama.cpp's gemma3 pattern has it
BYTES = [f"<0x{b:02X}>" for b in range(256)]
WORDS = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", *(f"\u2581{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", *BYTES, *WORDS]
TYPES = [3, 3, 3, 3, 3, 3, 4, *[6] * len(BYTES), *[1] * len(WORDS)]  # control, user-defined, byte, normal


def tiny_gemma3() -> tf.Gemma3ForCausalLM:
    """Far-apart rotary bases and a rope scaling on the global layers: a layer rotated with the other kind's
    table, or a scaling on the local ones, is off by far more than 1e-4. Every vector random."""
    config = tf.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=1,
        head_dim=HEAD_DIM, intermediate_size=96, vocab_size=len(TOKENS), max_position_embeddings=256,
        sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM, rms_norm_eps=1e-6, attn_implementation="eager",
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(NUM_LAYERS)],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # transformers starts Gemma's norm weights at 0: a norm left at 1 + w would pass
                param.add_(torch.randn_like(param) * 0.3)
    return model


def write_gemma3_gguf(path, model: tf.Gemma3ForCausalLM, matrix_type=Q.F32):
    """The model as llama.cpp's convert_hf_to_gguf.py (Gemma3Model) writes it, with a small SentencePiece
    vocabulary and no chat template."""
    cfg = model.config
    global_rope = cfg.rope_parameters["full_attention"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    tensors = []
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: the converter skips it
            continue
        w = tensor.float().numpy()
        if name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # Gemma3Model.norm_shift
        kind = matrix_type if w.ndim == 2 else Q.F32
        data = w if kind == Q.F32 else gguf.quants.quantize(w, kind)
        tensors.append((names.get_name(name, try_suffixes=(".weight",)), data, None if kind == Q.F32 else kind))
    return write_gguf(
        path, "gemma3", tensors, context_length=cfg.max_position_embeddings, embedding_length=cfg.hidden_size,
        block_count=cfg.num_hidden_layers, feed_forward_length=cfg.intermediate_size,
        head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads,
        layer_norm_rms_eps=cfg.rms_norm_eps, key_length=cfg.head_dim, value_length=cfg.head_dim,
        rope_freq_base=global_rope["rope_theta"], rope_scaling_type=gguf.RopeScalingType.LINEAR,
        rope_scaling_factor=global_rope["factor"], sliding_window=cfg.sliding_window,
        tokenizer_model="llama", tokenizer_pre="default", token_list=TOKENS, token_types=TYPES,
        token_scores=[-1000.0 if t != 1 else -float(i) for i, t in enumerate(TYPES)], bos_token_id=2,
        eos_token_id=1, unk_token_id=3, pad_token_id=0, add_bos_token=True, add_space_prefix=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_gemma3()
    return model, write_gemma3_gguf(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf", model)


def test_config_from_a_converted_file(tiny):
    _, path = tiny
    config = gguf_model_config(open_gguf(path))
    assert config.architecture == "gemma3" and config.tie_word_embeddings and config.qk_norm
    assert config.layer_sliding_windows() == (WINDOW,) * 5 + (None, WINDOW)
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (500.0, 10000.0, HEAD_DIM)
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 2.0)
    assert (config.hidden_act, config.final_logit_softcapping, config.head_dim) == ("gelu_pytorch_tanh", None, HEAD_DIM)


@pytest.mark.parametrize("step_tokens, cpu_attention", [(None, False), (8, False), (1, True)],
                         ids=["one-chunk", "8-token-chunks", "decode-kernel"])
def test_logits_match_transformers_at_every_position(tiny, step_tokens, cpu_attention):
    """60 tokens: nearly 4 windows."""
    hf, path = tiny
    ours = load_model(str(path), dtype="float32", device="cpu").model
    ids = torch.randint(0, len(TOKENS), (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = forward_sequence(ours, ids, block_size=16, step_tokens=step_tokens, cpu_attention=cpu_attention)
    assert (got - expected).abs().max().item() < 1e-4


def test_norms_are_read_as_the_converter_wrote_them_less_one(tiny):
    hf, path = tiny
    ours = load_model(str(path), dtype="float32", device="cpu").model
    for name, param in hf.state_dict().items():
        if name.endswith("norm.weight"):  # stored as 1 + w; ours, as transformers', hold w
            torch.testing.assert_close(ours.get_parameter(name), param, rtol=0, atol=1e-6)


def test_quantized_matrices_load(tmp_path):
    """Q8_0 matrices (the 270M file's embedding and V are Q8_0): within the quantization's error of float."""
    hf = tiny_gemma3()
    ours = load_model(str(write_gemma3_gguf(tmp_path / "q8.gguf", hf, Q.Q8_0)), dtype="float32", device="cpu")
    ids = list(range(7, 40))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    diff = (forward_sequence(ours.model, ids) - expected).abs().max().item()
    assert 1e-6 < diff < 0.1  # not bit-identical (so the codes were read), and close


def test_the_real_file_describes_gemma3_270m():
    """The shipped Q4_K_M file's metadata, read as llama.cpp reads it, and its tensor table against the model
    on the meta device (names and shapes; nothing is read or allocated)."""
    reader = open_gguf(resolve_model_path("gemma3-270m"))
    config = gguf_model_config(reader)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        262144, 640, 18, 2048)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.layer_sliding_windows() == ((512,) * 5 + (None,)) * 3
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling) == (1e6, 10000.0, None)
    assert (config.query_pre_attn_scalar, config.norm_eps) == (256.0, pytest.approx(1e-6))
    assert config.tie_word_embeddings and config.qk_norm
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
    match_tensors(model, list(gguf_tensors(reader, config)), lambda _: False)  # raises on any mismatch
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}


def test_a_model_built_from_the_converted_file_equals_one_built_from_the_folder(tiny, tmp_path):
    """The same weights through the two loaders (GGUF names and +1 norms; HF names): the same parameters."""
    hf, path = tiny
    hf.save_pretrained(tmp_path, safe_serialization=True)
    folder_config = hf_model_config(tmp_path)
    from_folder = build_model(folder_config, hf_tensors(tmp_path), torch.float32, torch.device("cpu"),
                              ignore=lambda name: hf_ignored(name, folder_config))
    reader = open_gguf(path)
    gguf_config = gguf_model_config(reader)
    from_gguf = build_model(gguf_config, gguf_tensors(reader, gguf_config), torch.float32, torch.device("cpu"))
    fields = ("layer_is_sliding", "sliding_window", "rope_theta", "rope_local_theta", "rope_scaling",
              "query_pre_attn_scalar", "final_logit_softcapping", "hidden_act", "head_dim", "qk_norm")
    assert {f: getattr(gguf_config, f) for f in fields} == {f: getattr(folder_config, f) for f in fields}
    for (name, a), (_, b) in zip(from_folder.named_parameters(), from_gguf.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
