"""RecentActivity: the records the engine keeps for the live view, and the windows computed from them."""

import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.observability.recent_activity import Percentiles, RecentActivity, StepRecord, percentile
from tinyserve.types import SamplingParams


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert [percentile(values, q) for q in (50, 95, 99, 100)] == [50.0, 95.0, 99.0, 100.0]
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_window_counts_only_the_last_seconds():
    activity = RecentActivity()
    activity.started_time = 0.0
    for t in range(1, 101):  # one step a second, 2 generated tokens each
        activity.record_step(StepRecord(float(t), 0.01, 2, 0, 2, 2))
    for t, ttft in ((10.0, 9.0), (50.0, 0.1), (60.0, 0.2), (70.0, 0.3)):
        # arrival t - ttft, first token at t - ... : 11 tokens over 1 s after the first -> TPOT 0.1 s
        activity.record_finish(t - 1.0 - ttft, t - 1.0, t, 11)
    window = activity.window(60.0, now=100.0)
    assert window.seconds == 60.0 and window.num_steps == 60  # steps at 41..100
    assert window.tokens_per_s == pytest.approx(2.0)
    assert window.num_finished == 3  # the one at t=10 is older than the window
    assert window.ttft == Percentiles(pytest.approx(0.2), pytest.approx(0.3), pytest.approx(0.3))
    assert window.tpot.p50 == pytest.approx(0.1)


def test_window_is_shorter_when_the_records_ran_out_or_the_engine_is_young():
    activity = RecentActivity(max_steps=10)
    activity.started_time = 0.0
    for t in range(1, 101):
        activity.record_step(StepRecord(float(t), 0.01, 1, 0, 1, 3))
    window = activity.window(60.0, now=100.0)
    assert window.seconds == 9.0 and window.num_steps == 9  # the oldest record (t=91) starts the window
    assert window.tokens_per_s == pytest.approx(3.0)
    young = RecentActivity()
    young.started_time = 95.0
    assert young.window(60.0, now=100.0).seconds == 5.0
    assert young.window(60.0, now=100.0).ttft == Percentiles(None, None, None)


def test_a_request_with_one_token_has_a_ttft_and_no_tpot():
    activity = RecentActivity()
    activity.started_time = 0.0
    activity.record_finish(arrival_time=1.0, first_token_time=1.5, finished_time=1.5, num_output_tokens=1)
    activity.record_finish(arrival_time=1.0, first_token_time=None, finished_time=2.0, num_output_tokens=0)
    window = activity.window(60.0, now=2.0)
    assert window.num_finished == 2 and window.ttft.p50 == 0.5 and window.tpot.p50 is None


def test_engine_records_prefill_chunks_then_decodes(smollm2_loaded):
    """A 20-token prompt under an 8-token budget: prefill 8, 8, 4 (the last samples the first token), then
    one decode token a step; every step is recorded, and the finish carries TTFT and TPOT."""
    config = EngineConfig(cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256))
    engine = LLMEngine(config, loaded=smollm2_loaded)
    engine.add_request("a", list(range(100, 120)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    steps = engine.activity.recent_steps(100)
    shapes = [(s.num_seqs, s.num_prefill_tokens, s.num_decode_tokens, s.num_generated_tokens) for s in steps]
    assert shapes == [(1, 8, 0, 0), (1, 8, 0, 0), (1, 4, 0, 1), (1, 0, 1, 1), (1, 0, 1, 1)]
    assert all(s.duration_s > 0 for s in steps)
    assert engine.activity.recent_steps(2) == steps[-2:]
    window = engine.activity.window(60.0)
    assert window.num_finished == 1 and window.num_steps == 5
    assert window.ttft.p50 is not None and window.ttft.p50 > 0
    assert window.tpot.p50 is not None and window.tpot.p50 > 0
