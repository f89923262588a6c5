"""The load generator end to end against a fake OpenAI-compatible streaming server on loopback."""

import json
import sys

import pytest

from tinyserve.bench import BenchError
from tinyserve.bench.config import DatasetConfig, ServeBenchConfig
from tinyserve.bench.datasets import SampleRequest
from tinyserve.bench.fake_server import FakeServerConfig, FakeServerThread
from tinyserve.bench.serve import run_record, run_serve
from tinyserve.cli import main


def requests(n, output_len=8):
    return [SampleRequest(f"prompt number {i}", 3, output_len) for i in range(n)]


def config(url, n, **kwargs):
    return ServeBenchConfig(base_url=url, dataset=DatasetConfig(num_prompts=n), show_progress=False, **kwargs)


def test_completions_timings_usage_and_concurrency_limit():
    fake = FakeServerThread(FakeServerConfig(ttft_s=0.02, itl_s=0.003))
    with fake as url:
        run = run_serve(config(url, 24, max_concurrency=4, ignore_eos=True, num_warmups=2), requests(24))
    m = run.metrics
    assert run.model == "fake-model"  # discovered through GET /v1/models
    assert (m.num_completed, m.num_failed) == (24, 0)
    assert m.total_output_tokens == sum(r.usage_completion_tokens for r in run.results) == 24 * 8
    assert fake.server.stats.peak_in_flight <= 4 and m.max_concurrent_requests == 4
    body = fake.server.stats.bodies[-1]
    assert len(fake.server.stats.bodies) == 26  # 2 warm-ups + 24, nothing retried
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["max_tokens"] == 8 and body["model"] == "fake-model" and body["prompt"].startswith("prompt number")
    assert 20 <= m.ttft_ms.median < 1000  # lower bounds are the fake server's sleeps; upper ones are loose
    assert 2 <= m.itl_ms.median < 100 and m.itl_ms.count == 24 * 7
    for r in run.results:  # TPOT spans the gaps and the tail after the last token ([DONE]); sleeps make no bound
        tail = r.tpot * (r.num_output_tokens - 1) - sum(r.itls)
        assert 0 <= tail + 1e-9 and tail < 0.5
    assert all(r.text == " tok" * 8 and r.finish_reason == "length" for r in run.results)
    record = run_record(run)
    assert json.loads(json.dumps(record))["config"]["request_rate"] == "inf"
    assert len(record["requests"]) == 24 and len(record["requests"][0]["itl_ms"]) == 7


def test_chat_without_usage_counts_chunks():
    fake = FakeServerThread(FakeServerConfig(tokens_per_chunk=2))
    with fake as url:
        run = run_serve(config(url, 5, endpoint="/v1/chat/completions", model="m", include_usage=False,
                               num_warmups=0, extra_body={"top_k": 1}), requests(5, output_len=6))
    body = fake.server.stats.bodies[0]  # all five leave at once: any of them may arrive first
    assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    contents = sorted(b["messages"][0]["content"] for b in fake.server.stats.bodies)
    assert contents == [f"prompt number {i}" for i in range(5)]
    assert "stream_options" not in body
    assert body["top_k"] == 1 and "ignore_eos" not in body
    assert run.metrics.num_completed == 5
    assert all(r.usage_completion_tokens is None and r.num_output_tokens == 3 for r in run.results)  # chunks


def test_refusals_are_failures_by_reason_not_retried():
    fake = FakeServerThread(FakeServerConfig(fail_every=3))
    with fake as url:
        run = run_serve(config(url, 12, max_concurrency=2, model="m", num_warmups=0), requests(12))
    assert run.metrics.failures == {"http_503": 4} and run.metrics.num_completed == 8
    assert len(fake.server.stats.bodies) == 12
    assert "overloaded" in next(r.error_detail for r in run.results if not r.success)


def test_overloaded_server_sheds_load_and_it_shows():
    fake = FakeServerThread(FakeServerConfig(max_concurrent=2, itl_s=0.005))
    with fake as url:
        run = run_serve(config(url, 10, model="m", num_warmups=0), requests(10))  # all 10 at once
    assert run.metrics.num_failed >= 1 and set(run.metrics.failures) == {"http_503"}
    assert len(fake.server.stats.bodies) == 10


def test_cut_stream_is_a_failure():
    with FakeServerThread(FakeServerConfig(drop_after_tokens=3)) as url:
        run = run_serve(config(url, 3, model="m", num_warmups=0), requests(3))
    assert run.metrics.num_completed == 0
    assert set(run.metrics.failures) <= {"connection_closed", "incomplete_stream"}
    assert all(len(r.chunk_times) == 3 for r in run.results)


