"""Paged KV-cache bookkeeping: which block ids each request holds, ref counts, and the prefix cache.

Pure Python over token ids; the model runner owns the actual K/V tensors and indexes them by block id.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tinyserve.engine.loop.request import Request
from tinyserve.engine.observability.stats import PrefixCacheStats

logger = logging.getLogger(__name__)


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained key of one full block: the same tokens after a different prefix get a different key."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def blocks_held(group_windows: Sequence[int | None], num_tokens: int, chunk: int, block_size: int) -> int:
    """The most blocks a sequence of num_tokens holds at once over all its tables, computed in chunks of at
    most `chunk` tokens: a window group's chunk from c reads keys c + 1 - W .. c + chunk - 1 (W - 1 + chunk
    positions, over at most one block more than they fill), a full group's all."""
    blocks = -(-num_tokens // block_size)
    return sum(blocks if w is None else min(blocks, -(-(w - 1 + chunk) // block_size) + 1) for w in group_windows)


@dataclass
class _Plan:
    """What allocate_slots will do, per KV group: nothing changes until it is applied."""

    release_to: list[int]  # table entries before this are released (sliding-window groups)
    cached: list[list[int]] | None  # cached blocks taken after `num_released` placeholders, or None
    num_released: list[int]  # with cached blocks: the placeholders before them
    num_fresh: list[int]


class BlockManager:
    """A pool of `num_blocks` KV blocks of `block_size` token slots, shared by requests through ref counts.

    KV groups (layers/kv_cache.py, KVLayout): a request holds one block table per group, all of one
    length (a block per block_size tokens), drawn from the one free pool. A group of sliding-window
    layers (`group_windows`) releases the leading blocks its window has left behind: before each
    allocation, every block wholly before the first key the step's first query reads goes back to the
    pool, and its table entry becomes a placeholder (block 0, never read; `request.num_released_blocks`
    counts them). So a long sequence holds about W tokens of blocks in such a group.

    Invariants (checked by `check_invariants`, asserted at each ref-count change):
    - a block is free iff its ref_count is 0; num_free_blocks + used blocks == num_blocks;
    - ref_count of a block == number of table entries past the placeholders holding it (fork and prefix
      hits share blocks);
    - only full blocks are shared, so a request only ever writes into blocks it holds alone;
    - `_hash_to_block[key] == b` iff `_block_hashes[b] == key`.

    Free list order: an OrderedDict, initially block ids 0..num_blocks-1. Allocation takes from the
    front; `free` appends at the back, a request's blocks in reverse table order. So a freed block
    that keeps its hash stays reusable until every block freed before it has been reused (LRU), and a
    request's tail blocks are evicted before its head blocks, which they are useless without.

    Hash ownership: a block gets its hash in `cache_full_blocks(request)`, which the scheduler calls
    after each step, once all of the block's slots hold computed tokens. The hash is dropped only when
    the block is evicted, i.e. popped from the free list for fresh use; a released block keeps it. With
    prefix caching disabled no block ever gets a hash. A key is (group, chained hash): each group's
    blocks hold other layers. `hash_seed` names the model, so two models' caches never match; a
    request's `cache_salt` enters the parent hash of its first block, so requests with different salts
    never share a block through the cache (None: the shared cache, hashed as without salts). A hit of k
    blocks needs every full-attention group's first k blocks and each window group's blocks from the
    first one the next query reads up to k.

    Who frees: whoever owns the request (the scheduler) calls `free(request)` when it finishes, is
    aborted or is preempted; apart from window releases the block manager never frees on its own.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_seed: str = "",
                 group_windows: Sequence[int | None] = (None,)):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self._root_hash = hashlib.sha256(b"tinyserve-prefix-cache:" + hash_seed.encode()).digest()
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[tuple[int, bytes] | None] = [None] * num_blocks
        self._hash_to_block: dict[tuple[int, bytes], int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._holders: set[Request] = set()  # requests holding blocks, for check_invariants only
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including cached ones that will be evicted on demand."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix-cache hash, held or free (a free one is reused until it is evicted)."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @staticmethod
    def block_table(request: Request, group: int = 0) -> list[int]:
        """One group's block ids in token order (read-only; empty when it holds none)."""
        return request.block_tables[group] if request.block_tables else []

    @staticmethod
    def num_held_blocks(request: Request) -> int:
        return sum(len(t) - r for t, r in zip(request.block_tables, request.num_released_blocks, strict=True))

    def blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of num_tokens holds at once, computed in chunks of at most `chunk`."""
        return blocks_held(self.group_windows, num_tokens, chunk, self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list, next to be allocated first."""
        return list(self._free)

    def get_computed_prefix(self, request: Request) -> int:
        """Tokens (a multiple of block_size) of the request's longest cached prefix; no side effects.

        Never the whole request: its last token is always left to compute, so there are logits to sample.
        """
        return self._cached_prefix(request)[0] * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        return self._plan(request, num_new_tokens, num_cached_tokens) is not None

    def allocate_slots(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Grow the request's tables to cover num_computed_tokens + num_cached_tokens + num_new_tokens,
        first releasing what its window groups have left behind.

        num_cached_tokens (from get_computed_prefix, only for a request that holds no blocks yet) first
        takes the cached prefix blocks. Returns False, changing nothing, when the pool cannot cover it.
        """
        plan = self._plan(request, num_new_tokens, num_cached_tokens)
        if plan is None:
            return False
        was_empty = not request.block_tables
        if was_empty:
            request.block_tables = [[] for _ in self.group_windows]
            request.num_released_blocks = [0] * len(self.group_windows)
            num_hit = len(plan.cached[0]) + plan.num_released[0] if plan.cached else 0
            if self.enable_prefix_caching:
                self._count_prefix_query(request, num_hit)
            request.num_hashed_blocks = num_hit
        for group, table in enumerate(request.block_tables):
            if plan.cached:  # before any fresh block, so eviction cannot take them
                for block_id in plan.cached[group]:
                    self._take(block_id)
                table.extend([0] * plan.num_released[group] + plan.cached[group])
                request.num_released_blocks[group] = plan.num_released[group]
            self._free_entries(request, group, plan.release_to[group])
        for group, table in enumerate(request.block_tables):
            table.extend(self._pop_fresh() for _ in range(plan.num_fresh[group]))
        if was_empty and request.block_tables[0]:  # a holder from its first block on, until free
            self._holders.add(request)
        elif was_empty:
            request.block_tables, request.num_released_blocks = [], []
        return True

    def fork(self, parent: Request, child: Request, num_blocks: int) -> bool:
        """Let the child (holding no blocks) share the parent's first num_blocks blocks, all full. False,
        changing nothing, when a window group of the parent has released a block the child still needs."""
        assert not child.block_tables, f"{child} already holds blocks"
        assert num_blocks * self.block_size <= parent.num_computed_tokens, "only computed, full blocks are shared"
        if num_blocks == 0:
            return True
        first = [self._first_needed(group, num_blocks * self.block_size) for group in range(len(self.group_windows))]
        if any(released > f for released, f in zip(parent.num_released_blocks, first, strict=True)):
            return False
        child.block_tables, child.num_released_blocks = [], []
        for table, f in zip(parent.block_tables, first, strict=True):
            shared = table[f:num_blocks]
            for block_id in shared:
                self._take(block_id)
            child.block_tables.append([0] * f + shared)
            child.num_released_blocks.append(f)
        child.num_hashed_blocks = num_blocks
        self._holders.add(child)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's blocks (no-op for one that holds none, e.g. still waiting)."""
        tables, request.block_tables = request.block_tables, []
        released, request.num_released_blocks = request.num_released_blocks, []
        request.block_hashes, request.num_hashed_blocks = [], 0
        self._holders.discard(request)
        for table, first in zip(tables, released, strict=True):
            for block_id in reversed(table[first:]):
                self._unref(block_id)

    def cache_full_blocks(self, request: Request) -> None:
        """Give a hash to each of the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching or not request.block_tables:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_tables[0]))
        start = request.num_hashed_blocks
        hashes = self._hashes_of(request, num_full)
        for group, (table, released) in enumerate(zip(request.block_tables, request.num_released_blocks)):
            for i in range(max(start, released), num_full):
                block_id, key = table[i], (group, hashes[i])
                # NOTE: a block computed twice (two requests missed the cache in the same step) stays
                # unhashed: the first copy serves future hits, the duplicate is plain free space once freed.
                if self._block_hashes[block_id] is None and key not in self._hash_to_block:
                    self._block_hashes[block_id] = key
                    self._hash_to_block[key] = block_id
        request.num_hashed_blocks = max(start, num_full)

    def check_invariants(self) -> None:
        """O(num_blocks) full check, for tests and debugging."""
        holders = [0] * self.num_blocks
        for request in self._holders:
            lengths = {len(t) for t in request.block_tables}
            assert len(request.block_tables) == len(self.group_windows) and len(lengths) == 1, \
                f"{request}'s tables differ in length or count"
            live = [b for t, r in zip(request.block_tables, request.num_released_blocks) for b in t[r:]]
            assert len(set(live)) == len(live), f"{request} holds a block twice"
            for block_id in live:
                holders[block_id] += 1
        assert holders == self._ref_counts, "ref counts differ from block-table membership"
        used = sum(1 for count in self._ref_counts if count > 0)
        assert used + len(self._free) == self.num_blocks, "free + used != total"
        assert all(self._ref_counts[b] == 0 for b in self._free), "a free block is held"
        for key, block_id in self._hash_to_block.items():
            assert self._block_hashes[block_id] == key, "hash map out of sync"
        assert sum(h is not None for h in self._block_hashes) == len(self._hash_to_block), "stray hash"

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first table entry the group's layers read once num_computed tokens are cached: the block
        of the next query's first key (0 for full attention)."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_computed + 1 - window) // self.block_size

    def _plan(self, request: Request, num_new_tokens: int, num_cached_tokens: int) -> _Plan | None:
        """Per group: what to release, the cached blocks to take, the fresh ones to pop; None when the
        free pool (with what the releases free) is too small."""
        tables = request.block_tables
        cached, num_released = None, [0] * len(self.group_windows)
        if num_cached_tokens:
            assert not tables and request.num_computed_tokens == 0, "a cached prefix only starts a table"
            num_hit, cached, num_released = self._cached_prefix(request)
            assert num_hit * self.block_size == num_cached_tokens, "stale get_computed_prefix"
        start = request.num_computed_tokens + num_cached_tokens
        num_blocks = -(-(start + num_new_tokens) // self.block_size)
        release_to, num_fresh = [], []
        num_needed = num_freed = 0
        for group in range(len(self.group_windows)):
            if tables:
                first, length = request.num_released_blocks[group], len(tables[group])
            else:
                first = num_released[group]
                length = first + (len(cached[group]) if cached else 0)
            end = max(first, min(self._first_needed(group, start), length))
            if tables:  # blocks only this request holds come free
                num_freed += sum(1 for b in tables[group][first:end] if self._ref_counts[b] == 1)
            release_to.append(end)
            num_fresh.append(max(0, num_blocks - length))
            # cached blocks nobody holds sit in the free list: taking them uses up free blocks too
            if cached:
                num_needed += sum(1 for b in cached[group] if self._ref_counts[b] == 0)
        if sum(num_fresh) + num_needed > len(self._free) + num_freed:
            return None
        return _Plan(release_to, cached, num_released, num_fresh)

    def _free_entries(self, request: Request, group: int, end: int) -> None:
        """Release the group's table entries before `end` that are still held."""
        table, first = request.block_tables[group], request.num_released_blocks[group]
        for i in range(first, end):
            self._unref(table[i])
            table[i] = 0
        request.num_released_blocks[group] = max(first, end)

    def _cached_prefix(self, request: Request) -> tuple[int, list[list[int]] | None, list[int]]:
        """(k, each group's cached blocks, the placeholders before them) of the longest hit of k blocks."""
        num_groups = len(self.group_windows)
        if not self.enable_prefix_caching:
            return 0, None, [0] * num_groups
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes_of(request, max_blocks)
        found: list[list[int | None]] = [[] for _ in range(num_groups)]
        limit = max_blocks
        for group, window in enumerate(self.group_windows):  # full attention: a run from the first block
            if window is None:
                for i in range(limit):
                    block_id = self._hash_to_block.get((group, hashes[i]))
                    if block_id is None:
                        limit = i
                        break
                    found[group].append(block_id)
        runs: dict[int, list[int]] = {}  # window groups: cached blocks in a row ending at each index
        for group, window in enumerate(self.group_windows):
            if window is not None:
                found[group] = [self._hash_to_block.get((group, h)) for h in hashes[:limit]]
                run = runs[group] = []
                for block_id in found[group]:
                    run.append(run[-1] + 1 if run and block_id is not None else int(block_id is not None))
        num_hit = next((k for k in range(limit, 0, -1)
                        if all(runs[g][k - 1] >= k - self._first_needed(g, k * self.block_size) for g in runs)), 0)
        num_released = [self._first_needed(g, num_hit * self.block_size) for g in range(num_groups)]
        return num_hit, [found[g][first:num_hit] for g, first in enumerate(num_released)], num_released

    def _hashes_of(self, request: Request, num_blocks: int) -> list[bytes]:
        """Chained hashes of (at least) the request's first num_blocks full blocks, memoized: its tokens
        only grow, so a full block's hash never changes."""
        hashes = request.block_hashes
        token_ids = request.all_token_ids if len(hashes) < num_blocks else []
        while len(hashes) < num_blocks:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else self._first_parent_hash(request.cache_salt)
            hashes.append(hash_block(parent, token_ids[start : start + self.block_size]))
        return hashes

    def _first_parent_hash(self, cache_salt: str | None) -> bytes:
        if cache_salt is None:
            return self._root_hash
        # a digest, never token bytes: no salt and token sequence can produce the same chain
        salt = cache_salt.encode("utf-8", "surrogatepass")
        return hashlib.sha256(self._root_hash + b"cache_salt:" + salt).digest()

    def _count_prefix_query(self, request: Request, num_hit_blocks: int) -> None:
        stats = self.prefix_stats
        stats.num_query_blocks += (request.num_tokens - 1) // self.block_size
        stats.num_hit_blocks += num_hit_blocks
        stats.num_query_tokens += request.num_tokens
        stats.num_hit_tokens += num_hit_blocks * self.block_size

    def _take(self, block_id: int) -> None:
        """One more holder of an existing (cached or shared) block."""
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _unref(self, block_id: int) -> None:
        """One holder fewer; the last one's leaving puts the block at the back of the free list."""
        assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            assert block_id not in self._free, f"block {block_id} already free"
            self._free[block_id] = None

    def _pop_fresh(self) -> int:
        """The least recently freed block, evicted from the prefix cache if it was cached."""
        block_id, _ = self._free.popitem(last=False)
        assert self._ref_counts[block_id] == 0, f"free block {block_id} is held"
        key = self._block_hashes[block_id]
        if key is not None:
            del self._hash_to_block[key]
            self._block_hashes[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id
