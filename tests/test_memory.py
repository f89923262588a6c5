"""Start-up sizing (engine/memory.py): the context a model gets, and what the KV capacity line claims."""

import logging

import pytest
import torch

from tinyserve.config import CacheConfig, ModelConfig
from tinyserve.engine.memory import resolve_cache_config, resolve_max_model_len


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


@pytest.mark.parametrize("window", [None, 16])
def test_the_capacity_line_counts_every_block_of_a_sequence(window, caplog):
    """No block is freed as it leaves a window: a max-length sequence holds all of its blocks, as the line
    says, and with a window it says so."""
    with caplog.at_level(logging.INFO, logger="tinyserve.engine.memory"):
        cache = resolve_cache_config(CacheConfig(block_size=16, num_blocks=32), _config(window), torch.float32,
                                     torch.device("cpu"), 256)
    assert cache.num_blocks == 32
    assert "32 blocks x 16 tokens = 512 tokens (2.0 max-length sequences of 256" in caplog.text
    assert ("sliding-window layers keep every block too" in caplog.text) == (window is not None)