def test_failed_warmup_and_unreachable_server_stop_the_run():
    with FakeServerThread(FakeServerConfig(fail_every=1)) as url:
        with pytest.raises(BenchError, match="warm-up request .* failed \\(http_503\\)"):
            run_serve(config(url, 2, model="m"), requests(2))
    with pytest.raises(BenchError, match="connect_error"):
        run_serve(config("http://127.0.0.1:9", 2, model="m"), requests(2))  # port 9: nothing listens


def _cli_args(url, tmp_path):
    return ["bench", "serve", "--base-url", url, "--num-prompts", "6", "--input-len", "16", "--output-len", "4",
            "--max-concurrency", "3", "--result-file", str(tmp_path / "run.json"), "--no-progress",
            "--goodput", "ttft:1000", "tpot:1000"]


def test_cli_serve_writes_result_summary_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with FakeServerThread(FakeServerConfig(itl_s=0.001)) as url:
        assert main(_cli_args(url, tmp_path) + ["--plot"]) == 0
    out = capsys.readouterr().out
    assert "Serving benchmark" in out and "Client CPU share" in out
    line = json.loads(out.strip().splitlines()[-1])
    assert line["completed"] == 6 and line["total_output_tokens"] == 24 and line["goodput"] > 0
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["metrics"]["total_output_tokens"] == 24 and record["client"]["num_with_usage"] == 6
    assert all(r["prompt_len"] == 16 for r in record["requests"])
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_cli_plot_without_matplotlib_fails_first_and_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(_cli_args("http://127.0.0.1:9", tmp_path) + ["--plot"]) == 1
    assert "--plot needs matplotlib: pip install" in capsys.readouterr().err


def test_cli_sweep_two_servers_side_by_side(tmp_path, capsys):
    with FakeServerThread(FakeServerConfig(itl_s=0.001)) as a, FakeServerThread(FakeServerConfig()) as b:
        argv = ["bench", "sweep", "--base-url", f"slow={a}", "--base-url", f"fast={b}", "--concurrency", "1", "2",
                "--num-runs", "2", "--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--no-progress",
                "--result-file", str(tmp_path / "sweep.json")]
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| server | concurrency |" in out
    line = json.loads(out.strip().splitlines()[-1])
    assert [(r["server"], r["concurrency"], r["failed"]) for r in line["rows"]][0] == ("slow", 1, 0)
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert [(r["server"], r["concurrency"]) for r in record["rows"]] == [("slow", 1), ("slow", 2), ("fast", 1),
                                                                         ("fast", 2)]
    assert all(r["out tok/s"]["num_runs"] == 2 for r in record["rows"]) and len(record["runs"]) == 8
    assert all(run["failed"] == 0 and run["total_output_tokens"] == 12 for run in record["runs"])


def test_sweep_repeats_draw_fresh_prompts_the_same_for_every_server(tmp_path):
    """A repeat must not find its prompts in a prefix cache warmed by the previous one."""
    fakes = [FakeServerThread(FakeServerConfig()), FakeServerThread(FakeServerConfig())]
    with fakes[0] as a, fakes[1] as b:
        argv = ["bench", "sweep", "--base-url", f"a={a}", "--base-url", f"b={b}", "--concurrency", "1",
                "--num-runs", "2", "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--num-warmups", "0",
                "--no-progress", "--result-file", str(tmp_path / "sweep.json")]
        assert main(argv) == 0
    prompts = [[str(body["prompt"]) for body in fake.server.stats.bodies] for fake in fakes]
    assert prompts[0] == prompts[1] and len(prompts[0]) == 6  # both servers: the same prompts, run by run
    assert not set(prompts[0][:3]) & set(prompts[0][3:])  # run 2 drew none of run 1's prompts


def test_warm_up_prompt_shares_no_prefix_with_the_timed_ones(tmp_path):
    fake = FakeServerThread(FakeServerConfig())
    with fake as url:
        argv = ["bench", "serve", "--base-url", url, "--num-prompts", "3", "--input-len", "8", "--output-len", "2",
                "--num-warmups", "1", "--no-progress", "--result-file", str(tmp_path / "run.json")]
        assert main(argv) == 0
    warm_up, *timed = [str(body["prompt"]) for body in fake.server.stats.bodies]
    assert warm_up.startswith("Warm-up. ") and len(timed) == 3
    assert warm_up.removeprefix("Warm-up. ") in timed  # the same shape of request, another first token
