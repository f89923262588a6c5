"""Llama 3.x's llama3 rotary scaling in GGUF form: llama.cpp's converter writes it as a rope_freqs tensor (one
divisor per inverse frequency) and no scaling metadata. A tiny random Llama with llama3 scaling, written so,
loads to transformers' logits within 1e-4 at every position of a prompt past its original context (where the
scaling changes the rotation), and not without the tensor; a bad tensor is refused naming it."""

import math

import gguf
import numpy as np
import pytest
import torch
from test_gguf import _load, _write

from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf

transformers = pytest.importorskip("transformers")

ORIGINAL_CONTEXT, PROMPT_LEN, HEAD_DIM = 64, 200, 32
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL_CONTEXT, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def llama3_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rope_scaling=LLAMA3,
    )
    return transformers.LlamaForCausalLM(config).eval()


def converter_rope_factors() -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for a llama3 rope_scaling: 1 for
    wavelengths under original / high_freq_factor, `factor` over original / low_freq_factor, between them
    1 / ((1 - smooth) / factor + smooth). float32 [HEAD_DIM // 2]."""
    factor, low, high = LLAMA3["factor"], LLAMA3["low_freq_factor"], LLAMA3["high_freq_factor"]
    freqs = 1.0 / (LLAMA3["rope_theta"] ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < ORIGINAL_CONTEXT / high:
            factors.append(1.0)
        elif wavelen > ORIGINAL_CONTEXT / low:
            factors.append(factor)
        else:
            smooth = (ORIGINAL_CONTEXT / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_with_rope_freqs(path, model, factors, edit=None):
    def add_rope_freqs(writer):
        writer.add_tensor("rope_freqs.weight", factors)
        if edit is not None:
            edit(writer)

    return _write(path, model, edit=add_rope_freqs)


def _max_diff_to_transformers(ours, model) -> float:
    ids = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]  # [PROMPT_LEN, vocab]
    return (forward_sequence(ours, ids) - ref).abs().max().item()


def test_factors_span_all_three_bands():
    """Else the test below would not cover the interpolated band, nor the kept or slowed ones."""
    factors = converter_rope_factors()
    assert factors[0] == 1.0 and factors[-1] == LLAMA3["factor"]
    assert ((factors > 1.0) & (factors < LLAMA3["factor"])).sum() >= 2


def test_rope_freqs_gguf_matches_transformers_past_the_original_context(tmp_path, llama3_model):
    path = _write_with_rope_freqs(tmp_path / "llama3.gguf", llama3_model, converter_rope_factors())
    config = gguf_model_config(open_gguf(path))
    assert config.rope_scaling.rope_type == "freq_factors"
    assert np.array_equal(np.array(config.rope_scaling.freq_factors, dtype=np.float32), converter_rope_factors())
    diff = _max_diff_to_transformers(_load(path), llama3_model)
    print(f"max abs diff to transformers: {diff:.2e}")
    assert diff <= 1e-4


def test_without_rope_freqs_the_logits_differ(tmp_path, llama3_model):
    """The guard: the same file without the tensor (plain rotary) is off by far more than the 1e-4 allowed
    above, so the test above sees the factors."""
    diff = _max_diff_to_transformers(_load(_write(tmp_path / "plain.gguf", llama3_model)), llama3_model)
    assert diff > 1e-3, diff


@pytest.mark.parametrize("factors, message", [
    (np.ones(HEAD_DIM // 2 - 1, dtype=np.float32), r"rope_freqs.weight\) must hold head_dim // 2 = 16 values, got 15"),
    (np.ones((2, HEAD_DIM // 2), dtype=np.float32), r"'rope_freqs.weight' must be 1-d"),
    (np.array([1.0] * 5 + [0.0] + [1.0] * 10, dtype=np.float32), r"must each be > 0 and finite, got 0.0 at index 5"),
    (np.array([1.0] * 3 + [np.nan] + [1.0] * 12, dtype=np.float32), r"must each be > 0 and finite, got nan at index 3"),
    (np.array([-1.0] + [1.0] * 15, dtype=np.float32), r"must each be > 0 and finite, got -1.0 at index 0"),
], ids=["short", "2-d", "zero", "nan", "negative"])
def test_a_bad_rope_freqs_tensor_is_refused_naming_it(tmp_path, llama3_model, factors, message):
    path = _write_with_rope_freqs(tmp_path / "bad.gguf", llama3_model, factors)
    with pytest.raises(ModelLoadError, match=message):
        gguf_model_config(open_gguf(path))


def test_rope_freqs_with_a_scaling_type_too_is_refused(tmp_path, llama3_model):
    """llama.cpp would apply both; its converter writes one or the other, so we do not guess."""
    def add_linear(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    path = _write_with_rope_freqs(tmp_path / "both.gguf", llama3_model, converter_rope_factors(), add_linear)
    with pytest.raises(ModelLoadError, match="both a rope_freqs.weight tensor and llama.rope.scaling.type 'linear'"):
        gguf_model_config(open_gguf(path))


def test_rope_freqs_outside_the_llama_family_is_an_unexpected_tensor(tmp_path, llama3_model):
    """llama.cpp reads rope_freqs for its llama architecture only; elsewhere it is not silently applied.
    (Checked on the tensor list: a whole Qwen2 would also want the q/k/v biases this Llama lacks.)"""
    path = _write(tmp_path / "qwen2.gguf", llama3_model, arch="qwen2",
                  edit=lambda writer: writer.add_tensor("rope_freqs.weight", converter_rope_factors()))
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    assert config.rope_scaling is None
    with pytest.raises(ModelLoadError, match="'rope_freqs.weight' is unexpected for architecture 'qwen2'"):
        list(gguf_tensors(reader, config))
