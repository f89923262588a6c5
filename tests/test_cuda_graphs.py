"""The decode-graph path (engine/execution/cuda_graphs.py) on CPU: the static buffers, the fill of each step and its
padding rows, and the scratch block, run eagerly over the same buffers a CUDA graph replays (Triton's
interpreter for the attention kernel). Capture and replay themselves need a GPU: tests/test_cuda.py."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is first imported

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (`make setup` installs it with the tests)")

from test_parallel import TINY_PROMPTS, tiny_folders  # noqa: E402, F401 - tiny_folders: a fixture

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.config import EngineConfig  # noqa: E402
from tinyserve.engine.execution import cuda_graphs, stage_runner  # noqa: E402
from tinyserve.engine.loop import llm_engine
from tinyserve.engine.execution.cuda_graphs import graph_batch_sizes  # noqa: E402


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 8]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = graph_batch_sizes(256)
    assert sizes[-1] == 256 and len(sizes) == 35
    for n in range(1, 257):  # padding is at most 7 rows past 8 (and 1 below)
        bucket = next(s for s in sizes if s >= n)
        assert bucket - n <= (7 if n > 8 else bucket // 2)


def test_graphs_apply_only_on_cuda_unless_eager():
    assert not cuda_graphs.decode_graphs_apply(torch.device("cpu"), False, False)
    assert EngineConfig().enforce_eager is False


def _greedy(folder: str, prompts: list[str], max_tokens: int, **keywords) -> tuple[list[list[int]], LLM]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(folder, dtype="float32", device="cpu", kv_cache_memory=0.05, max_num_batched_tokens=64,
             max_model_len=1024, **keywords) as llm:
        return [r.token_ids for r in llm.generate(prompts, params)], llm


def test_decode_steps_through_the_graph_buffers_give_the_eager_tokens(tiny_folders, monkeypatch):
    """The engine as on CUDA with graphs, the forward run eagerly over the static buffers: 4 prompts (bucket
    4, no padding), then 3 (bucket 4: one padding row), greedy tokens identical to the CPU paths, and the
    scratch block past the BlockManager's blocks is the only one padding touched."""
    folder = tiny_folders["llama"]
    expected4, _ = _greedy(folder, TINY_PROMPTS, 12)
    expected3, _ = _greedy(folder, TINY_PROMPTS[:3], 12)
    monkeypatch.setattr(stage_runner, "paged_kernel_applies", lambda device: True)
    monkeypatch.setattr(llm_engine, "decode_graphs_apply", lambda device, eager, has_ranks: not eager)
    runs = []
    original_run = cuda_graphs.DecodeGraphs.run
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", lambda self, mb: runs.append(len(mb.query_lens))
                        or original_run(self, mb))
    got4, llm = _greedy(folder, TINY_PROMPTS, 12, max_num_seqs=4)
    assert got4 == expected4
    graphs = llm.engine.runner.stage.decode_graphs
    assert graphs.sizes == [1, 2, 4] and runs and max(runs) == 4
    num_blocks = llm.engine.block_manager.num_blocks
    cache = llm.engine.runner.kv_cache[0]
    assert cache.key.shape[1] == num_blocks + 1 and graphs.scratch == num_blocks
    runs.clear()
    got3, llm = _greedy(folder, TINY_PROMPTS[:3], 12, max_num_seqs=4)
    assert got3 == expected3 and 3 in runs  # three sequences padded to the bucket of 4
    assert llm.engine.runner.kv_cache[0].key[:, num_blocks].abs().sum() > 0  # the padding row wrote there


def test_enforce_eager_runs_no_graph(tiny_folders, monkeypatch):
    monkeypatch.setattr(stage_runner, "paged_kernel_applies", lambda device: True)
    monkeypatch.setattr(llm_engine, "decode_graphs_apply", lambda device, eager, has_ranks: not eager)
    _, llm = _greedy(tiny_folders["llama"], TINY_PROMPTS[:1], 2, enforce_eager=True)
    assert llm.engine.runner.stage.decode_graphs is None
    assert llm.engine.runner.kv_cache[0].key.shape[1] == llm.engine.block_manager.num_blocks
