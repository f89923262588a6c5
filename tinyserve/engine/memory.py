"""Start-up sizing: the context length and the number of KV blocks a memory budget holds."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from tinyserve.config import CacheConfig, ModelConfig
from tinyserve.engine.kv_cache import num_blocks_for_budget

logger = logging.getLogger(__name__)

GIB = 1 << 30
# With no explicit budget on the CPU, a fixed 1 GiB (like vLLM's CPU default of a fixed KV space): a
# fraction of a shared host's free memory would be a moving target.
DEFAULT_CPU_BUDGET_GIB = 1.0


def resolve_max_model_len(requested: int | None, config: ModelConfig) -> int:
    limit = config.max_position_embeddings
    if config.sliding_window is not None:  # attention has no window: stay where full attention is exact
        limit = min(limit, config.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's context of {limit} tokens")
    return requested


def _free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_cache_config(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                         max_model_len: int) -> CacheConfig:
    """Fill num_blocks from the budget; refuse a budget that cannot hold one max-length sequence."""
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
        budget = None
    else:
        if cache.kv_cache_memory_gib is not None:
            budget = int(cache.kv_cache_memory_gib * GIB)
        elif device.type == "cpu":
            budget = int(DEFAULT_CPU_BUDGET_GIB * GIB)
        else:
            budget = int(_free_device_bytes(device) * cache.memory_fraction)
        num_blocks = num_blocks_for_budget(model, cache.block_size, dtype, budget)
    num_tokens = num_blocks * cache.block_size
    if num_tokens < max_model_len:
        what = f"{budget / GIB:.3f} GiB" if budget is not None else f"{num_blocks} blocks"
        raise ValueError(
            f"KV cache budget of {what} holds {num_tokens} tokens, fewer than one max-length sequence "
            f"({max_model_len} tokens): raise --kv-cache-memory or lower --max-model-len"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f max-length sequences of %d)",
        num_blocks, cache.block_size, num_tokens, num_tokens / max_model_len, max_model_len,
    )
    return replace(cache, num_blocks=num_blocks)


# glibc malloc's M_TRIM_THRESHOLD, M_TOP_PAD and M_MMAP_THRESHOLD (mallopt's parameter numbers).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def _set_malloc(settings: tuple[tuple[int, int], ...], trim: bool = False) -> bool:
    """mallopt each (parameter, value), after malloc_trim(0) if trim; False (nothing changed) where the
    C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    if trim:
        malloc_trim(0)
    return all(mallopt(param, value) == 1 for param, value in settings)


def map_large_buffers_apart() -> bool:
    """Before loading: give every buffer over 1 MiB its own mapping, handed back to the kernel when freed.

    Why: loading converts weights through float32 copies. glibc's default threshold rises with the
    sizes it sees freed, so most of those copies came from the heap and left ~260 MiB of holes in it;
    the steps' short-lived tensors then wandered through the holes, and the int4 server's resident
    memory grew by ~80 MiB over a busy workload. With the copies mapped apart, the holes are not made."""
    return _set_malloc(((_M_MMAP_THRESHOLD, 1 << 20),))


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc to keep freed memory instead of returning it to the kernel at once.

    Why: a CPU step allocates and frees the same multi-MB activations (KV gathers, MLP outputs) every
    layer. By default glibc maps big blocks fresh from the kernel and hands the top of its heap back on
    free, so the next allocation page-faults the memory in again: on the offline benchmark that was 1/3
    of all CPU time in the kernel and cost 35% of throughput. The heap then stays at its high-water
    mark, which the steady state reaches anyway.

    What loading freed (float32 weights quantized or cast, file buffers) is handed back first: ~110 MiB
    of an int4 model's resident memory here. Returns False (and changes nothing) where the C library is
    not glibc."""
    # Blocks above the mmap threshold get fresh pages on every allocation: serve them from the heap too.
    settings = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    ok = _set_malloc(settings, trim=True)
    logger.debug("malloc tuned to keep freed memory: %s", ok)
    return ok
