"""The KV pool: one key and one value tensor per attention layer, allocated once at start-up and never
reallocated; a sequence's tokens live in the blocks its block table names."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tinyserve.config import ModelConfig


# An 8-bit pool (`--kv-cache-dtype int8`) stores each token's K (and V) head as int8 codes with one float16
# scale, absmax / 127 of that head's row, as llama.cpp's q8_0 cache does per 32 values: head_dim + 2 bytes
# a row instead of 2 x head_dim in bfloat16.
KV_SCALE_DTYPE = torch.float16
KV_INT8_MAX = 127


@dataclass
class KVCache:
    """One layer's pool. Heads lead so that one sequence's gathered blocks are already [kv_heads, tokens,
    head_dim], the layout matmuls want. Owned by whoever allocated it (the model runner, or the reference
    loop for its own run) and handed to the layers with each step's AttentionMetadata; an attention layer
    only reads and writes it."""

    key: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    value: torch.Tensor  # [num_kv_heads, num_blocks, block_size, head_dim]
    # int8 pool: each row's scale, [num_kv_heads, num_blocks, block_size] float16 (a row is code x scale)
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None


def kv_row_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """What one token's K (or V) of one head takes in a pool of kv_dtype (int8: its codes and scale)."""
    size = head_dim * torch.empty((), dtype=kv_dtype).element_size()
    return size + (torch.empty((), dtype=KV_SCALE_DTYPE).element_size() if kv_dtype == torch.int8 else 0)


@dataclass(frozen=True)
class KVLayout:
    """How the attention layers share the pool's tensors and block tables.

    Layers are split into groups of equal size, each group holding layers of one sliding window (or all
    full attention); a request holds one block table per group. The pool has one K/V tensor pair per
    slot (group size of them), and a block id names the same rows in every slot: layer i uses slot
    `layer_slots[i]` with the table of group `layer_groups[i]`, and as the free list hands each block
    to one table at a time, two groups never write the same rows. So the groups share one free pool,
    and a sliding-window group's table can let go of the blocks its window has left behind
    (`group_windows`) while a full-attention group's keeps them: a long sequence then holds ~W tokens
    in the windowed groups instead of its whole length. (vLLM's hybrid KV manager is built the same way.)
    Without sliding windows it is one group of every layer, one slot per layer: the plain paged pool.
    """

    layer_groups: tuple[int, ...]  # layer -> the group whose block table it reads
    layer_slots: tuple[int, ...]  # layer -> the pool tensor it reads and writes
    group_windows: tuple[int | None, ...]  # group -> its layers' window (blocks before it are released)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slots) + 1 if self.layer_slots else 0

    @classmethod
    def flat(cls, num_layers: int) -> KVLayout:
        """One group keeping every block, one slot per layer (windows or not: each layer masks its own)."""
        return cls((0,) * num_layers, tuple(range(num_layers)), (None,))

    @classmethod
    def for_windows(cls, layer_windows: Sequence[int | None]) -> KVLayout:
        """Groups by window, each of as many layers as the rarest window (or full attention) has: Gemma 3
        270M's 3 full and 15 local layers make 1 + 5 groups of 3. A kind whose count is not a multiple
        leaves its last group short (its slots past the end unused in that group's blocks)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if list(kinds) == [None]:
            return cls.flat(len(layer_windows))
        size = min(len(layers) for layers in kinds.values())
        layer_groups, layer_slots = [0] * len(layer_windows), [0] * len(layer_windows)
        group_windows: list[int | None] = []
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start : start + size]):
                    layer_groups[layer], layer_slots[layer] = len(group_windows), slot
                group_windows.append(window)
        return cls(tuple(layer_groups), tuple(layer_slots), tuple(group_windows))

    def slots_of(self, layers: range) -> list[int]:
        """The pool slots these layers read and write, in order."""
        return sorted({self.layer_slots[i] for i in layers})

    def group_layer_windows(self, layer_windows: Sequence[int | None]) -> tuple[frozenset[int | None], ...]:
        """The windows each group's layers use (the decode plans its table needs)."""
        return tuple(frozenset(w for w, g in zip(layer_windows, self.layer_groups, strict=True) if g == group)
                     for group in range(self.num_groups))


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, layout: KVLayout | None = None) -> list[KVCache]:
    """One zero-filled pool per slot, as each layer's (layers of one slot share it); flat by default.
    dtype: the pool's (the model's, or torch.int8 for the 8-bit pool)."""
    layout = layout or KVLayout.flat(config.num_hidden_layers)
    return layer_caches(layout, dict(kv_cache_slots(config, layout, num_blocks, block_size, dtype, device)))


