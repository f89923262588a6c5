"""Paged KV-cache bookkeeping: which block ids each request holds, ref counts, and the prefix cache.

Pure Python over token ids; the model runner owns the actual K/V tensors and indexes them by block id.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Sequence

from tinyserve.engine.request import Request
from tinyserve.engine.stats import PrefixCacheStats

logger = logging.getLogger(__name__)


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained key of one full block: the same tokens after a different prefix get a different key."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class BlockManager:
    """A pool of `num_blocks` KV blocks of `block_size` token slots, shared by requests through ref counts.

    Invariants (checked by `check_invariants`, asserted at each ref-count change):
    - a block is free iff its ref_count is 0; num_free_blocks + used blocks == num_blocks;
    - ref_count of a block == number of block tables holding it (fork and prefix hits share blocks);
    - only full blocks are shared, so a request only ever writes into blocks it holds alone;
    - `_hash_to_block[h] == b` iff `_block_hashes[b] == h`.

    Free list order: an OrderedDict, initially block ids 0..num_blocks-1. Allocation takes from the
    front; `free` appends at the back, a request's blocks in reverse table order. So a freed block
    that keeps its hash stays reusable until every block freed before it has been reused (LRU), and a
    request's tail blocks are evicted before its head blocks, which they are useless without.

    Hash ownership: a block gets its hash in `cache_full_blocks(request)`, which the scheduler calls
    after each step, once all of the block's slots hold computed tokens. The hash is dropped only when
    the block is evicted, i.e. popped from the free list for fresh use. With prefix caching disabled
    no block ever gets a hash. `hash_seed` names the model, so two models' caches never match; a
    request's `cache_salt` enters the parent hash of its first block, so requests with different salts
    never share a block through the cache (None: the shared cache, hashed as without salts).

    Who frees: whoever owns the request (the scheduler) calls `free(request)` when it finishes, is
    aborted or is preempted; the block manager never frees on its own.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_seed: str = ""):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._root_hash = hashlib.sha256(b"tinyserve-prefix-cache:" + hash_seed.encode()).digest()
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
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
    def block_table(request: Request) -> list[int]:
        """The request's block ids in token order (read-only; empty when it holds none)."""
        return request.block_table

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list, next to be allocated first."""
        return list(self._free)

    def get_computed_prefix(self, request: Request) -> int:
        """Tokens (a multiple of block_size) of the request's longest cached prefix; no side effects.

        Never the whole request: its last token is always left to compute, so there are logits to sample.
        """
        return len(self._cached_prefix_blocks(request)) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        return self._plan(request, num_new_tokens, num_cached_tokens) is not None

    def allocate_slots(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Grow the request's table to cover num_computed_tokens + num_cached_tokens + num_new_tokens.

        num_cached_tokens (from get_computed_prefix, only for a request that holds no blocks yet) first
        takes the cached prefix blocks. Returns False, changing nothing, when the pool cannot cover it.
        """
        plan = self._plan(request, num_new_tokens, num_cached_tokens)
        if plan is None:
            return False
        cached_blocks, num_fresh = plan
        table = request.block_table
        was_empty = not table
        if was_empty:
            if self.enable_prefix_caching:
                self._count_prefix_query(request, len(cached_blocks))
            request.num_hashed_blocks = len(cached_blocks)
        for block_id in cached_blocks:  # before any fresh block, so eviction cannot take them
            self._take(block_id)
        table.extend(cached_blocks)
        table.extend(self._pop_fresh() for _ in range(num_fresh))
        if was_empty and table:  # a holder from its first block on, until free
            self._holders.add(request)
        return True

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Let the child (holding no blocks) share the parent's first num_blocks blocks, all full."""
        assert not child.block_table, f"{child} already holds blocks"
        assert num_blocks * self.block_size <= parent.num_computed_tokens, "only computed, full blocks are shared"
        shared = parent.block_table[:num_blocks]
        for block_id in shared:
            self._take(block_id)
        child.block_table = list(shared)
        child.num_hashed_blocks = num_blocks
        if shared:
            self._holders.add(child)

    def free(self, request: Request) -> None:
        """Drop the request's blocks (no-op for one that holds none, e.g. still waiting)."""
        table, request.block_table = request.block_table, []
        request.block_hashes, request.num_hashed_blocks = [], 0
        self._holders.discard(request)
        for block_id in reversed(table):
            assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                assert block_id not in self._free, f"block {block_id} already free"
                self._free[block_id] = None

    def cache_full_blocks(self, request: Request) -> None:
        """Give a hash to each of the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        table = request.block_table
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = request.num_hashed_blocks
        hashes = self._hashes_of(request, num_full)
        for i in range(start, num_full):
            block_id, block_hash = table[i], hashes[i]
            # NOTE: a block computed twice (two requests missed the cache in the same step) stays unhashed:
            # the first copy serves future hits, the duplicate is plain free space once freed.
            if self._block_hashes[block_id] is None and block_hash not in self._hash_to_block:
                self._block_hashes[block_id] = block_hash
                self._hash_to_block[block_hash] = block_id
        request.num_hashed_blocks = max(start, num_full)

    def check_invariants(self) -> None:
        """O(num_blocks) full check, for tests and debugging."""
        holders = [0] * self.num_blocks
        for request in self._holders:
            table = request.block_table
            assert len(set(table)) == len(table), f"{request} holds a block twice"
            for block_id in table:
                holders[block_id] += 1
        assert holders == self._ref_counts, "ref counts differ from block-table membership"
        used = sum(1 for count in self._ref_counts if count > 0)
        assert used + len(self._free) == self.num_blocks, "free + used != total"
        assert all(self._ref_counts[b] == 0 for b in self._free), "a free block is held"
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_hashes[block_id] == block_hash, "hash map out of sync"
        assert sum(h is not None for h in self._block_hashes) == len(self._hash_to_block), "stray hash"

    def _plan(self, request: Request, num_new_tokens: int, num_cached_tokens: int) -> tuple[list[int], int] | None:
        """(cached blocks to take, fresh blocks to pop), or None when the free pool is too small."""
        table = request.block_table
        cached_blocks: list[int] = []
        if num_cached_tokens:
            assert not table and request.num_computed_tokens == 0, "a cached prefix only starts a table"
            cached_blocks = self._cached_prefix_blocks(request)
            assert len(cached_blocks) * self.block_size == num_cached_tokens, "stale get_computed_prefix"
        num_total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_fresh = max(0, -(-num_total // self.block_size) - len(table) - len(cached_blocks))
        # cached blocks nobody holds sit in the free list: taking them uses up free blocks too
        num_cached_free = sum(1 for b in cached_blocks if self._ref_counts[b] == 0)
        if num_fresh + num_cached_free > len(self._free):
            return None
        return cached_blocks, num_fresh

    def _cached_prefix_blocks(self, request: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes_of(request, num_blocks)
        blocks = []
        for i in range(num_blocks):
            block_id = self._hash_to_block.get(hashes[i])
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

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

    def _pop_fresh(self) -> int:
        """The least recently freed block, evicted from the prefix cache if it was cached."""
        block_id, _ = self._free.popitem(last=False)
        assert self._ref_counts[block_id] == 0, f"free block {block_id} is held"
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hashes[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id
