"""Where a decode step's time goes, by batch size: linears, attention (KV writes included), our elementwise
kernels (norms, rotary, SiLU), other ops, and the wall time no
op accounts for (Python in the model and the engine). docs/PERFORMANCE.md quotes its tables.

Each batch: B prompts of P random tokens are prefilled, 5 decode steps warm up, the median wall time
of 10 steps is the step time, and `torch.profiler` over 5 more steps splits the op time.

    .venv/bin/python benchmarks/step_breakdown.py --batch-sizes 1,16,64 --prompt-len 256   # the default mode
    .venv/bin/python benchmarks/step_breakdown.py --batch-sizes 1,4 --quantization none   # bf16 weights
    .venv/bin/python benchmarks/step_breakdown.py --batch-sizes 16,64 --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from torch.profiler import profile

from tinyserve.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATION_MODES, CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.types import SamplingParams

LINEAR_OPS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "tinyserve::bf16_matmul",
              "tinyserve::int8_matmul", "tinyserve::int4_matmul", "tinyserve::int8_channel_matmul",
              "tinyserve::f32_matmul", "tinyserve::w4a16_matmul", "tinyserve::w8a16_matmul",
              "tinyserve::w4a16_superblock_matmul", "tinyserve::w5a16_matmul", "tinyserve::w5a16_superblock_matmul",
              "tinyserve::w6a16_superblock_matmul"}
ATTENTION_OPS = {"aten::bmm", "aten::index_select", "aten::_softmax", "aten::index_copy_", "aten::_embedding_bag",
                 "aten::_embedding_bag_forward_only",
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "tinyserve::paged_attention",
                 "tinyserve::write_kv"}
ELEMENTWISE_OPS = {"tinyserve::rms_norm", "tinyserve::add_rms_norm", "tinyserve::rotary", "tinyserve::silu_and_mul"}


def decode_breakdown(batch: int, prompt_len: int, dtype: str, model: str,
                     quantization: str = "auto", kv_cache_dtype: str = "auto") -> dict[str, float]:
    config = EngineConfig(model=model, dtype=dtype, quantization=quantization,
                          cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=512))
    engine = LLMEngine(config)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(prompt_len)], params)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < prompt_len for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    walls = []
    for _ in range(10):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    steps = 5
    with profile() as prof:
        for _ in range(steps):
            engine.step()
    split = {"linear": 0.0, "attention": 0.0, "elementwise": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / steps
        split["linear" if event.key in LINEAR_OPS else "attention" if event.key in ATTENTION_OPS
              else "elementwise" if event.key in ELEMENTWISE_OPS else "other ops"] += ms
    wall_ms = statistics.median(walls) * 1e3
    return {"step_ms": wall_ms, **split, "outside ops": max(0.0, wall_ms - sum(split.values()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--dtype", default="auto", choices=DTYPES)  # auto: what `tinyserve serve` picks
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_MODES)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    args = parser.parse_args()
    print("| batch | step ms | tok/s | linear ms | attention ms | elementwise ms | other ops ms | outside ops ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in map(int, args.batch_sizes.split(",")):
        r = decode_breakdown(batch, args.prompt_len, args.dtype, args.model, args.quantization,
                             args.kv_cache_dtype)
        print(f"| {batch} | {r['step_ms']:.1f} | {batch / r['step_ms'] * 1e3:.0f} | {r['linear']:.1f} | "
              f"{r['attention']:.1f} | {r['elementwise']:.1f} | {r['other ops']:.1f} | {r['outside ops']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
