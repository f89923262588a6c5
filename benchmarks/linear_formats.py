"""All 120 block linears of SmolLM2-135M (30 distinct layers, so nothing stays in cache) in each weight
format, by rows per step: the formats interleaved in every repeat, medians. One JSON line per row count
(ms per pass over all 120, GOP/s). docs/PERFORMANCE.md, "Prefill at the integer rate", quotes it.

    .venv/bin/python benchmarks/linear_formats.py --rows 1,16,64,128,512 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from tinyserve.layers.kernels import cpu_kernels

from tinyserve.layers import ops
from tinyserve.layers.quant import Int4Weight, Int8ChannelWeight, Int8Weight
from tinyserve.layers.weight_format import Bf16Weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]: qkv, o, gate_up, down
LAYERS = 30
FORMATS = {"bf16": Bf16Weight.pack, "int8_g32": lambda w: Int8Weight.quantize(w)[0],
           "int4_g32": lambda w: Int4Weight.quantize(w)[0], "int8_row": lambda w: Int8ChannelWeight.quantize(w)[0],
           # int4's codes with the activations unrounded (the w4a16 mode's block linears)
           "w4a16_g32": lambda w: dataclasses.replace(Int4Weight.quantize(w)[0], int8_inputs=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    assert cpu_kernels.load() is not None, "our C++ kernels are not built here"
    formats = args.formats.split(",")
    torch.manual_seed(0)
    packed: dict[str, list] = {f: [] for f in formats}
    for _ in range(LAYERS):
        for n, k in SHAPES:
            weight = torch.randn(n, k) * 0.05
            for f in formats:
                packed[f].append(FORMATS[f](weight))
    ops_per_row = 2 * LAYERS * sum(n * k for n, k in SHAPES)
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}
        times: dict[str, list[float]] = {f: [] for f in formats}
        for _ in range(args.repeats + 1):  # the first is warm-up
            for f in formats:
                start = time.perf_counter()
                for i, weight in enumerate(packed[f]):
                    ops.linear(xs[SHAPES[i % 4][1]], weight)
                times[f].append(time.perf_counter() - start)
        line = {"rows": rows, "threads": torch.get_num_threads()}
        for f in formats:
            median = statistics.median(times[f][1:])
            line[f] = {"ms": round(median * 1e3, 2), "gop_s": round(rows * ops_per_row / median / 1e9)}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
