"""Paged attention in one Triton kernel for every step shape (decodes, prefill chunks, verify rows): each
program takes a tile of one sequence's query tokens for the query heads of one KV head, and walks that
sequence's keys in place through its block table (no gather, no copy of the cached prefix), with an
online softmax in float32. The GPU path (ops.paged_kernel_applies); on CPU it runs in Triton's
interpreter (TRITON_INTERPRET=1, set before this module is first imported), which is how the suite checks
it against reference_paged_attention.

A tile's rows are (query token, query head of the KV head) pairs, token-major: row r is token r // group,
head kv_head * group + r % group. So a decode (one token) fills `group` rows of a tile of at least 16 (the
least a tensor-core dot takes), and a prefill tile holds BLOCK_M // group tokens; K and V are read once per
tile for all of its heads (GQA's saving). Keys come BLOCK_N positions at a time, each position's block id
looked up in the table, so any block size works.

Masks, as the torch paths: query at position p (the last query_len positions of its sequence) sees keys
p - window + 1 .. p (0 .. p without a window); a tile reads only the positions from its first query's
window start to its last query.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: ops.paged_kernel_applies is then False
    triton = None


def triton_available(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of `device`: CUDA with Triton, or any device in the interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# The interpreter computes a bfloat16 tl.dot wrongly (numpy has no bfloat16), so there every dot takes float32
# inputs in full precision: bfloat16 products are exact in float32 and both sum in float32, so this is the
# tensor-core path's arithmetic up to summation order.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr,
        stride_q_token, stride_q_head, stride_out_token, stride_out_head,
        stride_kv_head, stride_kv_block, stride_kv_slot, stride_table,
        scale, window, block_size,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        query_start = tl.load(query_start_ptr + seq)
        query_len = tl.load(query_start_ptr + seq + 1) - query_start
        seq_len = tl.load(seq_lens_ptr + seq)
        tokens_per_tile: tl.constexpr = BLOCK_M // GROUP
        first_token = tile * tokens_per_tile
        if first_token < query_len:  # tiles past a short sequence's queries do nothing
            rows = tl.arange(0, BLOCK_M)
            token = first_token + rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = (rows < tokens_per_tile * GROUP) & (token < query_len)
            dims = tl.arange(0, HEAD_DIM_PAD)
            dim_ok = dims < HEAD_DIM
            q_offsets = (query_start + token)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
            q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            query_pos = seq_len - query_len + token  # [BLOCK_M]
            key_end = seq_len - query_len + tl.minimum(first_token + tokens_per_tile, query_len)
            key_begin = 0
            if HAS_WINDOW:
                key_begin = tl.maximum(seq_len - query_len + first_token + 1 - window, 0)
                key_begin = key_begin // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
            for start in range(key_begin, key_end, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)
                pos_ok = pos < key_end
                # int64 offsets: one head's pool can pass 2**31 elements on a large GPU
                block = tl.load(tables_ptr + seq * stride_table + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
                kv_offsets = (kv_head.to(tl.int64) * stride_kv_head + block * stride_kv_block
                              + (pos % block_size) * stride_kv_slot)[:, None] + dims[None, :]
                kv_mask = pos_ok[:, None] & dim_ok[None, :]
                k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
                if IEEE:  # float32 models (and the interpreter): full-precision products, not TF32
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale
                allowed = pos_ok[None, :] & (pos[None, :] <= query_pos[:, None])
                if HAS_WINDOW:
                    allowed = allowed & (pos[None, :] > query_pos[:, None] - window)
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
                if IEEE:  # p rounded to V's dtype as the tensor-core path rounds it (a no-op in float32)
                    p_v = p.to(v.dtype).to(tl.float32)
                    acc = acc * alpha[:, None] + tl.dot(p_v, v.to(tl.float32), input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_safe[:, None]
            out_offsets = ((query_start + token)[:, None] * stride_out_token + head[:, None] * stride_out_head
                           + dims[None, :])
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_attention_triton(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           max_query_len: int, scale: float, window: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_tokens, heads, head_dim] (rows may be strided, each head's dims contiguous); the pools
    [kv_heads, num_blocks, block_size, head_dim]; block_tables [num_seqs, max_blocks]; seq_lens [num_seqs]
    (cached + new tokens); query_start_loc [num_seqs + 1] (each sequence's first query row, then the
    total); max_query_len: the longest sequence's query tokens, from the host (it sizes the grid) ->
    [num_tokens, heads, head_dim]. Reads nothing on the host from device tensors: no sync, and a CUDA graph
    can capture it."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    # a decode tile holds one token's heads; a prefill tile several tokens (BLOCK_M // group of them)
    block_m = max(16, _next_power_of_2(group) * (1 if max_query_len == 1 else 4))
    block_m = max(block_m, 64) if max_query_len > 1 else block_m
    head_dim_pad = max(16, _next_power_of_2(head_dim))
    block_n = 64 if head_dim_pad <= 128 else 32  # K and V tiles of BLOCK_N x head_dim in shared memory
    num_seqs = seq_lens.shape[0]
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_m // group))
    _paged_attention_kernel[grid](
        q, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        scale, window or 0, block_size,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, IEEE=q.dtype == torch.float32 or _INTERPRETED,
    )
    return out
