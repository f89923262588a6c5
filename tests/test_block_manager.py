"""BlockManager at toy sizes (8 blocks of 4 tokens): exact block ids, ref counts and free-list order."""

import hashlib
import random

import pytest

from tinyserve.engine.scheduling.block_manager import BlockManager, hash_block
from tinyserve.engine.loop.request import Request
from tinyserve.types import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def compute(bm: BlockManager, request: Request, num_new: int) -> None:
    """What a step does to a request: its new tokens become computed, full blocks get hashed."""
    request.num_computed_tokens += num_new
    bm.cache_full_blocks(request)


def admit(bm: BlockManager, request: Request) -> int:
    """Allocate the whole request, reusing its cached prefix, and compute it. Returns the cached tokens."""
    num_cached = bm.get_computed_prefix(request)
    assert bm.allocate_slots(request, request.num_tokens - num_cached, num_cached)
    request.num_computed_tokens = num_cached
    compute(bm, request, request.num_tokens - num_cached)
    return num_cached


def refs(bm: BlockManager) -> list[int]:
    return [bm.ref_count(b) for b in range(bm.num_blocks)]


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(8, BLOCK_SIZE, enable_prefix_caching=True, hash_seed="toy-model")


def test_allocate_takes_blocks_from_the_front(bm):
    a = make_request("a", range(10))
    assert bm.can_allocate(a, 10)
    assert bm.allocate_slots(a, 10)
    assert bm.block_table(a) == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    bm.check_invariants()


def test_append_grows_by_one_block_across_the_boundary(bm):
    a = make_request("a", range(8))
    assert bm.allocate_slots(a, 8)
    compute(bm, a, 8)
    assert bm.block_table(a) == [0, 1]
    a.output_token_ids.append(100)  # token 9: the first slot of a new block
    assert bm.allocate_slots(a, 1)
    assert bm.block_table(a) == [0, 1, 2]
    compute(bm, a, 1)
    for token in (101, 102, 103):  # tokens 10..12 fill block 2
        a.output_token_ids.append(token)
        assert bm.allocate_slots(a, 1)
        compute(bm, a, 1)
    assert bm.block_table(a) == [0, 1, 2]
    a.output_token_ids.append(104)
    assert bm.allocate_slots(a, 1)
    assert bm.block_table(a) == [0, 1, 2, 3]
    bm.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing(bm):
    a = make_request("a", range(30))
    assert bm.allocate_slots(a, 30)  # 8 blocks: the whole pool
    b = make_request("b", range(100, 104))
    assert not bm.can_allocate(b, 4)
    assert not bm.allocate_slots(b, 4)
    assert bm.block_table(b) == [] and bm.num_free_blocks == 0
    a.output_token_ids += [7, 7, 7]
    a.num_computed_tokens = 30
    assert not bm.allocate_slots(a, 3)  # 33 tokens need a 9th block
    assert bm.block_table(a) == list(range(8))
    bm.check_invariants()


def test_fork_shares_blocks_and_free_order(bm):
    parent = make_request("p", range(10))
    admit(bm, parent)
    assert bm.block_table(parent) == [0, 1, 2]
    child = make_request("c", range(10))
    bm.fork(parent, child, 2)
    assert bm.block_table(child) == [0, 1]
    assert refs(bm)[:3] == [2, 2, 1]
    child.num_computed_tokens = 8
    assert bm.allocate_slots(child, 2)  # the child writes its own tail, never a shared block
    assert bm.block_table(child) == [0, 1, 3]
    bm.free(parent)
    assert refs(bm) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert bm.free_block_ids() == [4, 5, 6, 7, 2]
    bm.free(child)  # reverse table order: the tail goes before the head
    assert bm.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert refs(bm) == [0] * 8
    bm.free(child)  # holds nothing any more: a no-op, never a double free
    bm.check_invariants()


def test_prefix_hit_reuses_exact_block_ids(bm):
    a = make_request("a", range(10))
    assert admit(bm, a) == 0
    b = make_request("b", list(range(10)) + [50, 51])
    assert bm.get_computed_prefix(b) == 8  # a's two full blocks; its third (2 tokens) is not cached
    assert admit(bm, b) == 8
    assert bm.block_table(b) == [0, 1, 3]
    assert refs(bm)[:4] == [2, 2, 1, 1]
    stats = bm.prefix_stats
    assert (stats.num_query_blocks, stats.num_hit_blocks) == (2 + 2, 2)
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (10 + 12, 8)
    bm.check_invariants()


def test_prefix_hit_never_covers_the_whole_prompt(bm):
    admit(bm, make_request("a", range(8)))
    # the same 8 tokens: the last one must be computed to get logits, so only the first block is reused
    assert bm.get_computed_prefix(make_request("b", range(8))) == 4
    assert bm.get_computed_prefix(make_request("c", range(9))) == 8


