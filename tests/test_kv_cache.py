"""The KV pool's allocation (tinyserve/layers/kv_cache.py): zero-filled, writable, and on the CPU resident only
where written (anonymous memory that Linux fills a page at a time on first touch)."""

from __future__ import annotations

import os

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.layers.kv_cache import allocate_kv_cache


def _config(layers: int = 2, kv_heads: int = 2, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=300, hidden_size=kv_heads * 2 * head_dim,
                       num_hidden_layers=layers, num_attention_heads=kv_heads * 2, num_key_value_heads=kv_heads,
                       intermediate_size=96, max_position_embeddings=256, norm_eps=1e-5)


def _resident_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_pool_is_zeros_and_takes_writes(dtype):
    caches = allocate_kv_cache(_config(), num_blocks=8, block_size=16, dtype=dtype, device=torch.device("cpu"))
    assert len(caches) == 2
    for cache in caches:
        tensors = [cache.key, cache.value] + ([cache.key_scale, cache.value_scale] if dtype == torch.int8 else [])
        for t in tensors:
            assert t.is_contiguous() and not t.any()
        assert cache.key.shape == (2, 8, 16, 64) and cache.key.dtype == dtype
    caches[0].key[1, 3, 5].fill_(7)
    assert int(caches[0].key.count_nonzero()) == 64
    assert not caches[0].value.any() and not caches[1].key.any()  # no two tensors overlap


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_cpu_pool_is_resident_only_where_written():
    """A 512 MiB pool adds far less than that to the resident set until its blocks are written (torch.zeros
    wrote every page at allocation: ~1.5 s of a 4 GiB pool's start, and all of it resident)."""
    before = _resident_bytes()
    caches = allocate_kv_cache(_config(layers=4), num_blocks=8192, block_size=16, dtype=torch.float32,
                               device=torch.device("cpu"))
    pool_bytes = sum(c.key.nbytes + c.value.nbytes for c in caches)
    assert pool_bytes == 512 << 20
    assert _resident_bytes() - before < 32 << 20
    caches[0].key[:, :2048].fill_(1.0)  # a quarter of one of the 8 tensors: 16 MiB
    grown = _resident_bytes() - before
    assert 16 << 20 <= grown < 64 << 20
