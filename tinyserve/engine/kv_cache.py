"""The KV pool: one key and one value tensor per layer, allocated once at start-up, never reallocated."""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.config import ModelConfig
from tinyserve.layers.attention import KVCache


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    shape = (config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    return [
        KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]


def bind_kv_cache(model: nn.Module, caches: list[KVCache]) -> None:
    layers = model.attention_layers
    assert len(layers) == len(caches), f"{len(layers)} attention layers, {len(caches)} caches"
    for layer, cache in zip(layers, caches):
        layer.kv_cache = cache


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks a budget holds: 2 x layers x kv_heads x head_dim x dtype size per token."""
    dtype_size = torch.empty((), dtype=dtype).element_size()
    return budget_bytes // (config.kv_bytes_per_token(dtype_size) * block_size)
