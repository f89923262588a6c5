"""A whole prefill step (one fresh random prompt of --tokens tokens, max_tokens=1) in each mode, engines
side by side in one process, the modes interleaved in every repeat; medians and tokens/s against bf16.
One JSON line. docs/PERFORMANCE.md, "Prefill at the integer rate", quotes it.

Besides the modes (bf16, int8, int4) two variants swap the block linears' formats in place, from a
float32 load of the same checkpoint: int8_g32 (the int8 mode before, Q8_0 everywhere) and int4+copy
(int4 for steps under 16 rows, an Int8ChannelWeight copy from there: not a mode, a measured option).

    .venv/bin/python benchmarks/prefill_step.py --repeats 9
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.layers import ops
from tinyserve.layers.linear import Linear
from tinyserve.layers.quant import Int8ChannelWeight, Int8Weight
from tinyserve.loader.model_loader import load_model
from tinyserve.types import SamplingParams

MODES = {"bf16": None, "int8_g32": "int8", "int8": "int8", "int4": "int4", "int4+copy": "int4"}


@dataclass(frozen=True)
class PrefillCopy:
    decode: object
    prefill: Int8ChannelWeight
    min_rows: int


def _linear_with_copies(linear):
    def run(x, weight, bias=None):
        if isinstance(weight, PrefillCopy):
            weight = weight.prefill if x.shape[0] >= weight.min_rows else weight.decode
        return linear(x, weight, bias)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    ops.linear = _linear_with_copies(ops.linear)
    floats = {}
    if {"int8_g32", "int4+copy"} & set(modes):
        model = load_model("smollm2-135m", "float32", "cpu").model
        floats = {n: m.weight.detach() for n, m in model.named_modules() if isinstance(m, Linear) and not m.is_lm_head}
    engines = {}
    for mode in modes:
        engine = LLMEngine(EngineConfig(quantization=MODES[mode], cache=CacheConfig(kv_cache_memory_gib=0.25),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=max(512, args.tokens))))
        for name, module in engine.runner.model.named_modules():
            if name in floats and mode == "int8_g32":
                module.weight_format = Int8Weight.quantize(floats[name])[0]
            elif name in floats and mode == "int4+copy":
                module.weight_format = PrefillCopy(module.weight_format, Int8ChannelWeight.quantize(floats[name])[0], 16)
        engines[mode] = engine
    floats.clear()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for repeat in range(args.repeats + 1):  # the first is warm-up
        for mode, engine in engines.items():
            engine.add_request(f"{mode}-{repeat}", [rng.randrange(100, 40000) for _ in range(args.tokens)], params)
            start = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - start)
            assert not engine.scheduler.running, "the prompt took more than one step"
    medians = {m: statistics.median(t[1:]) for m, t in times.items()}
    line: dict = {"tokens": args.tokens}
    for mode in modes:
        line[mode] = {"ms": round(medians[mode] * 1e3, 1), "tok_s": round(args.tokens / medians[mode])}
        if "bf16" in medians:
            line[mode]["vs_bf16"] = round(medians["bf16"] / medians[mode], 3)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
