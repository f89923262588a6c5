"""GGUF Q6_K, Q5_K and Q5_1 from their own codes (Int6SuperblockWeight, Int5SuperblockWeight, Int5Weight: Q5_0's
kernel too) against W4A16 on
Int4Weight (w4a16_matmul) and on Int8Weight (w8a16_matmul: what w4a16 held these types in before), float32
activations, an 8192 x 2048 and a 2048 x 8192 weight ([out, in]) at 1, 4 and 64 tokens: milliseconds, medians
of 5 (the kernels' calls alternating) (docs/PERFORMANCE.md, "Q6_K, Q5_K, Q5_0, Q5_1 from their own codes").

    python benchmarks/wide_codes_kernel.py            # at torch's thread count; OMP_NUM_THREADS=1 for one

With --load FILE (a Q4_K_M GGUF): benchmarks/q4_k_kernel.py's load in w4a16 mode (time, peak RSS, weights by
format), in a child process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tinyserve.layers import ops
from tinyserve.layers.quant import Int4Weight, Int5SuperblockWeight, Int5Weight, Int6SuperblockWeight, Int8Weight
from tinyserve.loader.gguf.blocks import group_codes, int5_superblock_codes, int6_superblock_codes

sys.path.insert(0, str(Path(__file__).parent))
from q4_k_kernel import _median_ms  # noqa: E402  (one timing rule for both kernels' tables)


def _random_blocks(out_features: int, in_features: int, block_bytes: int, scales: tuple[int, ...],
                   block_values: int = 256) -> np.ndarray:
    """Random blocks (of 256 weights), their float16 fields at `scales` set to 0.0001: the speed is the shape's."""
    blocks = np.random.default_rng(0).integers(
        0, 256, size=(out_features, in_features // block_values, block_bytes), dtype=np.uint8)
    for at in scales:
        blocks[..., at:at + 2] = np.frombuffer(np.float16(0.0001).tobytes(), dtype=np.uint8)
    return blocks.reshape(out_features, -1)


def _weights(out_features: int, in_features: int) -> dict:
    """Each format's weight of the shape, by the name its column takes (ops.linear runs each one's kernel)."""
    w = torch.randn(out_features, in_features) * 0.02
    return {"q6_k": Int6SuperblockWeight.from_codes(int6_superblock_codes(
                _random_blocks(out_features, in_features, 210, (208,)))),
            "q5_k": Int5SuperblockWeight.from_codes(int5_superblock_codes(
                _random_blocks(out_features, in_features, 176, (0, 2)))),
            "q5_1": Int5Weight.from_codes(group_codes(GGMLQuantizationType.Q5_1, _random_blocks(
                out_features, in_features, 24, (0, 2), block_values=32))),
            "int4": dataclasses.replace(Int4Weight.quantize(w)[0], int8_inputs=False),  # w4a16_matmul
            "int8": dataclasses.replace(Int8Weight.quantize(w)[0], int8_inputs=False)}  # w8a16_matmul


def kernels() -> None:
    threads = torch.get_num_threads()
    for out_features, in_features in ((8192, 2048), (2048, 8192)):
        weights = _weights(out_features, in_features)
        for tokens in (1, 4, 64):
            x = torch.randn(tokens, in_features)
            calls = [lambda weight=weight: ops.linear(x, weight) for weight in weights.values()]
            row = {"threads": threads, "shape": f"{out_features}x{in_features}", "tokens": tokens}
            for name, ms in zip(weights, _median_ms(*calls)):
                row[f"{name}_ms"] = round(ms, 3)
            print(json.dumps(row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--load", help="a Q4_K_M GGUF to load in w4a16 mode (in a child process)")
    args = parser.parse_args()
    if args.load:
        script = Path(__file__).with_name("q4_k_kernel.py")
        subprocess.run([sys.executable, str(script), "--load", args.load, "--child"], check=True)
    else:
        kernels()
