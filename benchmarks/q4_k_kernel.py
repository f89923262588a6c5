"""GGUF Q4_K from its own codes (Int4SuperblockWeight, w4a16_superblock_matmul) against W4A16 on Int4Weight
(w4a16_matmul), float32 activations, an 8192 x 2048 and a 2048 x 8192 weight ([out, in]) at 1, 4 and 64 tokens:
milliseconds, medians of 5 (the two kernels' calls alternating) (docs/PERFORMANCE.md, "Q4_K from its own codes").

    python benchmarks/q4_k_kernel.py

With --load FILE (a Q4_K_M GGUF), each load path in its own process: the file loaded in w4a16 mode
(`--dtype auto --quantization auto` at float32), its load time, peak RSS and the weights by format.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from tinyserve.layers.kernels import cpu_kernels
from tinyserve.layers.quant import Int4SuperblockWeight, Int4Weight
from tinyserve.loader.gguf.blocks import superblock_codes


def _q4_k_weight(out_features: int, in_features: int) -> Int4SuperblockWeight:
    """Random Q4_K blocks (codes, 6-bit scales and minimums) with d = dmin = 0.001: the speed is the shape's."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(out_features, in_features // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.frombuffer(np.float16(0.001).tobytes() * 2, dtype=np.uint8)
    return Int4SuperblockWeight.from_codes(superblock_codes(blocks.reshape(out_features, -1)))


def _median_ms(*fns) -> list[float]:
    """Each function's median of 5 timed calls, the calls alternating (a shared machine's load hits both)."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(5):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e3 for spent in times]


def kernels() -> None:
    print(f"threads {torch.get_num_threads()}")
    for out_features, in_features in ((8192, 2048), (2048, 8192)):
        q4_k = _q4_k_weight(out_features, in_features)
        int4, _ = Int4Weight.quantize(torch.randn(out_features, in_features) * 0.02)
        for tokens in (1, 4, 64):
            x = torch.randn(tokens, in_features)
            k_ms, int4_ms = _median_ms(
                lambda: cpu_kernels.w4a16_superblock_matmul(x, q4_k.codes, q4_k.d, q4_k.dmin, q4_k.sub_scales,
                                                            q4_k.sub_mins, out_features),
                lambda: cpu_kernels.w4a16_matmul(x, int4.codes, int4.scales, int4.minimums, out_features))
            print(f"{out_features}x{in_features} tokens {tokens:2d}: q4_k {k_ms:7.2f} ms, int4 {int4_ms:7.2f} ms "
                  f"({k_ms / int4_ms:.2f}x)")


def load(path: str) -> None:
    """One load in this process: its time, peak RSS and weights by format."""
    from tinyserve.engine.memory.sizing import describe_weight_bytes, weight_bytes_by_format
    from tinyserve.loader.model_loader import load_model

    start = time.perf_counter()
    loaded = load_model(path, "auto", "cpu", "auto")
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{loaded.quantization}: load {seconds:.1f} s, peak RSS {peak_mib:.0f} MiB, weights "
          f"{describe_weight_bytes(weight_bytes_by_format(loaded.model))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--load", help="a Q4_K_M GGUF to load in w4a16 mode (in a child process)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        load(args.load)
    elif args.load:
        subprocess.run([sys.executable, __file__, "--load", args.load, "--child"], check=True)
    else:
        kernels()
