"""The memory a model load takes, checked against what the process may use: once before the weights are read
(the checkpoint's size on disk), and once they are loaded, before the KV pool is allocated (the weights as
held, the pool, an allowance for a step's activations). `--kv-cache-memory auto` sizes the pool here.

The allowance is measured before the load (engine/memory/process_memory.py: MemAvailable, within the cgroup's
limit), and is the model's share of `--memory-budget` where that is less. CUDA pools are sized from the
device's free memory after the load (engine/memory/sizing.py), so these checks are the host's (device "cpu").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine.scheduling.block_manager import blocks_held
from tinyserve.engine.memory.sizing import MIN_FITTED_CONTEXT, block_bytes_per_token, fit_max_model_len, kv_budget_bytes
from tinyserve.engine.memory.process_memory import available_memory_bytes
from tinyserve.layers.kv_cache import KVLayout
from tinyserve.loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

GIB, MIB = 1 << 30, 1 << 20
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")
FLAGS = "--kv-cache-memory, --max-model-len, --max-num-seqs, --quantization, --memory-budget"


class NotEnoughMemory(ModelLoadError):
    """A load that does not fit the memory the process may use; the message names the numbers (MiB) and the
    flags that change them. The admin API answers it 507 model_too_large (server/registry/admin.py)."""


@dataclass(frozen=True)
class Allowance:
    bytes: int
    source: str  # what it is, for messages: "available memory" or "its share of --memory-budget"


@dataclass(frozen=True)
class MemoryPlan:
    """A loaded model's bytes against the allowance: weights + KV pool + activations <= allowance."""

    allowance: Allowance | None  # None: not known (CUDA, or /proc unreadable): nothing is checked
    weight_bytes: int
    activation_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    def describe(self) -> str:
        allowance = "" if self.allowance is None else \
            f" against {self.allowance.bytes / MIB:.0f} MiB ({self.allowance.source})"
        return (f"weights {self.weight_bytes / MIB:.0f} MiB + KV pool {self.kv_bytes / MIB:.0f} MiB + activations "
                f"{self.activation_bytes / MIB:.0f} MiB = {self.total_bytes / MIB:.0f} MiB{allowance}")

    def check(self) -> None:
        if self.allowance is not None and self.total_bytes > self.allowance.bytes:
            raise NotEnoughMemory(f"the model does not fit in memory: {self.describe()}; {FLAGS} change this")


def checkpoint_bytes(source: str) -> int:
    """Bytes of the weight files of a GGUF file or an HF folder (0 for an alias not downloaded yet)."""
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    return 0


def load_allowance(cache: CacheConfig, device: torch.device, held_bytes: int = 0,
                   available_bytes: int | None = None) -> Allowance | None:
    """What a load may take, measured before it: what the process may still take (plus held_bytes, the
    weights of a model loaded before this engine was built), within the model's --memory-budget share.
    available_bytes: measured by the caller (tests); None reads engine/memory/process_memory.py."""
    if device.type != "cpu":
        return None
    available = available_memory_bytes() if available_bytes is None else available_bytes
    share = None if cache.memory_share_gib is None else int(cache.memory_share_gib * GIB)
    if available is None:
        return None if share is None else Allowance(share, "its share of --memory-budget")
    if share is not None and share < available + held_bytes:
        return Allowance(share, "its share of --memory-budget")
    return Allowance(available + held_bytes, "the memory available to this process: MemAvailable, "
                                             "within its cgroup's limit")


def check_checkpoint_fits(source: str, allowance: Allowance | None) -> None:
    """Before any weight is read: a checkpoint larger on disk than the allowance is refused (the weights
    as held are checked again, with the KV pool, once loaded)."""
    on_disk = checkpoint_bytes(source)
    if allowance is not None and on_disk > allowance.bytes:
        raise NotEnoughMemory(f"the model does not fit in memory: its weights take {on_disk / MIB:.0f} MiB on "
                              f"disk, more than {allowance.bytes / MIB:.0f} MiB ({allowance.source}); "
                              f"{FLAGS} change this")


