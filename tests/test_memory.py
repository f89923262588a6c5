"""Start-up sizing (engine/memory/sizing.py): the context a model gets, what the KV capacity line claims, and the
bytes a loaded model's weights hold, by format."""

import logging
import re

import pytest
import torch

from tinyserve.config import CacheConfig, ModelConfig
from tinyserve.engine.memory.sizing import (describe_weight_bytes, fit_max_model_len, held_weight_bytes, resolve_cache_config,
                                    resolve_max_model_len, weight_bytes_by_format)
from tinyserve.layers.kv_cache import KVLayout
from tinyserve.layers.linear import Linear, quantize_linear_weights
from tinyserve.layers.rotary import RotaryEmbedding
from tinyserve.loader.gguf.checkpoint import gguf_model_config, open_gguf
from tinyserve.loader.model_loader import resolve_model_path


def _config(sliding_window=None) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       max_position_embeddings=256, norm_eps=1e-5, sliding_window=sliding_window)


def test_a_sliding_window_does_not_cap_the_context():
    """The layers attend within the window at any length, so the context is max_position_embeddings."""
    assert resolve_max_model_len(None, _config(sliding_window=16)) == 256
    assert resolve_max_model_len(100, _config(sliding_window=16)) == 100
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        resolve_max_model_len(257, _config(sliding_window=16))


def test_the_capacity_line_counts_every_block_of_a_full_attention_sequence(caplog):
    with caplog.at_level(logging.INFO, logger="tinyserve.engine.memory.sizing"):
        cache = resolve_cache_config(CacheConfig(block_size=16, num_blocks=32), _config(), torch.float32,
                                     torch.device("cpu"), 256, max_chunk=64)
    assert cache.num_blocks == 32
    assert "32 blocks x 16 tokens, each block holding 2 of 2 layers' K/V (1 block tables per sequence): " \
           "2.0 max-length sequences of 256 tokens, at" in caplog.text
    assert "window" not in caplog.text


def test_the_capacity_line_counts_only_the_window_of_sliding_window_layers(caplog):
    """Both layers slide over 16 tokens: a decoding max-length sequence holds 2 blocks (16 keys span at most
    two of 16), not 16, so 32 blocks hold 16 such sequences, 8x the 2 they would keeping every block."""
    with caplog.at_level(logging.INFO, logger="tinyserve.engine.memory.sizing"):
        config = _config(sliding_window=16)
        cache = resolve_cache_config(CacheConfig(block_size=16, num_blocks=32), config, torch.float32,
                                     torch.device("cpu"), 256, 64, KVLayout.for_windows(config.layer_sliding_windows()))
    assert cache.num_blocks == 32
    assert "16.0 max-length sequences of 256 tokens (sliding-window layers keep only their window: 8.0x the " \
           "2.0 they would hold keeping every block)" in caplog.text


def test_a_pool_too_small_for_one_sequence_prefilled_in_chunks_is_refused():
    """A window group holds up to W - 1 + chunk positions at once while a chunk is computed: with a window
    of 16 and chunks of 64, 6 blocks of 16 (79 positions over at most 6 blocks)."""
    config = _config(sliding_window=16)
    layout = KVLayout.for_windows(config.layer_sliding_windows())
    assert resolve_cache_config(CacheConfig(block_size=16, num_blocks=6), config, torch.float32,
                                torch.device("cpu"), 256, 64, layout).num_blocks == 6
    with pytest.raises(ValueError, match="holds 5 blocks of 16 tokens, fewer than one max-length sequence"):
        resolve_cache_config(CacheConfig(block_size=16, num_blocks=5), config, torch.float32,
                             torch.device("cpu"), 256, 64, layout)
    with pytest.raises(ValueError, match="holds 15 blocks of 16 tokens"):  # full attention: all 16 blocks
        resolve_cache_config(CacheConfig(block_size=16, num_blocks=15), _config(), torch.float32,
                             torch.device("cpu"), 256, 64)


def test_gemma3_270m_at_8k_holds_over_3x_the_sequences_it_would_keeping_every_block(caplog):
    """The real file's layers (3 global, 15 local with a 512-token window): at 8,192 tokens a decoding
    sequence holds 512 blocks in the global group and 33 in each of the 5 local groups, 677 against 6 x 512:
    4.5x as many sequences in the same bytes (the issue's bar: 3x)."""
    config = gguf_model_config(open_gguf(resolve_model_path("gemma3-270m")))
    layout = KVLayout.for_windows(config.layer_sliding_windows())
    assert layout.group_windows == (512,) * 5 + (None,) and layout.num_slots == 3
    with caplog.at_level(logging.INFO, logger="tinyserve.engine.memory.sizing"):
        cache = resolve_cache_config(CacheConfig(kv_cache_memory_gib=1.0), config, torch.bfloat16,
                                     torch.device("cpu"), 8192, 512, layout)
    assert cache.num_blocks == 2**30 // (3 * 2 * 256 * 2 * 16)  # 3 slots x K/V x head_dim x bf16 x 16 tokens
    held, kept_all = re.search(r"([\d.]+) max-length sequences of 8192 tokens \(sliding-window layers keep only "
                               r"their window: [\d.]+x the ([\d.]+) they would", caplog.text).groups()
    assert float(held) == pytest.approx(cache.num_blocks / 677, abs=0.05)
    assert float(held) / float(kept_all) >= 4.5


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tied", [True, False])
def test_a_quantized_model_s_weight_bytes_are_its_formats_tensors(tiny_llama, tied):
    """int4 blocks hold codes, scales and minimums, the head int8 codes and scales (a tied embedding reads the
    same ones: counted once), the repacked linears' parameters are meta placeholders; norms and the rotary
    tables (plain tensor attributes) are "other". The parameters alone (what the start-up line counted, one
    meta placeholder's nominal size among them) miss the codes."""
    model = tiny_llama(tied)
    quantize_linear_weights(model, "int4")
    blocks = [m.weight_format for m in model.model.modules() if isinstance(m, Linear)]
    head = model.lm_head.weight_format
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    tables = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    for m in tables:
        m(torch.arange(2), torch.float32)  # the rotary tables are built at the first step
    rotary = {id(t): t for m in tables for t in (m.cos, m.sin)}
    expected = {"int4": sum(_nbytes(f.codes, f.scales, f.minimums) for f in blocks),
                "int8": _nbytes(head.codes, head.scales), "other": _nbytes(*norms, *rotary.values())}
    if not tied:  # its own float table
        expected["dense"] = _nbytes(model.model.embed_tokens.weight)
    by_format = weight_bytes_by_format(model)
    assert by_format == expected
    assert held_weight_bytes(model) == sum(expected.values())
    assert sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta) < held_weight_bytes(model)


def test_the_weight_line_names_each_format_largest_first():
    by_format = {"other": 5 << 20, "int4": 560 << 20, "int8": 47 << 20}
    assert describe_weight_bytes(by_format) == "612 MiB (int4 560 MiB, int8 47 MiB, other 5 MiB)"


@pytest.mark.parametrize("num_blocks, expected", [(256, 4096), (255, 4080), (100, 1600), (32, 512), (31, None)])
def test_the_model_s_context_shortened_to_what_the_pool_holds(num_blocks, expected):
    """Full attention, 16-token blocks, a 4096-token context: the longest whole-block context the pool holds,
    down to 512 tokens (MIN_FITTED_CONTEXT); below that, None (the pool is refused)."""
    assert fit_max_model_len(num_blocks, (None,), 4096, 512, 16) == expected
