"""Start-up sizing: the context length and the number of KV blocks a memory budget holds."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import replace

import torch

from tinyserve.config import CacheConfig, ModelConfig
from tinyserve.engine.scheduling.block_manager import blocks_held
from tinyserve.layers.kv_cache import KVLayout, kv_row_bytes

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
# A model's own context is shortened to what its KV pool holds (fit_max_model_len), but not below this: a
# shorter one would refuse most prompts, so such a pool is refused at start-up instead.
MIN_FITTED_CONTEXT = 512


def resolve_max_model_len(requested: int | None, config: ModelConfig) -> int:
    """The model's whole context: sliding-window layers attend exactly at any length (layers/attention.py)."""
    limit = config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's context of {limit} tokens")
    return requested


def fit_max_model_len(num_blocks: int, group_windows: tuple[int | None, ...], max_model_len: int, max_chunk: int,
                      block_size: int) -> int | None:
    """max_model_len where a pool of num_blocks holds one such sequence prefilled in chunks of up to max_chunk
    tokens; else the longest context in whole blocks it holds, None below MIN_FITTED_CONTEXT tokens (or the
    model's context, if shorter)."""
    def holds(num_tokens: int) -> bool:
        return blocks_held(group_windows, num_tokens, max_chunk, block_size) <= num_blocks

    if holds(max_model_len):
        return max_model_len
    if not holds(min(MIN_FITTED_CONTEXT, max_model_len)):
        return None
    lo, hi = MIN_FITTED_CONTEXT // block_size, -(-max_model_len // block_size)  # in blocks: lo holds, hi not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid * block_size) else (lo, mid)
    return max(lo * block_size, MIN_FITTED_CONTEXT)


def kv_bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype) -> int:
    """2 x layers x kv_heads x one row's bytes (head_dim x dtype size, and an int8 pool's scale)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * kv_row_bytes(config.head_dim, kv_dtype)


def kv_pool_dtype(cache: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: the model's, or int8 (`--kv-cache-dtype int8`)."""
    return torch.int8 if cache.kv_cache_dtype == "int8" else model_dtype


def block_bytes_per_token(config: ModelConfig, dtype: torch.dtype, layout: KVLayout) -> int:
    """What one token slot of a block costs: its K/V in each of the layout's pool slots."""
    return kv_bytes_per_token(config, dtype) * layout.num_slots // config.num_hidden_layers


def num_blocks_for_budget(config: ModelConfig, layout: KVLayout, block_size: int, dtype: torch.dtype,
                          budget_bytes: int, draft_bytes_per_token: int = 0) -> int:
    """How many blocks a budget holds, each block's tokens costing the layout's slots' K/V and, with a draft
    model, the draft pool's (which has as many blocks: engine/spec_decode/draft_model.py)."""
    return budget_bytes // ((block_bytes_per_token(config, dtype, layout) + draft_bytes_per_token) * block_size)


def _free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    """The KV pool's bytes (each rank's, with tensor or pipeline parallel, as vLLM's per-device budget)."""
    if cache.kv_cache_memory_gib is not None:
        return int(cache.kv_cache_memory_gib * GIB)
    if device.type == "cpu":
        return int(cache.cpu_kv_cache_memory_gib * GIB)
    return int(_free_device_bytes(device) * cache.memory_fraction)