def test_freed_cached_blocks_are_reused_then_evicted_lru(bm):
    a = make_request("a", range(8))
    b = make_request("b", range(100, 108))
    admit(bm, a)
    admit(bm, b)
    assert bm.block_table(a) == [0, 1] and bm.block_table(b) == [2, 3]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8  # cached blocks count as free
    assert bm.free_block_ids() == [4, 5, 6, 7, 1, 0, 3, 2]
    c = make_request("c", range(200, 220))  # 5 fresh blocks: evicts a's tail block 1, least recently freed
    admit(bm, c)
    assert bm.block_table(c) == [4, 5, 6, 7, 1]
    assert bm.get_computed_prefix(make_request("a2", list(range(8)) + [9])) == 4  # block 0 survived
    b2 = make_request("b2", list(range(100, 108)) + [9])
    assert admit(bm, b2) == 8
    assert bm.block_table(b2) == [2, 3, 0]  # block 0 was the only free block left: evicted now
    assert bm.get_computed_prefix(make_request("a3", list(range(8)) + [9])) == 0
    bm.check_invariants()


def test_taking_cached_free_blocks_counts_against_the_free_pool(bm):
    a = make_request("a", range(8))
    admit(bm, a)
    bm.free(a)
    assert bm.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    filler = make_request("f", range(300, 324))
    assert bm.allocate_slots(filler, 24)  # 6 blocks: only a's two cached blocks stay free
    assert bm.free_block_ids() == [1, 0]
    longer = make_request("l", list(range(8)) + [5])
    assert bm.get_computed_prefix(longer) == 8
    assert not bm.can_allocate(longer, 1, 8)  # both cached blocks + one fresh > 2 free
    same = make_request("s", range(8))
    assert bm.get_computed_prefix(same) == 4
    assert bm.allocate_slots(same, 4, 4)  # takes cached block 0 first, then block 1 fresh (evicting it)
    assert bm.block_table(same) == [0, 1]
    assert bm.get_computed_prefix(make_request("x", list(range(8)) + [5])) == 4
    bm.check_invariants()


