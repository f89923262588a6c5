"""The int8-input kernels (int4_matmul, int8_matmul, int8_channel_matmul) with w4a16_matmul for reference, on
an 8192 x 2048 and a 2048 x 8192 weight (out x in: a 1B's gate/up and down_proj) at 1, 4, 16 and 64 tokens:
medians of 5, in ms. Whichever checkout is on PYTHONPATH gives the kernels, so a branch against main, side by side:

    PYTHONPATH=path/to/main-checkout .venv/bin/python benchmarks/int_kernels_avx2.py [threads]   # before
    PYTHONPATH=. .venv/bin/python benchmarks/int_kernels_avx2.py [threads]            # after

threads: torch's (and so the kernels' OpenMP) thread count, default all cores. On a machine shared with other
work, 1 thread times the kernel rather than the waits for a descheduled thread.
"""
import platform
import sys
import time

import torch

from tinyserve.layers.kernels import cpu_kernels
from tinyserve.layers.quant import Int4Weight, Int8ChannelWeight, Int8Weight


def median_ms(fn, runs: int = 5) -> float:
    fn()  # warm-up (and the kernels' build or load)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[runs // 2] * 1e3


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, build {cpu_kernels.build_name()}")
    print(f"{'out x in':>11} {'tokens':>6} {'int4':>9} {'int8':>9} {'int8-chan':>9} {'w4a16':>9}  (ms)")
    for n, k in ((8192, 2048), (2048, 8192)):
        torch.manual_seed(0)
        w = torch.randn(n, k) * 0.02
        q4, q8, qc = Int4Weight.quantize(w)[0], Int8Weight.quantize(w)[0], Int8ChannelWeight.quantize(w)[0]
        for tokens in (1, 4, 16, 64):
            x = torch.randn(tokens, k, dtype=torch.bfloat16)
            kernels = (
                lambda: cpu_kernels.int4_matmul(x, q4.codes, q4.scales, q4.minimums, n),
                lambda: cpu_kernels.int8_matmul(x, q8.codes, q8.scales, n),
                lambda: cpu_kernels.int8_channel_matmul(x, qc.codes, qc.scales, n),
                lambda: cpu_kernels.w4a16_matmul(x, q4.codes, q4.scales, q4.minimums, n),
            )
            print(f"{n:>5} x {k:<5} {tokens:>6} " + " ".join(f"{median_ms(fn):>9.2f}" for fn in kernels), flush=True)


if __name__ == "__main__":
    main()