def rank_num_blocks(cache: CacheConfig, model: ModelConfig, layout: KVLayout, layers: range, num_kv_heads: int,
                    dtype: torch.dtype, device: torch.device) -> int:
    """The blocks one rank's budget holds for its own layers' slots and KV heads (tensor / pipeline
    parallel: every rank computes its own, and the group takes the least)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_token = 2 * num_kv_heads * kv_row_bytes(model.head_dim, dtype) * len(layout.slots_of(layers))
    return kv_budget_bytes(cache, device) // (per_token * cache.block_size)


def weight_bytes_by_format(*models: torch.nn.Module) -> dict[str, int]:
    """Bytes of the tensors loaded models hold, by the format that holds them: each linear's (and
    embedding's) weight format (layers/weight_format.py: "int4" for Int4Weight's codes, scales and minimums,
    "bf16" for Bf16Weight's interleaved rows, "dense" for a plain matrix...; a repacked linear's parameter is a
    meta placeholder), and "other" for the remaining parameters, buffers and tensor attributes (norms, biases,
    rotary tables).
    A tensor two modules share (a tied LM head's format is its embedding's) counts once."""
    seen, totals = set(), {}
    for model in models:
        for module in model.modules():
            for name, t in _tensors_by_format(module):
                if t.is_meta or not t.numel():
                    continue
                key = t.data_ptr() if t.layout == torch.strided else id(t)  # an opaque (oneDNN) layout has none
                if key not in seen:
                    seen.add(key)
                    totals[name] = totals.get(name, 0) + t.numel() * t.element_size()
    return totals


def _tensors_by_format(module: torch.nn.Module):
    """The module's weight format's tensor fields first (a dense format's is the module's own parameter)."""
    yield from _format_tensors(getattr(module, "weight_format", None))
    for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
        if isinstance(value, torch.Tensor):  # tensors kept as plain attributes too (rotary tables)
            yield "other", value


def _format_tensors(weight_format):
    """(format name, tensor) of a weight format's tensor fields; a StackedWeight's by its parts' formats."""
    if not dataclasses.is_dataclass(weight_format):
        return
    name = type(weight_format).__name__.removesuffix("Weight").lower()
    for field in dataclasses.fields(weight_format):
        value = getattr(weight_format, field.name)
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, tuple):  # StackedWeight.parts
            for part in value:
                yield from _format_tensors(part)


def held_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a loaded model holds, whatever their format (weight_bytes_by_format)."""
    return sum(weight_bytes_by_format(model).values())


def describe_weight_bytes(by_format: dict[str, int]) -> str:
    """"612 MiB (int4 560 MiB, dense 47 MiB, other 5 MiB)", largest first."""
    parts = ", ".join(f"{name} {n / MIB:.0f} MiB" for name, n in sorted(by_format.items(), key=lambda kv: -kv[1]))
    return f"{sum(by_format.values()) / MIB:.0f} MiB ({parts})"


def host_free_bytes() -> int:
    return _free_device_bytes(torch.device("cpu"))


def resolve_cache_config(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                         max_model_len: int, max_chunk: int, layout: KVLayout | None = None,
                         draft_bytes_per_token: int = 0) -> CacheConfig:
    """Fill num_blocks from the budget, for a pool of `dtype` (the model's, or int8), shared with a draft model's
    pool of as many blocks, whose K/V cost draft_bytes_per_token; refuse a budget that cannot hold one
    max-length sequence prefilled in chunks of up to max_chunk tokens. layout: the pool's (flat when None)."""
    layout = layout or KVLayout.flat(model.num_hidden_layers)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
        budget = None
    else:
        budget = kv_budget_bytes(cache, device)
        num_blocks = num_blocks_for_budget(model, layout, cache.block_size, dtype, budget, draft_bytes_per_token)
    bs = cache.block_size
    if num_blocks < blocks_held(layout.group_windows, max_model_len, max_chunk, bs):
        what = f"{budget / GIB:.3f} GiB" if budget is not None else f"{num_blocks} blocks"
        raise ValueError(
            f"KV cache budget of {what} holds {num_blocks} blocks of {bs} tokens, fewer than one max-length "
            f"sequence ({max_model_len} tokens) needs: raise --kv-cache-memory or lower --max-model-len"
        )
    # a max-length sequence while it decodes: every block in a full-attention group, about its window in a
    # sliding-window group (BlockManager releases the rest)
    num_sequences = num_blocks / blocks_held(layout.group_windows, max_model_len, 1, bs)
    windowed = any(w is not None for w in layout.group_windows)
    # the same bytes as one group keeping every block for every layer
    num_kept_all = num_blocks * layout.num_slots / model.num_hidden_layers / -(-max_model_len // bs)
    logger.info(
        "KV cache: %d blocks x %d tokens, each block holding %d of %d layers' K/V (%d block tables per sequence): "
        "%.1f max-length sequences of %d tokens%s, at %d bytes per token (%s)%s",
        num_blocks, bs, layout.num_slots, model.num_hidden_layers, layout.num_groups, num_sequences, max_model_len,
        f" (sliding-window layers keep only their window: {num_sequences / num_kept_all:.1f}x the "
        f"{num_kept_all:.1f} they would hold keeping every block)" if windowed else "",
        kv_bytes_per_token(model, dtype), str(dtype).removeprefix("torch."),
        f" + {draft_bytes_per_token} for the draft model's pool" if draft_bytes_per_token else "",
    )
    return replace(cache, num_blocks=num_blocks)
