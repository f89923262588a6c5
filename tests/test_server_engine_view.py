"""server/observability/engine_view.py's last-minute prefix-cache hit rate, from the totals it samples at polls."""

from dataclasses import replace

import pytest

from tinyserve.engine.observability.stats import EngineStats
from tinyserve.server.observability.engine_view import SAMPLE_EVERY_S, WINDOW_S, CounterSamples

STATS = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=8, num_blocks=8,
                    num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, num_steps=0)


def _totals(queries: int, hits: int) -> EngineStats:
    return replace(STATS, prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_first_poll_is_since_start_up_and_none_without_lookups():
    assert CounterSamples().hit_rate(100.0, STATS) is None
    assert CounterSamples().hit_rate(100.0, _totals(200, 50)) == 0.25


def test_rate_covers_only_the_last_window():
    samples = CounterSamples()
    samples.hit_rate(0.0, _totals(1000, 1000))  # an old burst of hits
    t, queries, hits = 0.0, 1000, 1000
    while t < 2 * WINDOW_S:  # then a poll a second: 100 tokens looked up, 10 found
        t, queries, hits = t + 1.0, queries + 100, hits + 10
        rate = samples.hit_rate(t, _totals(queries, hits))
    # the oldest sample inside the window is WINDOW_S old: its 60 seconds saw 10% hits
    assert rate == pytest.approx(0.1)


def test_polls_faster_than_the_sample_period_share_one_sample():
    samples = CounterSamples()
    samples.hit_rate(0.0, _totals(100, 0))
    for i in range(1, 20):
        samples.hit_rate(i * SAMPLE_EVERY_S / 10, _totals(100 + i, i))
    assert len(samples._samples) == 2  # at 0 and at SAMPLE_EVERY_S
