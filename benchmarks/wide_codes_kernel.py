"""GGUF Q6_K from its own codes (Int6SuperblockWeight, w6a16_superblock_matmul) against W4A16 on Int4Weight
(w4a16_matmul) and on Int8Weight (w8a16_matmul: what w4a16 held these types in before), float32 activations, an
8192 x 2048 and a 2048 x 8192 weight ([out, in]) at 1, 4 and 64 tokens: milliseconds, medians of 5 (the
kernels' calls alternating) (docs/PERFORMANCE.md, "Q6_K, Q5_K, Q5_0, Q5_1 from their own codes").

    python benchmarks/wide_codes_kernel.py            # at torch's thread count; OMP_NUM_THREADS=1 for one

With --load FILE (a Q4_K_M GGUF): benchmarks/q4_k_kernel.py's load in w4a16 mode (time, peak RSS, weights by
format), in a child process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tinyserve.layers.kernels import cpu_kernels
from tinyserve.layers.quant import Int4Weight, Int6SuperblockWeight, Int8Weight
from tinyserve.loader.gguf.blocks import int6_superblock_codes

sys.path.insert(0, str(Path(__file__).parent))
from q4_k_kernel import _median_ms  # noqa: E402  (one timing rule for both kernels' tables)


def _q6_k_weight(out_features: int, in_features: int) -> Int6SuperblockWeight:
    """Random Q6_K blocks (codes, int8 scales) with d = 0.0001: the speed is the shape's."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(out_features, in_features // 256, 210), dtype=np.uint8)
    blocks[..., 208:210] = np.frombuffer(np.float16(0.0001).tobytes(), dtype=np.uint8)
    return Int6SuperblockWeight.from_codes(int6_superblock_codes(blocks.reshape(out_features, -1)))


def kernels() -> None:
    threads = torch.get_num_threads()
    for out_features, in_features in ((8192, 2048), (2048, 8192)):
        q6_k = _q6_k_weight(out_features, in_features)
        w = torch.randn(out_features, in_features) * 0.02
        int4, _ = Int4Weight.quantize(w)
        int8, _ = Int8Weight.quantize(w)
        for tokens in (1, 4, 64):
            x = torch.randn(tokens, in_features)
            q6_ms, int4_ms, int8_ms = _median_ms(
                lambda: cpu_kernels.w6a16_superblock_matmul(x, q6_k.codes, q6_k.high_bits, q6_k.d, q6_k.sub_scales,
                                                            out_features),
                lambda: cpu_kernels.w4a16_matmul(x, int4.codes, int4.scales, int4.minimums, out_features),
                lambda: cpu_kernels.w8a16_matmul(x, int8.codes, int8.scales, out_features))
            print(json.dumps({"threads": threads, "shape": f"{out_features}x{in_features}", "tokens": tokens,
                              "q6_k_ms": round(q6_ms, 3), "int4_ms": round(int4_ms, 3),
                              "int8_ms": round(int8_ms, 3), "q6_k_vs_int4": round(q6_ms / int4_ms, 2)}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--load", help="a Q4_K_M GGUF to load in w4a16 mode (in a child process)")
    args = parser.parse_args()
    if args.load:
        script = Path(__file__).with_name("q4_k_kernel.py")
        subprocess.run([sys.executable, str(script), "--load", args.load, "--child"], check=True)
    else:
        kernels()
