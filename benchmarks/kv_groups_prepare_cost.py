"""Host cost of one decode step's batch preparation (slot mappings, block tables, AttentionMetadata) with
Gemma 3 270M's layers: the grouped layout (1 + 5 tables per sequence) against the flat one (1 table), on
the same requests. No model runs: the runner is built without one (docs/PERFORMANCE.md, "KV groups").

    .venv/bin/python benchmarks/kv_groups_prepare_cost.py
"""

import statistics
import time

import torch

from tinyserve.engine.scheduling.block_manager import BlockManager
from tinyserve.engine.execution.model_runner import ModelRunner
from tinyserve.engine.loop.request import Request
from tinyserve.engine.execution.stage_runner import StageRunner
from tinyserve.layers.kv_cache import KVLayout
from tinyserve.loader.gguf.checkpoint import gguf_model_config, open_gguf
from tinyserve.loader.model_loader import resolve_model_path
from tinyserve.types import SamplingParams

BLOCK = 16


def runner_without_model(config, layout: KVLayout, num_blocks: int) -> ModelRunner:
    """What _prepare and the stage's inputs read, set by hand (their __init__s want a model and a pool)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.layout, runner.num_micro_batches = BLOCK, layout, 1
    stage = runner.stage = StageRunner.__new__(StageRunner)
    stage.device, stage.dtype = torch.device("cpu"), torch.bfloat16
    stage.block_size, stage.num_blocks, stage.layout = BLOCK, num_blocks, layout
    stage.num_heads, stage.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    stage.group_windows = layout.group_layer_windows(config.layer_sliding_windows())
    stage.kv_caches, stage.cpu_attention = (None,) * config.num_hidden_layers, True
    return runner


def main() -> None:
    config = gguf_model_config(open_gguf(resolve_model_path("gemma3-270m")))
    for batch, context in [(16, 2048), (64, 2048), (16, 8192)]:
        for name, layout in [("flat", KVLayout.flat(config.num_hidden_layers)),
                             ("grouped", KVLayout.for_windows(config.layer_sliding_windows()))]:
            num_blocks = batch * layout.num_groups * (context // BLOCK + 2)
            bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False, group_windows=layout.group_windows)
            runner = runner_without_model(config, layout, num_blocks)
            scheduled = []
            for i in range(batch):  # each one decoding its token at `context`
                request = Request(str(i), list(range(context - 1)), SamplingParams(max_tokens=4))
                assert bm.allocate_slots(request, context - 1)
                request.num_computed_tokens = context - 1
                request.output_token_ids.append(5)
                assert bm.allocate_slots(request, 1)
                scheduled.append((request, 1))
            times = []
            for _ in range(30):
                start = time.perf_counter()
                for micro_batch in runner._prepare(scheduled).plan.micro_batches:
                    runner.stage.inputs(micro_batch)
                times.append(time.perf_counter() - start)
            print(f"batch {batch}, {context} tokens, {name}: {statistics.median(times) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
