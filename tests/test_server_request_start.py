"""server/intake/request_start.py: chat, completions and gRPC start their requests through the one start path, on a
live server (HTTP and gRPC) on the default model: each request's metrics are tagged with its API, a request
refused at admission gets the same error (and the same refusal count, under its API) from every surface,
and HTTP's and gRPC's streams write through the one slow-reader guard. One model load for the module."""

import grpc
import httpx
import pytest

from test_server import ENGINE, _start
from test_server_grpc import _metric, _wait_idle, stub  # noqa: F401 - its stub fixture, over this module's server
from tinyserve.server.grpc_api.proto import tinyserve_pb2 as pb
from tinyserve.server.intake.slow_reader import SlowReaderGuard

MAX_QUEUE = 2
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(smollm2_loaded):
    srv = _start(smollm2_loaded, ENGINE, grpc_port=0, warmup=False, max_queue=MAX_QUEUE)
    yield srv
    srv.stop()


def _chat(server, **fields) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 2, **fields}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def _completion(server, **fields) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields},
                      timeout=60)


def test_every_surface_tags_its_requests_with_its_api(server, stub, monkeypatch):
    metrics = server.state.default.metrics
    tagged = []
    monkeypatch.setattr(metrics, "track_api", lambda request_id, num_samples, api: tagged.append(
        (request_id.split("-")[0], num_samples, api)))
    assert _chat(server).status_code == 200
    assert _completion(server, n=2).status_code == 200
    stub.Generate(pb.GenerateRequest(text="Hi", max_tokens=2), timeout=60)
    list(stub.GenerateStream(pb.GenerateRequest(text="Hi", max_tokens=2), timeout=60))
    _wait_idle(server)
    assert tagged == [("chatcmpl", 1, "http"), ("cmpl", 2, "http"), ("cmpl", 1, "grpc"), ("cmpl", 1, "grpc")]


@pytest.mark.parametrize("refusal", ["too many samples", "shutting down"])
def test_a_refusal_at_admission_is_the_same_error_from_every_surface(server, stub, refusal):
    """400 too_many_samples (the second admission, once the samples are known) and 503 shutting_down (the
    first, before the body is read): the same message, code and param on each surface, and each refusal
    counted under the API it came in by."""
    fields = {"n": MAX_QUEUE + 1} if refusal == "too many samples" else {}

    def rejected(api: str) -> float:
        return _metric(server, "request_rejected_total", f'api="{api}"')

    before = {api: rejected(api) for api in ("http", "grpc")}
    if refusal == "shutting down":
        server.state.phase = "draining"
    try:
        answers = [_chat(server, **fields), _completion(server, **fields)]
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(text="Hi", max_tokens=2, **fields), timeout=60)
    finally:
        server.state.phase = "ready"
    status = 400 if refusal == "too many samples" else 503
    assert [r.status_code for r in answers] == [status, status]
    [error] = {tuple(sorted(r.json()["error"].items())) for r in answers}  # chat's and completions' alike
    error = dict(error)
    expected_code = grpc.StatusCode.INVALID_ARGUMENT if status == 400 else grpc.StatusCode.UNAVAILABLE
    assert (info.value.code(), info.value.details()) == (expected_code, error["message"])
    trailers = dict(info.value.trailing_metadata())
    assert (trailers["tinyserve-error-code"], trailers.get("tinyserve-error-param")) == (error["code"], error["param"])
    assert (rejected("http") - before["http"], rejected("grpc") - before["grpc"]) == (2, 1)


def test_http_and_grpc_streams_write_through_the_one_slow_reader_guard(server, stub, monkeypatch):
    writes = []
    send = SlowReaderGuard.send

    async def spied(guard, message):
        writes.append(type(message).__name__)
        await send(guard, message)

    monkeypatch.setattr(SlowReaderGuard, "send", spied)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and list(r.iter_lines())[-2] == "data: [DONE]"
    num_http = len(writes)
    list(stub.GenerateStream(pb.GenerateRequest(text="Hi", max_tokens=2), timeout=60))
    assert num_http >= 3 and set(writes[:num_http]) == {"dict"}  # ASGI messages: start, body chunks, end
    assert len(writes) > num_http and set(writes[num_http:]) == {"GenerateStreamResponse"}
