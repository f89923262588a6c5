"""layers/rotary.py: the cos/sin table is built for the positions an engine serves, never shrinking."""

import torch

from tinyserve import LLM, SamplingParams
from tinyserve.layers.rotary import RotaryEmbedding, cover_positions

CPU = torch.device("cpu")


def test_a_table_for_fewer_positions_is_the_full_table_s_first_rows_bit_for_bit():
    full, covered = RotaryEmbedding(64, 4096, 500000.0), RotaryEmbedding(64, 4096, 500000.0)
    covered.cover_positions(100, CPU)
    positions = torch.tensor([0, 1, 57, 99])
    for a, b in zip(full(positions, torch.float32), covered(positions, torch.float32)):
        assert torch.equal(a, b)
    assert covered.cos.shape == (100, 64) and covered.sin.shape == (100, 64)
    assert full.cos.shape == (4096, 64)


def test_a_table_grows_for_more_positions_and_never_shrinks():
    """Engines sharing one model each keep the positions they serve."""
    rotary = RotaryEmbedding(16, 1000, 10000.0)
    rotary.cover_positions(10, CPU)
    rotary.cover_positions(50, CPU)
    assert rotary.cos.shape == (50, 16)
    rotary.cover_positions(20, CPU)
    assert rotary.cos.shape == (50, 16)
    rotary.cover_positions(5000, CPU)  # never past the model's own context
    assert rotary.cos.shape == (1000, 16)


def test_the_table_is_built_for_the_engine_not_with_the_model(tiny_llama):
    model = tiny_llama(True)
    tables = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables and all(m.cos is None for m in tables)
    cover_positions(model, 32, CPU)
    assert all(m.cos.shape == (32, 16) for m in tables)


def test_an_engine_holds_the_table_for_its_context_only(random_hf_folders):
    """A served model's tables cover max_model_len positions, not the model's own context."""
    llm = LLM(random_hf_folders["llama"], dtype="float32", max_model_len=64, kv_cache_memory=0.01)
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    tables = [m for m in llm.engine.runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables and all(m.cos.shape[0] == 64 for m in tables)