def test_hashes_chain_over_the_prefix(bm):
    admit(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # same second block after a different first block: no match
    assert bm.get_computed_prefix(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == 0
    assert bm.get_computed_prefix(make_request("c", [1, 2, 3, 4, 9, 9, 9, 9, 0])) == 4
    assert hash_block(b"x", [1, 2]) != hash_block(b"y", [1, 2])
    assert hash_block(b"x", [1, 2]) == hash_block(b"x", [1, 2])


def test_hash_seed_separates_models():
    tokens = list(range(9))
    first = BlockManager(8, BLOCK_SIZE, True, hash_seed="model-a")
    second = BlockManager(8, BLOCK_SIZE, True, hash_seed="model-b")
    admit(first, make_request("a", tokens))
    admit(second, make_request("a", tokens))
    assert first._block_hashes[0] != second._block_hashes[0]
    assert set(first._hash_to_block).isdisjoint(second._hash_to_block)


def test_cache_salt_separates_tenants_and_none_keeps_the_unsalted_chain(bm):
    tokens = list(range(9))
    admit(bm, make_request("a", tokens))
    # None is the shared cache, hashed exactly as before salts existed: the chain from the seed's root
    root = hashlib.sha256(b"tinyserve-prefix-cache:toy-model").digest()
    first = hash_block(root, tokens[:4])
    assert bm._block_hashes[:2] == [(0, first), (0, hash_block(first, tokens[4:8]))]  # (group, hash)
    salted = Request("s", tokens, SamplingParams(), cache_salt="tenant-1")
    assert bm.get_computed_prefix(salted) == 0
    admit(bm, salted)
    assert bm.get_computed_prefix(Request("t", tokens, SamplingParams(), cache_salt="tenant-1")) == 8
    assert bm.get_computed_prefix(Request("u", tokens, SamplingParams(), cache_salt="tenant-2")) == 0
    assert bm.get_computed_prefix(make_request("v", tokens)) == 8  # the shared entries are still there
    bm.check_invariants()


def test_prefix_caching_disabled_never_hashes():
    bm = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False, hash_seed="m")
    admit(bm, make_request("a", range(9)))
    assert bm.get_computed_prefix(make_request("b", range(9))) == 0
    assert bm.prefix_stats.num_query_tokens == 0
    bm.check_invariants()


class Simulation:
    """Drives a BlockManager like a scheduler would and mirrors the KV contents of each group's blocks, so a
    wrong prefix hit, a write into a shared block or a window block released too early shows up as a content
    mismatch."""

    PREFIXES = [list(range(i * 100, i * 100 + 12)) for i in range(3)]

    def __init__(self, seed: int, num_blocks: int = 16, group_windows: tuple = (None,)):
        self.rng = random.Random(seed)
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True, hash_seed="sim",
                               group_windows=group_windows)
        self.live: dict[str, Request] = {}
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id whose K/V it holds
        self.next_id = 0
        self.num_hits = 0
        self.num_failed_forks = 0
        self.num_checks_with_releases = 0  # checks that saw a live request holding released entries

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def write(self, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        for group, table in enumerate(request.block_tables):
            assert request.num_released_blocks[group] <= start // BLOCK_SIZE, "a write into a released entry"
            for pos in range(start, start + num_new):
                block_id = table[pos // BLOCK_SIZE]
                assert self.bm.ref_count(block_id) == 1, "write into a shared block"
                self.kv[(block_id, pos % BLOCK_SIZE)] = request.all_token_ids[pos]
        compute(self.bm, request, num_new)

    def check_reused(self, request: Request) -> None:
        """Every position the next step reads holds the request's own token."""
        computed = request.num_computed_tokens
        for group, (table, released) in enumerate(zip(request.block_tables, request.num_released_blocks)):
            window = self.bm.group_windows[group]
            first = 0 if window is None else max(0, computed + 1 - window)
            assert released * BLOCK_SIZE <= first, "a block the next query reads was released"
            for pos in range(first, computed):
                assert self.kv[(table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)] == request.all_token_ids[pos]

    def op_new(self) -> None:
        prefix = self.rng.choice(self.PREFIXES)[: self.rng.randint(0, 12)]
        request = make_request(self.new_id(), prefix + [self.rng.randrange(5) for _ in range(self.rng.randint(1, 6))])
        num_cached = self.bm.get_computed_prefix(request)
        num_new = self.rng.randint(1, request.num_tokens - num_cached)
        if self.bm.allocate_slots(request, num_new, num_cached):
            request.num_computed_tokens = num_cached
            self.num_hits += num_cached > 0
            self.check_reused(request)
            self.live[request.request_id] = request
            self.write(request, num_new)

    def op_append(self, request: Request) -> None:
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(self.rng.randrange(5))
        num_new = self.rng.randint(1, request.num_tokens - request.num_computed_tokens)
        if self.bm.allocate_slots(request, num_new):
            self.check_reused(request)
            self.write(request, num_new)

    def op_fork(self, parent: Request) -> None:
        child = make_request(self.new_id(), parent.all_token_ids)
        num_blocks = self.rng.randint(0, min(parent.num_computed_tokens, child.num_tokens - 1) // BLOCK_SIZE)
        if not self.bm.fork(parent, child, num_blocks):
            assert child.block_tables == [] and child.num_released_blocks == []
            self.num_failed_forks += 1
            return
        child.num_computed_tokens = num_blocks * BLOCK_SIZE
        self.check_reused(child)
        self.live[child.request_id] = child

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.3 or not self.live:
            self.op_new()
            return
        request = self.live[self.rng.choice(sorted(self.live))]
        if roll < 0.7:
            self.op_append(request)
        elif roll < 0.8:
            self.op_fork(request)
        else:
            self.bm.free(self.live.pop(request.request_id))

    def check(self) -> None:
        self.bm.check_invariants()
        free = self.bm.free_block_ids()
        assert len(free) == len(set(free)), "a block is on the free list twice"
        holders = [0] * self.bm.num_blocks
        for request in self.live.values():
            for table, released in zip(request.block_tables, request.num_released_blocks):
                for block_id in table[released:]:
                    holders[block_id] += 1
        assert holders == refs(self.bm)
        self.num_checks_with_releases += any(any(r.num_released_blocks) for r in self.live.values())
        used = {b for b in range(self.bm.num_blocks) if holders[b]}
        assert used.isdisjoint(free) and len(used) + len(free) == self.bm.num_blocks


def test_randomized_operations_keep_invariants():
    sim = Simulation(seed=1234)
    for _ in range(10_000):
        sim.step()
        sim.check()
    assert sim.num_hits > 100  # the mix really exercised the prefix cache
    for request in list(sim.live.values()):
        sim.bm.free(request)
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    sim.bm.check_invariants()


def test_randomized_operations_keep_invariants_with_sliding_window_groups():
    """A full-attention group beside two window groups (6 and 9 tokens over 4-token blocks): releases, hits
    that need the window's blocks, and forks the parent's releases refuse."""
    sim = Simulation(seed=99, num_blocks=40, group_windows=(6, None, 9))
    for _ in range(10_000):
        sim.step()
        sim.check()
    assert sim.num_hits > 100 and sim.num_failed_forks > 10
    assert sim.num_checks_with_releases > 1000, "too few releases: the test would not see a wrong one"
    for request in list(sim.live.values()):
        sim.bm.free(request)
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
    sim.bm.check_invariants()


def test_a_window_group_releases_the_blocks_its_window_left_behind():
    """Window of 8 over 4-token blocks: once 20 tokens are cached, the next query (position 20) reads keys
    13..20, so blocks 0-2 (tokens 0-11) go back to the pool; the full-attention group keeps all of its."""
    bm = BlockManager(16, BLOCK_SIZE, hash_seed="m", group_windows=(None, 8))
    a = make_request("a", range(20))
    admit(bm, a)
    assert [len(t) for t in a.block_tables] == [5, 5] and bm.num_free_blocks == 6
    window_table = list(a.block_tables[1])
    a.output_token_ids.append(7)
    assert bm.allocate_slots(a, 1)
    assert a.num_released_blocks == [0, 3]
    assert a.block_tables[1][:3] == [0, 0, 0] and a.block_tables[1][3:5] == window_table[3:5]
    assert bm.num_held_blocks(a) == 6 + 3 and bm.num_free_blocks == 16 - 9
    assert all(bm.ref_count(b) == 0 for b in window_table[:3])
    assert bm.free_block_ids()[-3:] == window_table[:3]  # released blocks queue at the back, keeping their hash
    bm.check_invariants()
    bm.free(a)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_blocks_needed_counts_the_window_and_the_chunk():
    bm = BlockManager(64, BLOCK_SIZE, group_windows=(None, 8))
    assert bm.blocks_needed(100, 1) == 25 + 3  # 8 keys span at most 3 blocks of 4
    assert bm.blocks_needed(100, 16) == 25 + 7  # 7 + 16 = 23 positions over at most 7 blocks
    assert bm.blocks_needed(6, 16) == 2 + 2  # never more than the sequence has


def test_a_prefix_hit_takes_only_the_window_blocks_the_next_query_reads():
    bm = BlockManager(16, BLOCK_SIZE, hash_seed="m", group_windows=(None, 8))
    a = make_request("a", range(17))
    admit(bm, a)
    full_blocks, window_blocks = a.block_tables[0][:4], a.block_tables[1][:4]
    bm.free(a)
    b = make_request("b", range(17))
    # 16 cached tokens: the query at 16 reads keys 9..16, so window blocks 2 and 3 (tokens 8-15) are taken
    assert admit(bm, b) == 16
    assert b.block_tables[0][:4] == full_blocks
    assert b.block_tables[1][:4] == [0, 0, *window_blocks[2:4]] and b.num_released_blocks == [0, 2]
    assert bm.num_held_blocks(b) == 5 + 3
    bm.check_invariants()


def test_a_prefix_hit_shrinks_to_where_the_window_blocks_are_still_cached():
    """The window group's block 3 was evicted: a 16-token hit would need it; a 12-token hit needs window
    blocks 1 and 2 only (keys 5..12), which are still cached."""
    bm = BlockManager(10, BLOCK_SIZE, hash_seed="m", group_windows=(8, None))
    a = make_request("a", range(17))
    admit(bm, a)
    bm.free(a)  # free list: the window group's blocks 4..0, then the full group's 4..0
    filler = make_request("filler", [999] * 8)
    assert bm.allocate_slots(filler, 1)  # pops two blocks (one per group): the window group's 4 and 3
    bm.free(filler)  # back unhashed: evicted
    b = make_request("b", range(17))
    assert bm.get_computed_prefix(b) == 12
    assert admit(bm, b) == 12
    assert b.num_released_blocks == [1, 0]
    bm.check_invariants()


def test_a_fork_is_refused_when_the_parent_released_a_block_the_child_needs():
    bm = BlockManager(32, BLOCK_SIZE, hash_seed="m", group_windows=(None, 8))
    parent = make_request("p", range(20))
    admit(bm, parent)
    for token in range(3):  # decode 3: the last allocation, at 22 cached tokens, reads keys from 15 (block 3)
        parent.output_token_ids.append(token)
        assert bm.allocate_slots(parent, 1)
        compute(bm, parent, 1)
    assert parent.num_released_blocks == [0, 3]
    child = make_request("c", range(20))
    # sharing 4 blocks: the child's next query (16) reads keys 9.., block 2, which the parent let go of
    assert not bm.fork(parent, child, 4)
    assert child.block_tables == [] and bm.num_held_blocks(parent) == 6 + 3
    # sharing all 5 (20 tokens): keys from 13, block 3 on, which the parent still holds
    assert bm.fork(parent, child, 5)
    assert child.block_tables[1] == [0, 0, 0, *parent.block_tables[1][3:5]]
    bm.check_invariants()
