"""The KV pool: one key and one value tensor per attention layer, allocated once at start-up and never
reallocated; a sequence's tokens live in the blocks its block table names."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tinyserve.config import ModelConfig


@dataclass
class KVCache:
    """One layer's pool. Heads lead so that one sequence's gathered blocks are already [kv_heads, tokens,
    head_dim], the layout matmuls want. Owned by whoever allocated it (the model runner, or the reference
    loop for its own run) and handed to the layers with each step's AttentionMetadata; an attention layer
    only reads and writes it."""

    key: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    value: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    """One zero-filled pool per layer."""
    return list(kv_cache_layers(config, num_blocks, block_size, dtype, device))


def kv_cache_layers(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> Iterator[KVCache]:
    """allocate_kv_cache one layer at a time: filling a pool with zeros takes a while (it touches every
    page), and a model loading beside others does it between their steps (LLMEngine.build_in_pieces)."""
    shape = (config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    for _ in range(config.num_hidden_layers):
        yield KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    cache.key.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    cache.value.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def gather_kv(cache: KVCache, block_table: torch.Tensor, seq_len: int,
              first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V at positions first .. seq_len - 1, each [num_kv_heads, seq_len - first,
    head_dim]. Only the blocks holding them are read (a sliding window's start need not be block-aligned)."""
    num_kv_heads, _, block_size, head_dim = cache.key.shape
    blocks = block_table[first // block_size : -(-seq_len // block_size)]
    rows = slice(first % block_size, first % block_size + seq_len - first)
    k = cache.key[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, rows]
    v = cache.value[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, rows]
    return k, v
