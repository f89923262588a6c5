"""Decode attention over a bfloat16 pool and over the 8-bit pool (`--kv-cache-dtype int8`), side by side:
one layer of SmolLM2's shape (9 query / 3 KV heads, head_dim 64), blocks scattered over the pool, our C++
kernel (layers/kernels/csrc/paged_attention.cpp). Prints the median call time and the K/V bytes it read per
second (codes and scales for int8). docs/PERFORMANCE.md, "8-bit KV cache", quotes it.

    .venv/bin/python benchmarks/decode_attention_kv.py
"""

from __future__ import annotations

import statistics
import time

import torch

from tinyserve.layers import ops
from tinyserve.layers.kv_cache import KVCache, kv_row_bytes, quantize_rows

HEADS, KV_HEADS, HEAD_DIM, BLOCK, POOL_BLOCKS = 9, 3, 64, 16, 4096
CASES = [(1, 300, 300), (16, 280, 840), (64, 150, 450), (64, 250, 750)]  # sequences, shortest, longest context


def _case(num_seqs: int, shortest: int, longest: int, gen: torch.Generator):
    lens = torch.linspace(longest, shortest, num_seqs).round().long()  # longest first, as the runner orders them
    width = -(-longest // BLOCK)
    order = torch.randperm(POOL_BLOCKS, generator=gen)
    tables = order[: num_seqs * width].view(num_seqs, width).contiguous()
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    return q, tables, lens


def _median_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (KV_HEADS, POOL_BLOCKS, BLOCK, HEAD_DIM)
    key, value = torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()
    (key_codes, key_scale), (value_codes, value_scale) = quantize_rows(key), quantize_rows(value)
    pools = {"bfloat16": KVCache(key, value), "int8": KVCache(key_codes, value_codes, key_scale, value_scale)}
    row_bytes = {"bfloat16": kv_row_bytes(HEAD_DIM, torch.bfloat16), "int8": kv_row_bytes(HEAD_DIM, torch.int8)}
    print(f"threads {torch.get_num_threads()}")
    print("| sequences x context | bf16 pool ms | GB/s | int8 pool ms | GB/s | int8 / bf16 time |")
    print("|---|---:|---:|---:|---:|---:|")
    for num_seqs, shortest, longest in CASES:
        q, tables, lens = _case(num_seqs, shortest, longest, gen)
        row = {name: [] for name in pools}
        for _ in range(3):  # interleaved rounds, so both see the same machine
            for name, pool in pools.items():
                row[name].append(_median_ms(lambda: ops.cpu_paged_attention(q, pool, tables, lens, None, 0.125, None)))
        tokens = int(lens.sum())
        ms = {name: statistics.median(times) for name, times in row.items()}
        gbs = {name: 2 * tokens * KV_HEADS * row_bytes[name] / (ms[name] * 1e-3) / 1e9 for name in ms}
        print(f"| {num_seqs} x {shortest}-{longest} | {ms['bfloat16']:.3f} | {gbs['bfloat16']:.1f} | "
              f"{ms['int8']:.3f} | {gbs['int8']:.1f} | {ms['int8'] / ms['bfloat16']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
