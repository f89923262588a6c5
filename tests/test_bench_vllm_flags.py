"""`tinyserve bench serve` takes a `vllm bench serve` command line unchanged (vLLM's flag names as aliases)
and reports the percentiles it asks for (--metric-percentiles), against a fake server on loopback."""

import json
from urllib.parse import urlsplit

import numpy as np
import pytest

from tinyserve.bench.config import ServeBenchConfig
from tinyserve.bench.fake_server import FakeServerConfig, FakeServerThread
from tinyserve.bench.metrics import Distribution
from tinyserve.cli import main


def test_distribution_reports_the_percentiles_asked_for():
    seconds = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    d = Distribution.of_seconds(seconds, (50, 95, 99.9))
    expected = np.percentile(np.arange(1, 101, dtype=np.float64), [50, 95, 99.9])  # linear, as vLLM
    assert list(d.percentiles) == ["p50", "p95", "p99.9"]
    assert list(d.percentiles.values()) == pytest.approx(list(expected))
    assert d.percentiles["p50"] == pytest.approx(d.median)
    assert Distribution.of_seconds(seconds).percentiles == {}  # not asked: the standard fields only
    assert Distribution.of_seconds([], (95,)).percentiles == {"p95": 0.0}


def test_bad_percentile_settings_are_refused():
    with pytest.raises(ValueError, match="metric_percentiles must be in"):
        ServeBenchConfig(metric_percentiles=(0.0,))
    with pytest.raises(ValueError, match="percentile_metrics must be among"):
        ServeBenchConfig(percentile_metrics=("ttfb",))


def test_a_vllm_bench_serve_command_runs_unchanged(tmp_path, capsys):
    with FakeServerThread(FakeServerConfig(ttft_s=0.005, itl_s=0.001)) as url:
        parts = urlsplit(url)
        argv = ["bench", "serve", "--backend", "vllm", "--host", parts.hostname, "--port", str(parts.port),
                "--model", "fake-model", "--dataset-name", "random", "--random-input-len", "16",
                "--random-output-len", "4", "--random-range-ratio", "0.5", "--random-prefix-len", "8",
                "--num-prompts", "12", "--max-concurrency", "3", "--ignore-eos", "--save-result",
                "--result-dir", str(tmp_path / "results"), "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,95,99", "--disable-tqdm"]
        assert main(argv) == 0
    out = capsys.readouterr().out
    for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
        for p in ("P50", "P95", "P99"):
            assert f"{p} {metric} (ms):" in out, (p, metric)
    assert "P90 TTFT" not in out  # the percentiles asked for replace the standard ones
    line = json.loads(out.strip().splitlines()[-1])
    (result_file,) = (tmp_path / "results").glob("serve-*.json")
    assert line["result_file"] == str(result_file) and line["completed"] == 12
    record = json.loads(result_file.read_text())
    requests = record["requests"]
    # the vLLM random workload: 8 shared prefix tokens, then 16 +- 50% random ones; 4 +- 50% tokens out
    assert all(8 + 8 <= r["prompt_len"] <= 8 + 24 for r in requests) and len({r["prompt_len"] for r in requests}) > 1, \
        [r["prompt_len"] for r in requests]
    assert all(2 <= r["max_tokens"] <= 6 for r in requests) and len({r["max_tokens"] for r in requests}) > 1
    ttfts = [r["ttft_ms"] for r in requests]
    for q in (50, 95, 99):  # the reported percentile is numpy's over the recorded requests
        assert line[f"p{q}_ttft_ms"] == pytest.approx(np.percentile(ttfts, q), abs=0.01)
    assert {key for key in line if key.startswith("p95_")} == {"p95_ttft_ms", "p95_tpot_ms", "p95_itl_ms",
                                                               "p95_e2el_ms"}


def test_vllm_prefix_repetition_spelling_and_percentile_metrics_subset(tmp_path, capsys):
    with FakeServerThread(FakeServerConfig()) as url:
        argv = ["bench", "serve", "--base-url", url, "--dataset-name", "prefix_repetition", "--random-input-len",
                "8", "--random-prefix-len", "16", "--random-output-len", "2", "--num-prompts", "8",
                "--percentile-metrics", "ttft", "--metric-percentiles", "95", "--no-progress",
                "--result-file", str(tmp_path / "run.json")]
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "P95 TTFT (ms):" in out and "TPOT (ms)" not in out and "E2EL (ms)" not in out
    line = json.loads(out.strip().splitlines()[-1])
    assert "p95_ttft_ms" in line and "p95_tpot_ms" not in line
    assert json.loads((tmp_path / "run.json").read_text())["config"]["dataset"]["name"] == "prefix-repetition"