def layer_caches(layout: KVLayout, slots: dict[int, KVCache]) -> list[KVCache | None]:
    """Each layer's pool, by its slot; None for a layer whose slot this rank did not allocate (a layer
    another pipeline stage holds)."""
    return [slots.get(slot) for slot in layout.layer_slots]


def kv_cache_slots(config: ModelConfig, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device, num_kv_heads: int | None = None,
                   layers: range | None = None) -> Iterator[tuple[int, KVCache]]:
    """(slot, its pool) one slot at a time: filling a pool with zeros takes a while where it touches every page
    (on CUDA), and a model loading beside others does it between their steps (LLMEngine.build_in_pieces).
    Tensor and pipeline parallel: a rank's own KV heads (num_kv_heads), and only the slots of its `layers`."""
    heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    shape = (heads, num_blocks, block_size, config.head_dim)
    for slot in layout.slots_of(range(config.num_hidden_layers) if layers is None else layers):
        pool = [_zeros(shape, dtype, device) for _ in range(2)]
        if dtype == torch.int8:
            pool += [_zeros(shape[:-1], KV_SCALE_DTYPE, device) for _ in range(2)]
        yield slot, KVCache(*pool)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU in anonymous memory, which Linux zero-fills a page at a time as it is first
    written. torch.zeros writes every page at once: a 4 GiB pool took ~1.5 s of a start and was resident before
    any request (docs/PERFORMANCE.md, "Time to ready: ... the KV pool's pages on first touch"). The tensor keeps the mapping alive."""
    if device.type != "cpu" or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 codes [..., head_dim], float16 scales [...]): each row rounded to the
    nearest of 255 levels of its own absmax. The codes are x times 1 / the float16-rounded scale (as
    csrc/kv_write.cpp computes them), so that code x scale is what a reader gets back; a row of zeros has
    scale 0 and codes 0."""
    scale = (x.abs().amax(dim=-1).float() * (1 / KV_INT8_MAX)).to(KV_SCALE_DTYPE)
    inverse = scale.float().masked_fill(scale == 0, 1.0).reciprocal().unsqueeze(-1)
    codes = (x.float() * inverse).round_().clamp_(-KV_INT8_MAX, KV_INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)


def _write(pool: torch.Tensor, pool_scale: torch.Tensor | None, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = x.shape[1], x.shape[2]
    if pool_scale is not None:
        x, scale = quantize_rows(x)
        pool_scale.view(num_kv_heads, -1).index_copy_(1, slot_mapping, scale.transpose(0, 1))
    pool.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, x.transpose(0, 1))


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots (an int8 pool:
    rounded, each row with its scale)."""
    _write(cache.key, cache.key_scale, key, slot_mapping)
    _write(cache.value, cache.value_scale, value, slot_mapping)


def gather_kv(cache: KVCache, block_table: torch.Tensor, seq_len: int, first: int = 0,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V at positions first .. seq_len - 1, each [num_kv_heads, seq_len - first,
    head_dim]. Only the blocks holding them are read (a sliding window's start need not be block-aligned).
    An int8 pool's rows come back as code x scale in `dtype` (float32 when None)."""
    num_kv_heads, _, block_size, head_dim = cache.key.shape
    blocks = block_table[first // block_size : -(-seq_len // block_size)]
    rows = slice(first % block_size, first % block_size + seq_len - first)

    def read(pool: torch.Tensor, pool_scale: torch.Tensor | None) -> torch.Tensor:
        x = pool[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, rows]
        if pool_scale is None:
            return x
        return dequantize_rows(x, pool_scale[:, blocks].reshape(num_kv_heads, -1)[:, rows], dtype or torch.float32)

    return read(cache.key, cache.key_scale), read(cache.value, cache.value_scale)
