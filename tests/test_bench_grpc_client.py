"""`bench serve --backend grpc` (bench/grpc_client.py) against a live tinyserve serving HTTP and gRPC: the
same greedy texts and token counts as the HTTP backend for the same requests, the server's refusals
counted as failed requests, and the config's checks."""

import pytest

from test_server_grpc import small_server as server  # noqa: F401 - a fixture: 2 seats, 2 waiting at most
from tinyserve.bench import BenchError
from tinyserve.bench.config import DatasetConfig, ServeBenchConfig
from tinyserve.bench.datasets import SampleRequest
from tinyserve.bench.serve import run_serve, summary_line

REQUESTS = [SampleRequest(f"Story {i}: once upon a time", 8, 6) for i in range(4)]


def _config(srv, backend: str, **kwargs) -> ServeBenchConfig:
    return ServeBenchConfig(base_url=srv.base_url, backend=backend, grpc_target=srv.grpc_target,
                            dataset=DatasetConfig(num_prompts=len(REQUESTS)), show_progress=False, **kwargs)


def test_grpc_backend_gets_the_texts_the_http_backend_gets(server):
    runs = {backend: run_serve(_config(server, backend, max_concurrency=2, ignore_eos=True), REQUESTS)
            for backend in ("http", "grpc")}
    grpc_run, http_run = runs["grpc"], runs["http"]
    assert grpc_run.model == http_run.model == server.state.model_name  # discovered by ListModels
    assert (grpc_run.metrics.num_completed, grpc_run.metrics.num_failed) == (4, 0)
    assert [r.text for r in grpc_run.results] == [r.text for r in http_run.results]
    assert [r.num_output_tokens for r in grpc_run.results] == [6] * 4
    assert all(r.finish_reason == "length" and len(r.chunk_times) >= 1 for r in grpc_run.results)
    assert summary_line(grpc_run)["backend"] == "grpc"


def test_refusals_are_failed_requests_and_unknown_extra_fields_an_error(server):
    burst = [SampleRequest(f"Go on {i}:", 3, 60) for i in range(8)]  # 8 at once: 2 seats, 2 waiting
    run = run_serve(_config(server, "grpc", ignore_eos=True, num_warmups=0), burst)
    assert run.metrics.num_failed >= 1 and run.metrics.num_completed >= 2
    assert {r.error for r in run.results if not r.success} == {"grpc_resource_exhausted"}
    with pytest.raises(BenchError, match="no field 'guided_schema'"):
        run_serve(_config(server, "grpc", extra_body={"guided_schema": "{}"}), REQUESTS)
    with pytest.raises(ValueError, match="completions only"):
        _config(server, "grpc", endpoint="/v1/chat/completions")
