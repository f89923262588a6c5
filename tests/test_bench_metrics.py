"""The serving metrics' arithmetic on synthetic timings: TTFT, TPOT, ITL, percentiles, goodput, throughput."""

import math

import numpy as np
import pytest

from tinyserve.bench.metrics import (Distribution, RequestResult, Spread, compute_metrics, max_concurrency,
                                     meets_slos, output_token_timeline, timeline_bin_s)
from tinyserve.bench.serve import arrival_offsets


def request(start, chunk_times, end, tokens=None, prompt_len=10, error=None):
    r = RequestResult(prompt_len=prompt_len, output_len=100, start_time=start, end_time=end,
                      chunk_times=list(chunk_times), error=error)
    r.num_output_tokens = len(chunk_times) if tokens is None else tokens
    return r


def test_per_request_ttft_tpot_itl_latency():
    # sent at 1.0, chunks at 1.2, 1.25, 1.35, 1.40; stream over at 1.5
    r = request(1.0, [1.2, 1.25, 1.35, 1.40], 1.5)
    assert r.ttft == pytest.approx(0.2)
    assert r.latency == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.05, 0.10, 0.05])
    assert r.tpot == pytest.approx((0.5 - 0.2) / 3)  # (latency - ttft) / (tokens - 1), vLLM's definition


def test_tpot_counts_tokens_not_chunks():
    r = request(0.0, [0.1, 0.2], 0.3, tokens=5)  # two chunks carried five tokens
    assert r.tpot == pytest.approx((0.3 - 0.1) / 4)
    assert r.itls == pytest.approx([0.1])


def test_single_token_has_no_tpot_and_no_text_has_no_ttft():
    assert request(0.0, [0.1], 0.1).tpot is None
    r = request(0.0, [], 0.1, tokens=0)
    assert r.ttft is None and r.tpot is None and r.itls == []


def test_distribution_percentiles_are_linear_interpolation_in_ms():
    d = Distribution.of_seconds([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert d.count == 100
    assert d.mean == pytest.approx(50.5)
    assert d.median == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert d.max == pytest.approx(100.0)
    assert d.std == pytest.approx(np.std(np.arange(1, 101)))


def test_empty_distribution_is_zero_with_count_zero():
    d = Distribution.of_seconds([])
    assert d.count == 0 and d.mean == d.median == d.p99 == 0.0


def test_run_metrics_over_successful_requests():
    results = [
        request(0.0, [0.1, 0.2, 0.3], 0.3, prompt_len=10),  # ttft .1, tpot .1, itl .1 .1
        request(0.0, [0.3, 0.4], 0.5, prompt_len=20),  # ttft .3, tpot .2, itl .1
        request(0.5, [], 0.6, tokens=0, prompt_len=30, error="http_503"),
        request(0.6, [], 0.7, tokens=0, prompt_len=30, error="http_503"),
        request(0.7, [0.8], 0.9, tokens=0, prompt_len=30, error="connection_closed"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m.num_completed, m.num_failed) == (2, 3)
    assert m.failures == {"http_503": 2, "connection_closed": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 5)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    assert m.ttft_ms.mean == pytest.approx(200.0) and m.ttft_ms.count == 2
    assert m.tpot_ms.mean == pytest.approx(150.0)
    assert m.itl_ms.count == 3 and m.itl_ms.mean == pytest.approx(100.0)  # gaps pooled over requests
    assert m.e2el_ms.median == pytest.approx(400.0)
    assert m.goodput is None


def test_goodput_counts_requests_meeting_every_slo():
    fast = request(0.0, [0.05, 0.06, 0.07], 0.07)  # ttft 50 ms, tpot 10 ms
    slow_first = request(0.0, [0.5, 0.51], 0.51)  # ttft 500 ms, tpot 10 ms
    slow_tokens = request(0.0, [0.05, 0.15], 0.15)  # ttft 50 ms, tpot 100 ms
    one_token = request(0.0, [0.05], 0.05)  # no TPOT: meets a TPOT SLO trivially
    failed = request(0.0, [0.01], 0.02, error="timeout")
    results = [fast, slow_first, slow_tokens, one_token, failed]
    slos = {"ttft": 100.0, "tpot": 20.0}
    assert [meets_slos(r, slos) for r in results[:4]] == [True, False, False, True]
    m = compute_metrics(results, duration_s=2.0, slos_ms=slos)
    assert m.goodput == pytest.approx(2 / 2.0)
    assert compute_metrics(results, 2.0, {"e2el": 200.0}).goodput == pytest.approx(3 / 2.0)  # all but slow_first
    assert not meets_slos(request(0.0, [], 0.1, tokens=0), {"ttft": 1000.0})  # never got a token


def test_max_concurrency_counts_overlap():
    results = [request(0.0, [], 1.0, 0), request(0.5, [], 1.5, 0), request(1.0, [], 2.0, 0),
               request(0.6, [], 0.7, 0)]
    assert max_concurrency(results) == 3  # [0.6, 0.7]: three open; the one ending at 1.0 closes first


def test_output_token_timeline_spreads_tokens_over_chunks():
    results = [request(10.0, [10.1, 10.2, 11.5, 11.6], 11.6, tokens=8)]  # 2 tokens per chunk
    assert output_token_timeline(results, start=10.0, duration_s=2.0, bin_s=1.0) == pytest.approx([4.0, 4.0])
    assert output_token_timeline(results, start=10.0, duration_s=2.0, bin_s=0.5) == pytest.approx([8, 0, 0, 8])
    assert timeline_bin_s(5.0) == 0.1 and timeline_bin_s(100.0) == 1.0 and timeline_bin_s(1e6) == 60.0


def test_spread_of_runs():
    s = Spread.of([3.0, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.num_runs) == (2.0, 1.0, 3.0, 3)
    assert str(s) == "2.00 [1.00-3.00]" and str(Spread.of([5.0])) == "5.00"
    assert str(Spread.of([2692.13, 2550.4, 2831.0])) == "2692 [2550-2831]" and str(Spread.of([31.46])) == "31.5"


def test_arrivals_poisson_rate_and_seed():
    a = arrival_offsets(4000, request_rate=20.0, burstiness=1.0, seed=1)
    assert a == arrival_offsets(4000, 20.0, 1.0, seed=1) and a != arrival_offsets(4000, 20.0, 1.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.1)  # exponential: std == mean
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    bursty = np.diff(arrival_offsets(4000, 20.0, 0.25, 1))
    assert bursty.mean() == pytest.approx(1 / 20.0, rel=0.1) and bursty.std() > 1.5 * gaps.std()
