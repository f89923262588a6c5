"""Paged attention (batched decodes + per-sequence prefill chunks, via SDPA) against the plain
reference and against dense causal attention, with scattered block tables and mixed lengths, with and
without a sliding window."""

import dataclasses

import pytest
import torch

from tinyserve.layers.kernels import cpu_kernels

from tinyserve.layers import ops
from tinyserve.layers.attention import causal_mask, paged_attention, reference_paged_attention
from tinyserve.layers.attention_metadata import AttentionMetadata, decode_group_bounds
from tinyserve.layers.kv_cache import KVCache, write_kv

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


def _dense_causal(q, k, v, scale, window=None):
    """Textbook attention over one whole sequence: q [L, H, D], k/v [L, KVH, D]. With a window, query i
    sees keys i - window + 1 .. i (transformers' Mistral: kv_idx > q_idx - window)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    if window is not None:
        mask &= torch.ones_like(mask).triu(1 - window)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def _build(seqs, dtype, seed=0, cpu_attention=False, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block=BLOCK,
           window=None, tables_out=None):
    """seqs: list of (cached_len, new_len). Blocks handed out in a shuffled order (scattered tables); each
    sequence's whole table is appended to `tables_out` (the step's window tables hold only the window's)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block) for c, n in seqs) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = KVCache(torch.zeros(kv_heads, num_blocks, block, head_dim, dtype=dtype),
                    torch.zeros(kv_heads, num_blocks, block, head_dim, dtype=dtype))
    full, tables, slots, q_parts, k_new, v_new = [], [], [], [], [], []
    for cached, new in seqs:
        total = cached + new
        n_blocks = -(-total // block)
        table = [order.pop() for _ in range(n_blocks)]
        tables.append(table)
        q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        full.append((q, k, v))
        seq_slots = torch.tensor([table[p // block] * block + p % block for p in range(total)])
        write_kv(cache, k[:cached], v[:cached], seq_slots[:cached])  # what earlier steps left in the cache
        slots.append(seq_slots[cached:])
        q_parts.append(q[cached:]); k_new.append(k[cached:]); v_new.append(v[cached:])
    meta = AttentionMetadata.build(
        [torch.cat(slots).tolist()], [tables], [c + n for c, n in seqs], [n for _, n in seqs], block_size=block,
        num_blocks=num_blocks, num_heads=heads, num_kv_heads=kv_heads, device=torch.device("cpu"),
        cpu_attention=cpu_attention, kv_caches=[cache], group_windows=[(window,)],
    )
    k_step, v_step = torch.cat(k_new), torch.cat(v_new)
    write_kv(cache, k_step, v_step, meta.groups[0].slot_mapping)
    if tables_out is not None:
        tables_out.extend(tables)
    return cache, meta, torch.cat(q_parts), k_step, v_step, full


# decodes first (query length 1), then prefill chunks with and without a cached prefix
MIXES = [
    [(7, 1), (0, 1), (12, 1)],
    [(0, 9), (5, 6), (3, 1)],  # a decode after prefills is handled as a one-token chunk
    [(15, 1), (1, 1), (0, 13), (8, 5), (21, 2)],
    # 40 decodes, longest first as the runner orders them: two groups, each padded to its own longest
    [(c, 1) for c in range(95, 15, -2)] + [(4, 6)],
]


def test_decode_kernel_builds_on_this_cpu():
    assert cpu_kernels.load() is not None  # g++ and ninja come with `make setup`
    assert ops.cpu_attention_applies(torch.device("cpu"), torch.bfloat16, HEAD_DIM)
    assert not ops.cpu_attention_applies(torch.device("cpu"), torch.float16, HEAD_DIM)
    assert not ops.cpu_attention_applies(torch.device("cpu"), torch.float32, 24)


@pytest.mark.parametrize("window", [None, 5, 1], ids=["full", "window-5", "window-1"])
@pytest.mark.parametrize("cpu_attention", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("seqs", MIXES)
def test_paged_equals_reference_and_dense(seqs, cpu_attention, window):
    """Window 5 over blocks of 4 starts mid-block; window 1 is each token alone."""
    cache, meta, q, k, v, full = _build(seqs, torch.float32, cpu_attention=cpu_attention, window=window)
    scale = HEAD_DIM**-0.5
    ours = paged_attention(q, cache, meta, meta.groups[0], scale, k, v, window)
    ref = reference_paged_attention(q, cache, meta, scale, window)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    start = 0
    for (cached, new), (fq, fk, fv) in zip(seqs, full):
        dense = _dense_causal(fq, fk, fv, scale, window)[cached:]
        torch.testing.assert_close(ours[start : start + new], dense, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("cpu_attention", [True, False], ids=["kernel", "torch-ops"])
def test_bfloat16_close_to_float32_reference(cpu_attention):
    seqs = [(9, 1), (2, 1), (40, 1), (0, 11), (6, 7)]
    cache, meta, q, k, v, _ = _build(seqs, torch.bfloat16, seed=3, cpu_attention=cpu_attention)
    scale = HEAD_DIM**-0.5
    ours = paged_attention(q, cache, meta, meta.groups[0], scale, k, v).float()
    ref = reference_paged_attention(q, cache, meta, scale).float()
    assert (ours - ref).abs().max().item() < 3e-2


@pytest.mark.parametrize("block", [8, 16, 48])
@pytest.mark.parametrize("heads, head_dim", [(9, 64), (6, 128), (24, 32)])
def test_bfloat16_decode_kernel_at_model_sizes(block, heads, head_dim):
    """The kernel in bfloat16 at the head sizes of real models (it is compiled per head size): blocks of
    8, 16 and 48 rows, lengths that end mid-block; 3 query heads per KV head (SmolLM2), 2, and 8."""
    seqs = [(c, 1) for c in (300, 47, 16, 15, 1, 0)]
    cache, meta, q, k, v, _ = _build(seqs, torch.bfloat16, seed=block + head_dim, cpu_attention=True, heads=heads,
                                     kv_heads=3, head_dim=head_dim, block=block)
    scale = head_dim**-0.5
    ours = paged_attention(q, cache, meta, meta.groups[0], scale, k, v).float()
    ref = reference_paged_attention(q, cache, meta, scale).float()
    assert (ours - ref).abs().max().item() < 2e-2


def test_causal_mask_offsets_by_cached_tokens():
    mask = causal_mask(2, 5, torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_causal_mask_with_a_window_from_a_first_key():
    """Queries at positions 3 and 4 with window 2: keys 2..3 and 3..4, over the keys from position 1 on."""
    mask = causal_mask(2, 5, torch.device("cpu"), window=2, first=1)
    assert mask.tolist() == [[False, True, True, False], [False, False, True, True]]


@pytest.mark.parametrize("cpu_attention", [True, False], ids=["kernel", "torch-ops"])
def test_a_window_reads_no_block_before_it(cpu_attention):
    """NaN in every block that ends before the window of a sequence's first query this step: the result
    must not change (a NaN read is never masked away: NaN + -inf is NaN). Block 0 is spared: it pads the
    block tables, and the decode groups read it (masked) past a short sequence's end."""
    window = 6
    seqs = [(30, 1), (17, 1), (3, 1), (20, 5), (9, 12), (0, 13)]
    tables = []
    cache, meta, q, k, v, full = _build(seqs, torch.float32, cpu_attention=cpu_attention, window=window,
                                        tables_out=tables)
    for i, (cached, _) in enumerate(seqs):
        for b in range(max(0, cached + 1 - window) // BLOCK):
            if tables[i][b] == 0:
                continue
            cache.key[:, tables[i][b]] = float("nan")
            cache.value[:, tables[i][b]] = float("nan")
            # the step's table holds only what the window reads: the entries before it are block 0
            assert meta.groups[0].block_tables[i, b] == 0
    ours = paged_attention(q, cache, meta, meta.groups[0], HEAD_DIM**-0.5, k, v, window)
    start = 0
    for (cached, new), (fq, fk, fv) in zip(seqs, full):
        dense = _dense_causal(fq, fk, fv, HEAD_DIM**-0.5, window)[cached:]
        torch.testing.assert_close(ours[start : start + new], dense, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 4, 7, 16, 500])
def test_decode_kernel_with_a_window_against_dense(window, dtype):
    """The kernel called directly: each sequence's last token against dense windowed attention, every
    key before its window NaN (also those sharing a block with the window's first key), so a kernel
    that read one would return NaN. Windows shorter than a block, unaligned, aligned, past every length."""
    seqs = [(c, 1) for c in (40, 23, 16, 15, 3, 0)]
    tables = []
    cache, meta, q, k, v, full = _build(seqs, dtype, seed=window, cpu_attention=True, window=window,
                                        tables_out=tables)
    for i, (cached, _) in enumerate(seqs):
        for p in range(max(0, cached + 1 - window)):
            block = tables[i][p // BLOCK]
            cache.key[:, block, p % BLOCK] = float("nan")
            cache.value[:, block, p % BLOCK] = float("nan")
    ours = cpu_kernels.paged_attention(q, cache.key, cache.value, meta.groups[0].block_tables, meta.seq_lens,
                                              HEAD_DIM**-0.5, window).float()
    dense = torch.stack([_dense_causal(fq.float(), fk.float(), fv.float(), HEAD_DIM**-0.5, window)[-1]
                         for fq, fk, fv in full])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, dense, atol=tolerance, rtol=tolerance)


def test_decode_kernel_refuses_a_window_below_one():
    q, cache, tables, seq_lens = _kernel_inputs()
    with pytest.raises(RuntimeError, match="window must be >= 1"):
        cpu_kernels.paged_attention(q, cache.key, cache.value, tables, seq_lens, 1.0, 0)


def test_decode_groups_split_evenly_and_pad_to_their_own_longest():
    assert decode_group_bounds([]) == []
    assert decode_group_bounds([9] * 15) == [(0, 15)]
    assert decode_group_bounds([9] * 40) == [(0, 20), (20, 40)]
    assert decode_group_bounds([9] * 100) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    seqs = [(c, 1) for c in range(95, 15, -2)]
    _, meta, *_ = _build(seqs, torch.float32)
    assert [(g.start, g.end) for g in meta.groups[0].decode_groups[None]] == [(0, 20), (20, 40)]
    # each group is padded to its own longest sequence (96 and 56 tokens), not to the step's longest
    assert meta.groups[0].decode_groups[None][0].bias.shape == (20, 1, 96)
    assert meta.groups[0].decode_groups[None][1].bias.shape == (20, 1, 56)
    # with a window of 5, each sequence gathers only the 2 blocks of 4 that its 5 keys can span
    _, meta, *_ = _build(seqs, torch.float32, window=5)
    assert [g.bias.shape for g in meta.groups[0].decode_groups[5]] == [(20, 1, 8), (20, 1, 8)]


def test_the_decode_plan_is_complete_before_the_forward():
    """Built once per step by the model runner and only read by the layers: the torch-op groups come with
    their value bags (one bag per kv head, sequence and query head of its group), and nothing can be set."""
    seqs = [(c, 1) for c in range(40, 0, -1)]
    _, meta, *_ = _build(seqs, torch.float32)
    for group in meta.groups[0].decode_groups[None]:
        num_seqs, width = group.end - group.start, group.bias.shape[-1]
        assert group.value_bags.numel() == KV_HEADS * num_seqs * (HEADS // KV_HEADS) * width
        assert group.value_bag_offsets.tolist() == list(range(0, group.value_bags.numel(), width))
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.groups[0].decode_groups[None][0].value_bags = None


def _kernel_inputs(with_meta=False):
    """Valid inputs for the C++ decode kernel, called directly (no metadata checks in front of it)."""
    seqs = [(9, 1), (4, 1), (0, 1)]  # 10, 5 and 1 tokens: 3, 2 and 1 blocks of 4
    cache, meta, q, *_ = _build(seqs, torch.float32, cpu_attention=True)
    inputs = q, cache, meta.groups[0].block_tables.clone(), meta.seq_lens.clone()
    return (*inputs, meta) if with_meta else inputs


def _decode(q, cache, tables, seq_lens):
    return cpu_kernels.paged_attention(q, cache.key, cache.value, tables, seq_lens, HEAD_DIM**-0.5)


def test_decode_kernel_accepts_the_valid_inputs():
    q, cache, tables, seq_lens, meta = _kernel_inputs(with_meta=True)
    torch.testing.assert_close(_decode(q, cache, tables, seq_lens),
                               reference_paged_attention(q, cache, meta, HEAD_DIM**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq, entry, block_id", [(0, 2, "num_blocks"), (1, 1, -1), (0, 0, 1 << 40)],
                         ids=["one-past-the-pool", "negative", "far-away"])
def test_decode_kernel_refuses_a_block_id_outside_the_pool(seq, entry, block_id):
    q, cache, tables, seq_lens = _kernel_inputs()
    tables[seq, entry] = cache.key.shape[1] if block_id == "num_blocks" else block_id
    with pytest.raises(RuntimeError, match=rf"block_tables\[{seq}\]\[{entry}\] = .* outside the pool"):
        _decode(q, cache, tables, seq_lens)


@pytest.mark.parametrize("seq_len", [0, -3, "past-the-table"])
def test_decode_kernel_refuses_a_length_outside_its_table(seq_len):
    q, cache, tables, seq_lens = _kernel_inputs()
    seq_lens[1] = tables.shape[1] * BLOCK + 1 if seq_len == "past-the-table" else seq_len
    with pytest.raises(RuntimeError, match=r"seq_lens\[1\] = .* is outside \[1, "):
        _decode(q, cache, tables, seq_lens)


def test_decode_kernel_refuses_zero_sizes_it_would_divide_by():
    """A pool with 0 kv heads or 0-token blocks: the kernel divides by both (a crash, not an error)."""
    q, cache, tables, seq_lens = _kernel_inputs()
    no_heads = torch.empty(0, *cache.key.shape[1:])
    no_rows = torch.empty(cache.key.shape[0], cache.key.shape[1], 0, HEAD_DIM)
    for pool in (no_heads, no_rows):
        with pytest.raises(RuntimeError, match="must be >= 1"):
            cpu_kernels.paged_attention(q, pool, pool, tables, seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="ranks"):
        _decode(q, cache, tables[0], seq_lens)  # a 1-d table


@pytest.mark.parametrize("cpu_attention", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("fault", [None, "block id past the pool", "negative block id", "length past the table",
                                   "slot past the pool"])
def test_metadata_refuses_tables_outside_the_pool(cpu_attention, fault):
    """Checked on the host once per step, before any layer indexes the pool with them (on CUDA an index
    out of range is a device-side assert that ends the process)."""
    block_tables, seq_lens, slots = [[3, 0], [1]], [6, 1], [5, 4]
    if fault == "block id past the pool":
        block_tables[0][1] = 4
    elif fault == "negative block id":
        block_tables[1][0] = -1
    elif fault == "length past the table":
        seq_lens[1] = BLOCK + 1
    elif fault == "slot past the pool":
        slots[0] = 4 * BLOCK

    def build():
        return AttentionMetadata.build([slots], [block_tables], seq_lens, [1, 1], block_size=BLOCK, num_blocks=4,
                                       num_heads=HEADS, num_kv_heads=KV_HEADS, device=torch.device("cpu"),
                                       cpu_attention=cpu_attention, kv_caches=[])

    if fault is None:
        assert build().num_decodes == 2
        return
    with pytest.raises(RuntimeError, match="scheduler bug"):
        build()


def _one_sequence_pool(length, dtype, seed=0, block=BLOCK):
    """q, k, v [length, ...] of one sequence and a pool holding all its K/V in scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-length // block) + 3
    table = torch.randperm(num_blocks, generator=gen)[: -(-length // block)]
    q, k, v = (torch.randn(length, h, HEAD_DIM, generator=gen).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = KVCache(torch.zeros(KV_HEADS, num_blocks, block, HEAD_DIM, dtype=dtype),
                    torch.zeros(KV_HEADS, num_blocks, block, HEAD_DIM, dtype=dtype))
    positions = torch.arange(length)
    write_kv(cache, k, v, table[positions // block] * block + positions % block)
    return q, cache, table


def _attend_in_steps(q, cache, table, chunks, window=None, soft_cap=None, beside=None):
    """The sequence's queries, chunk by chunk as steps would send them (each step sees the keys up to its last
    query); `beside`: (q row, table, length) of another sequence's decode in the same call, ahead of it."""
    outs, start = [], 0
    for n in chunks:
        rows, tables, lens = [q[start : start + n]], [table], [start + n]
        if beside is not None:
            rows.insert(0, beside[0]), tables.insert(0, beside[1]), lens.insert(0, beside[2])
        width = max(len(t) for t in tables)
        padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
        starts = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
        out = cpu_kernels.paged_attention(torch.cat(rows), cache.key, cache.value, padded, torch.tensor(lens),
                                          HEAD_DIM**-0.5, window, query_start_loc=starts, soft_cap=soft_cap)
        outs.append(out[len(rows[0]) :] if beside is not None else out)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (11, None), (None, 0.5)], ids=["full", "window-11", "capped"])
@pytest.mark.parametrize("block", [BLOCK, 16])
def test_a_query_s_output_does_not_depend_on_its_step(dtype, window, soft_cap, block):
    """Bit for bit: the whole prompt in one prefill, chunks across the kernel's 16-query tiles, one decode at a
    time, and beside another sequence's decode, each position's output is the same (what makes float32 tokens
    the same across batching, chunking and prefix-cache hits). Blocks of 16 take the kernel's eight-key dots
    where a block holds eight of a query's keys, one key at a time elsewhere: the same sums either way."""
    length = 45
    q, cache, table = _one_sequence_pool(length, dtype, block=block)
    whole = _attend_in_steps(q, cache, table, [length], window, soft_cap)
    other_q, other_cache, other_table = _one_sequence_pool(9, dtype, seed=1, block=block)
    assert not torch.equal(whole[:5], whole[5:10])  # the outputs differ from position to position
    for chunks in ([20, 25], [1, 16, 17, 11], [7] * 6 + [3], [1] * length):
        torch.testing.assert_close(_attend_in_steps(q, cache, table, chunks, window, soft_cap), whole, atol=0, rtol=0)
    # another sequence in the same call reads its own blocks of the same pool
    both = KVCache(torch.cat([cache.key, other_cache.key], 1), torch.cat([cache.value, other_cache.value], 1))
    beside = (other_q[8:9], other_table + cache.key.shape[1], 9)
    torch.testing.assert_close(_attend_in_steps(q, both, table, [30, 1, 14], window, soft_cap, beside), whole,
                               atol=0, rtol=0)


@pytest.mark.parametrize("cpu_attention", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("seqs", MIXES[:3])
def test_soft_capped_scores_match_the_reference(seqs, cpu_attention):
    """Gemma 2's logit soft-cap, c * tanh(s / c), before the softmax: decodes and chunks with a cached prefix."""
    cache, meta, q, k, v, _ = _build(seqs, torch.float32, seed=5, cpu_attention=cpu_attention)
    scale, cap = HEAD_DIM**-0.5, 0.5
    ours = paged_attention(q, cache, meta, meta.groups[0], scale, k, v, None, cap)
    torch.testing.assert_close(ours, reference_paged_attention(q, cache, meta, scale, soft_cap=cap), atol=1e-5,
                               rtol=1e-5)
    uncapped = reference_paged_attention(q, cache, meta, scale)
    assert (ours - uncapped).abs().max() > 1e-2  # the cap changed the answer


@pytest.mark.parametrize("starts, message", [([0, 1, 2, 4], "from 0 to q's 3 rows"), ([0, 1, 1, 3], "has 0 queries"),
                                             ([0, 1, 7, 3], "has 6 queries for 5 keys")])
def test_the_kernel_refuses_query_rows_that_do_not_tile_q(starts, message):
    q, cache, tables, seq_lens = _kernel_inputs()
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_attention(q, cache.key, cache.value, tables, seq_lens, 1.0,
                                    query_start_loc=torch.tensor(starts))