def activation_bytes(model: ModelConfig, scheduler: SchedulerConfig) -> int:
    """An allowance for one step's working tensors, at float32 whatever the dtype: per batched token the
    residual stream, its normed copy and the attention output, q, k and v, and the MLP's gate, up and
    product; per running sequence its logits, probabilities and the sampler's sorted copy."""
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    per_token = 3 * model.hidden_size + qkv + 3 * model.intermediate_size
    return 4 * (scheduler.max_num_batched_tokens * per_token + 3 * scheduler.max_num_seqs * model.vocab_size)


def auto_kv_bytes(need_bytes: int, headroom_bytes: int, cache: CacheConfig) -> int:
    """`--kv-cache-memory auto` on CPU: what max_num_seqs full contexts need (need_bytes), no more; within a
    --memory-budget share all of the headroom (what the allowance leaves after weights and activations),
    else memory_fraction of it, no less than cpu_kv_cache_memory_gib (1 GiB) where the headroom holds that and
    no more than cpu_kv_cache_max_gib (4 GiB: a small model on a large machine leaves the rest to others);
    never more than the headroom."""
    if cache.memory_share_gib is not None:
        wanted = headroom_bytes
    else:
        fraction = min(int(cache.memory_fraction * headroom_bytes), int(cache.cpu_kv_cache_max_gib * GIB))
        wanted = max(int(cache.cpu_kv_cache_memory_gib * GIB), fraction)
    return max(0, min(need_bytes, wanted, headroom_bytes))


def size_kv_pool(cache: CacheConfig, scheduler: SchedulerConfig, model: ModelConfig, layout: KVLayout,
                 kv_dtype: torch.dtype, device: torch.device, allowance: Allowance | None, weight_bytes: int,
                 max_model_len: int, draft_bytes_per_token: int = 0) -> tuple[CacheConfig, int]:
    """The pool's blocks (cache.num_blocks set) and the context. An explicit pool (--kv-cache-memory GIB, or
    num_blocks) is kept; auto sizes it (auto_kv_bytes). Either way weights + pool + activations are checked
    against the allowance. The model's own context (no --max-model-len) is shortened to what the pool
    holds, in whole blocks and no shorter than MIN_FITTED_CONTEXT, and says so."""
    bs = cache.block_size
    block_bytes = (block_bytes_per_token(model, kv_dtype, layout) + draft_bytes_per_token) * bs
    activations = activation_bytes(model, scheduler)
    is_auto = cache.num_blocks is None and cache.kv_cache_memory_gib is None and allowance is not None
    if cache.num_blocks is not None:
        kv = cache.num_blocks * block_bytes
    elif is_auto:
        need = scheduler.max_num_seqs * blocks_held(layout.group_windows, max_model_len, 1, bs) * block_bytes
        kv = auto_kv_bytes(need, allowance.bytes - weight_bytes - activations, cache)
    else:
        kv = kv_budget_bytes(cache, device)
    plan = MemoryPlan(allowance, weight_bytes, activations, kv)
    plan.check()
    num_blocks = cache.num_blocks or kv // block_bytes
    if scheduler.max_model_len is None:
        fitted = fit_max_model_len(num_blocks, layout.group_windows, max_model_len,
                                   scheduler.max_num_batched_tokens, bs)
        if fitted is None and is_auto:
            raise NotEnoughMemory(f"the model does not fit in memory: the KV pool left ({num_blocks} blocks of "
                                  f"{bs} tokens) holds less than one sequence of {MIN_FITTED_CONTEXT} tokens: "
                                  f"{plan.describe()}; {FLAGS} change this")
        if fitted is not None and fitted < max_model_len:
            logger.warning("context limited to %d tokens by memory (the model's is %d): the KV pool holds "
                           "%d blocks of %d tokens; pass --max-model-len / --kv-cache-memory", fitted,
                           max_model_len, num_blocks, bs)
            max_model_len = fitted
    logger.info("memory: %s%s", plan.describe(), " (KV pool: --kv-cache-memory auto)" if is_auto else "")
    return replace(cache, num_blocks=max(1, num_blocks)), max_model_len
