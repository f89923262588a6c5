"""layers/rotary.py: the cos/sin table is built at the first step, for the positions an engine serves."""

import torch

from tinyserve import LLM, SamplingParams
from tinyserve.layers.rotary import RotaryEmbedding, limit_positions


def test_a_limited_table_is_the_full_table_s_first_rows_bit_for_bit():
    full, limited = RotaryEmbedding(64, 4096, 500000.0), RotaryEmbedding(64, 4096, 500000.0)
    limited.limit_positions(100, torch.device("cpu"))
    positions = torch.tensor([0, 1, 57, 99])
    for a, b in zip(full(positions, torch.float32), limited(positions, torch.float32)):
        assert torch.equal(a, b)
    assert limited.cos.shape == (100, 64) and limited.sin.shape == (100, 64)
    assert full.cos.shape == (4096, 64)


def test_a_table_built_before_the_limit_is_cut_to_it():
    rotary = RotaryEmbedding(16, 1000, 10000.0)
    before = rotary(torch.arange(10), torch.float32)
    rotary.limit_positions(10, torch.device("cpu"))
    assert rotary.cos.shape == (10, 16)
    for a, b in zip(before, rotary(torch.arange(10), torch.float32)):
        assert torch.equal(a, b)
    rotary.limit_positions(5000, torch.device("cpu"))  # never longer than the model's own
    assert rotary.max_position == 10


def test_the_table_is_built_at_the_first_step_not_with_the_model(tiny_llama):
    model = tiny_llama(True)
    tables = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables and all(m.cos is None for m in tables)
    limit_positions(model, 32, torch.device("cpu"))
    assert all(m.max_position == 32 and m.cos.shape == (32, 16) for m in tables)


def test_an_engine_holds_the_table_for_its_context_only(random_hf_folders):
    """A served model's tables cover max_model_len positions, not the model's own context."""
    llm = LLM(random_hf_folders["llama"], dtype="float32", max_model_len=64, kv_cache_memory=0.01)
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    tables = [m for m in llm.engine.runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables and all(m.cos.shape[0] == 64 for m in tables)
