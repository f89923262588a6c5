"""The GPU's paged attention kernel (layers/kernels/triton_attention.py) against the reference attention, on CPU in
Triton's interpreter: decodes, prefill chunks with and without a cached prefix, GQA groups that are not a
power of two, a head size that is not, block sizes below and above the kernel's key tile, sliding windows,
float32 and bfloat16. On a GPU, tests/test_cuda.py runs the same cases compiled."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is first imported

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (`make setup` installs it with the tests)")

from test_attention import MIXES, _build  # noqa: E402
from test_parallel import TINY_PROMPTS, tiny_folders  # noqa: E402, F401 - tiny_folders: a fixture

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.engine.execution import stage_runner  # noqa: E402

from tinyserve.layers import ops  # noqa: E402
from tinyserve.layers.attention import paged_attention, reference_paged_attention  # noqa: E402
from tinyserve.layers.kernels.triton_attention import paged_attention_triton, triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(torch.device("cpu")),
                                reason="TRITON_INTERPRET was set to something other than 1 before this test")


def _kernel(q, cache, meta, scale, window=None):
    starts = torch.tensor([0, *meta.query_lens_host], dtype=torch.int64).cumsum(0)
    return paged_attention_triton(q, cache.key, cache.value, meta.groups[0].block_tables, meta.seq_lens, starts,
                                  max(meta.query_lens_host), scale, window)


CASES = [  # (heads, kv_heads, head_dim, block size)
    (6, 2, 16, 4),  # group 3, blocks smaller than the key tile
    (4, 4, 24, 16),  # no GQA, head size padded to 32
    (8, 1, 64, 128),  # one KV head, blocks larger than the key tile
]


@pytest.mark.parametrize("seqs", MIXES[:3] + [[(150, 1), (70, 40)]])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", CASES)
def test_kernel_matches_the_reference_in_float32(seqs, heads, kv_heads, head_dim, block):
    cache, meta, q, _, _, _ = _build(seqs, torch.float32, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                     block=block)
    scale = head_dim**-0.5
    expected = reference_paged_attention(q, cache, meta, scale)
    torch.testing.assert_close(_kernel(q, cache, meta, scale), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 32])
def test_kernel_keeps_to_the_sliding_window(window):
    seqs = [(60, 1), (3, 1), (0, 40), (50, 20)]
    cache, meta, q, _, _, _ = _build(seqs, torch.float32, window=window, block=8)
    expected = reference_paged_attention(q, cache, meta, 0.25, window)
    torch.testing.assert_close(_kernel(q, cache, meta, 0.25, window), expected, rtol=1e-5, atol=1e-5)


def test_kernel_in_bfloat16_is_as_close_as_the_torch_path():
    seqs = [(40, 1), (9, 1), (0, 30), (20, 12)]
    cache, meta, q, k, v, _ = _build(seqs, torch.bfloat16, block=16)
    scale = 16**-0.5
    expected = reference_paged_attention(q, cache, meta, scale).float()
    torch_error = (paged_attention(q, cache, meta, meta.groups[0], scale, k, v).float() - expected).abs().max()
    kernel_error = (_kernel(q, cache, meta, scale).float() - expected).abs().max()
    assert kernel_error <= max(2 * torch_error, 2e-2), (kernel_error, torch_error)


def test_kernel_reads_strided_query_rows_and_writes_into_out():
    """q as a view into a fused qkv output (rows strided), as the model hands it; `out` is filled in place."""
    seqs = [(10, 1), (0, 7)]
    cache, meta, q, _, _, _ = _build(seqs, torch.float32)
    fused = torch.cat([q, torch.randn_like(q)], dim=1)  # [tokens, 2 * heads, head_dim]
    strided = fused[:, : q.shape[1]]
    out = torch.full_like(q, float("nan"))
    starts = torch.tensor([0, 1, 8])
    result = paged_attention_triton(strided, cache.key, cache.value, meta.groups[0].block_tables, meta.seq_lens,
                                    starts, 7, 0.25, out=out)
    assert result is out
    torch.testing.assert_close(out, reference_paged_attention(q, cache, meta, 0.25), rtol=1e-5, atol=1e-5)


def test_the_kernel_is_chosen_only_on_cuda():
    assert not ops.paged_kernel_applies(torch.device("cpu"))  # the interpreter is for tests, not for serving


def test_a_model_through_the_kernel_gives_the_torch_paths_greedy_tokens(tiny_folders, monkeypatch):
    """The engine as it runs on CUDA (every layer's attention in the kernel, prefill chunks beside decodes,
    a prompt longer than a chunk), here in the interpreter: float32 greedy tokens identical to the CPU paths."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def greedy():
        with LLM(tiny_folders["llama"], dtype="float32", device="cpu", kv_cache_memory=0.05,
                 max_num_batched_tokens=64, max_model_len=1024) as llm:
            assert llm.engine.runner.stage.paged_kernel == (stage_runner.paged_kernel_applies is not _cpu_choice)
            return [r.token_ids for r in llm.generate(TINY_PROMPTS, params)]

    _cpu_choice = stage_runner.paged_kernel_applies
    expected = greedy()
    monkeypatch.setattr(stage_runner, "paged_kernel_applies", lambda device: True)
    assert greedy() == expected
