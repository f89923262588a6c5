"""A load against the memory the process may use (engine/memory/fit_check.py): --kv-cache-memory auto in each
regime, the context a long-context model starts with, and the refusals that name the numbers and flags."""

import logging

import pytest
import torch

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine.memory.fit_check import (FLAGS, Allowance, NotEnoughMemory, activation_bytes, auto_kv_bytes,
                                           check_checkpoint_fits, load_allowance, size_kv_pool)
from tinyserve.layers.kv_cache import KVLayout

GIB, MIB = 1 << 30, 1 << 20
CPU = torch.device("cpu")


def _config(max_position_embeddings=4096) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       max_position_embeddings=max_position_embeddings, norm_eps=1e-5)


# K and V x 2 layers x 2 KV heads x head_dim 16 x float32, for each of a block's 16 tokens
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16


@pytest.mark.parametrize("need, headroom, expected", [
    (2 * GIB, 100 * GIB, 2 * GIB),  # what max_num_seqs full contexts need, no more
    (100 * GIB, 6 * GIB, 3 * GIB),  # half of the headroom
    (100 * GIB, 20 * GIB, 4 * GIB),  # half would be 10 GiB: the 4 GiB ceiling
    (3 * GIB, 20 * GIB, 3 * GIB),  # under the ceiling, what max_num_seqs contexts need
    (100 * GIB, 1.5 * GIB, 1 * GIB),  # the 1 GiB floor: half would be 0.75 GiB
    (100 * GIB, 0.6 * GIB, 0.6 * GIB),  # less than the floor is left: what is left
    (100 * GIB, -1 * GIB, 0),  # nothing left
], ids=["capped-by-max-num-seqs", "fraction", "ceiling", "need-under-ceiling", "floor", "under-the-floor", "none-left"])
def test_auto_picks_the_documented_pool_in_each_regime(need, headroom, expected):
    assert auto_kv_bytes(int(need), int(headroom), CacheConfig()) == int(expected)


def test_auto_within_a_memory_budget_share_takes_the_share_s_headroom():
    """A share of --memory-budget is the model's to use: the pool takes all that the weights and activations
    leave of it (up to what max_num_seqs contexts need), neither half of it nor the 1 GiB floor."""
    share = CacheConfig(memory_share_gib=2.0)
    assert auto_kv_bytes(100 * GIB, int(1.5 * GIB), share) == int(1.5 * GIB)
    assert auto_kv_bytes(100 * GIB, int(0.25 * GIB), share) == int(0.25 * GIB)
    assert auto_kv_bytes(GIB // 2, int(1.5 * GIB), share) == GIB // 2


def _size(cache=CacheConfig(), scheduler=SchedulerConfig(max_num_seqs=4), allowance=100 * GIB,
          weights=100 * MIB, config=None):
    config = config or _config()
    return size_kv_pool(cache, scheduler, config, KVLayout.flat(2), torch.float32, CPU,
                        Allowance(int(allowance), "test"), weights, config.max_position_embeddings)


def test_auto_holds_max_num_seqs_full_contexts_where_memory_allows():
    cache, max_model_len = _size()
    assert max_model_len == 4096 and cache.num_blocks == 4 * 4096 // 16


def test_a_long_context_model_starts_with_the_context_that_fits_and_says_so(caplog):
    """The headroom left for the pool holds 100 blocks of 16 tokens: the model's 131072-token context
    becomes 1600 tokens, and the log says so and which flags change it."""
    config = _config(max_position_embeddings=131072)
    scheduler = SchedulerConfig(max_num_seqs=4)
    allowance = 100 * MIB + activation_bytes(config, scheduler) + 100 * BLOCK_BYTES
    with caplog.at_level(logging.WARNING, logger="tinyserve.engine.memory.fit_check"):
        cache, max_model_len = _size(scheduler=scheduler, allowance=allowance, config=config)
    assert (cache.num_blocks, max_model_len) == (100, 1600)
    assert "context limited to 1600 tokens by memory (the model's is 131072)" in caplog.text
    assert "--max-model-len / --kv-cache-memory" in caplog.text


def test_an_asked_for_context_is_kept():
    """--max-model-len given: not shortened (resolve_cache_config refuses a pool that cannot hold it)."""
    cache, max_model_len = _size(CacheConfig(num_blocks=10), SchedulerConfig(max_num_seqs=4, max_model_len=4096))
    assert (cache.num_blocks, max_model_len) == (10, 4096)


def test_an_explicit_pool_is_kept_exactly_and_the_model_s_own_context_fitted_to_it():
    cache, max_model_len = _size(CacheConfig(kv_cache_memory_gib=200 * BLOCK_BYTES / GIB))
    assert (cache.num_blocks, max_model_len) == (200, 3200)


def test_a_pool_that_does_not_fit_is_refused_with_the_numbers_and_the_flags():
    with pytest.raises(NotEnoughMemory) as refused:
        _size(CacheConfig(kv_cache_memory_gib=2.0), allowance=1 * GIB, weights=300 * MIB)
    message = str(refused.value)
    assert "weights 300 MiB + KV pool 2048 MiB + activations" in message
    assert "against 1024 MiB (test)" in message
    assert FLAGS in message and "--memory-budget" in message and "--quantization" in message


def test_weights_and_activations_alone_over_the_allowance_are_refused():
    with pytest.raises(NotEnoughMemory, match=r"weights 2048 MiB \+ KV pool 0 MiB"):
        _size(allowance=1 * GIB, weights=2 * GIB)


def test_auto_that_leaves_less_than_a_short_context_is_refused_not_started():
    """What is left holds 20 blocks (320 tokens), under MIN_FITTED_CONTEXT (512)."""
    scheduler = SchedulerConfig(max_num_seqs=4)
    allowance = 100 * MIB + activation_bytes(_config(), scheduler) + 20 * BLOCK_BYTES
    with pytest.raises(NotEnoughMemory, match="holds less than one sequence of 512 tokens"):
        _size(scheduler=scheduler, allowance=allowance)


def test_the_allowance_is_the_smaller_of_available_memory_and_the_share():
    share = CacheConfig(memory_share_gib=1.0)
    assert load_allowance(share, CPU, available_bytes=4 * GIB) == Allowance(GIB, "its share of --memory-budget")
    assert load_allowance(share, CPU, available_bytes=GIB // 2).bytes == GIB // 2
    # a model loaded before the engine was built: its weights are no longer available, but its own
    assert load_allowance(CacheConfig(), CPU, held_bytes=GIB, available_bytes=GIB).bytes == 2 * GIB
    assert load_allowance(CacheConfig(), torch.device("cuda")) is None  # the device's pool: sized after load


def test_a_checkpoint_larger_on_disk_than_the_allowance_is_refused_before_loading(tmp_path):
    path = tmp_path / "big.gguf"
    path.write_bytes(bytes(3 * MIB))
    check_checkpoint_fits(str(path), Allowance(4 * MIB, "test"))
    check_checkpoint_fits(str(path), None)
    with pytest.raises(NotEnoughMemory, match=r"its weights take 3 MiB on disk, more than 2 MiB \(test\)"):
        check_checkpoint_fits(str(path), Allowance(2 * MIB, "test"))
