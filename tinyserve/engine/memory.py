"""Start-up sizing: the context length and the number of KV blocks a memory budget holds."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from tinyserve.config import CacheConfig, ModelConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30


def resolve_max_model_len(requested: int | None, config: ModelConfig) -> int:
    """The model's whole context: sliding-window layers attend exactly at any length (layers/attention.py)."""
    limit = config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's context of {limit} tokens")
    return requested


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """2 x layers x kv_heads x head_dim x dtype size."""
    return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                          draft_bytes_per_token: int = 0) -> int:
    """How many blocks a budget holds, each block's tokens costing the model's K/V and, with a draft model,
    the draft pool's (which has as many blocks: engine/draft_model.py)."""
    return budget_bytes // ((kv_bytes_per_token(config, dtype) + draft_bytes_per_token) * block_size)


def _free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_cache_config(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                         max_model_len: int, draft_bytes_per_token: int = 0) -> CacheConfig:
    """Fill num_blocks from the budget (shared with a draft model's pool of as many blocks, whose K/V cost
    draft_bytes_per_token); refuse a budget that cannot hold one max-length sequence."""
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
        budget = None
    else:
        if cache.kv_cache_memory_gib is not None:
            budget = int(cache.kv_cache_memory_gib * GIB)
        elif device.type == "cpu":
            budget = int(cache.cpu_kv_cache_memory_gib * GIB)
        else:
            budget = int(_free_device_bytes(device) * cache.memory_fraction)
        num_blocks = num_blocks_for_budget(model, cache.block_size, dtype, budget, draft_bytes_per_token)
    num_tokens = num_blocks * cache.block_size
    if num_tokens < max_model_len:
        what = f"{budget / GIB:.3f} GiB" if budget is not None else f"{num_blocks} blocks"
        raise ValueError(
            f"KV cache budget of {what} holds {num_tokens} tokens, fewer than one max-length sequence "
            f"({max_model_len} tokens): raise --kv-cache-memory or lower --max-model-len"
        )
    # NOTE: a sliding-window layer still keeps every block of its sequence (none is freed as it leaves the
    # window), so a max-length sequence holds max_model_len tokens of KV in every layer, as the line says.
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f max-length sequences of %d%s) at %d bytes per token%s",
        num_blocks, cache.block_size, num_tokens, num_tokens / max_model_len, max_model_len,
        "; sliding-window layers keep every block too" if any(w is not None for w in model.layer_sliding_windows()) else "",
        kv_bytes_per_token(model, dtype), f" + {draft_bytes_per_token} for the draft model's pool"
        if draft_bytes_per_token else "",
    )
    return replace(cache, num_blocks=num_blocks)
