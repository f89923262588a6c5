"""The gRPC API (server/grpc_api/grpc_service.py) with the grpcio client, on live servers that also serve HTTP: the
same greedy text as HTTP for the same request, streams that add up to the unary text, HTTP's messages as
INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED, the standard health service (SERVING, NOT_SERVING
while loading and draining) and reflection, cancelled calls that free their requests, the `api` label,
and the committed generated code matching the proto. One model load for the module (conftest's)."""

import asyncio
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from test_server import ENGINE, _start
from test_server_lifecycle import SERVE, _free_port
from tinyserve.server.grpc_api.proto import tinyserve_pb2 as pb
from tinyserve.server.grpc_api.proto import tinyserve_pb2_grpc

KEY = "grpc-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = "The capital of France is"
PROTO = Path(__file__).parents[1] / "tinyserve/server/grpc_api/proto/tinyserve.proto"


@pytest.fixture(scope="module")
def server(smollm2_loaded):
    srv = _start(smollm2_loaded, ENGINE, grpc_port=0, warmup=False, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small_server(smollm2_loaded):
    """Two sequences at a time, two waiting at most."""
    srv = _start(smollm2_loaded, replace(ENGINE, scheduler=replace(ENGINE.scheduler, max_num_seqs=2)),
                 grpc_port=0, warmup=False, max_queue=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield tinyserve_pb2_grpc.TinyServeStub(channel)


def http(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _wait_idle(srv, timeout: float = 5.0) -> None:
    """Nothing running or waiting and every KV block free, within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = srv.state.engine.stats
        if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks:
            return
        time.sleep(0.02)
    raise AssertionError(f"not idle after {timeout}s: {srv.state.engine.stats}")


def _poll(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _metric(srv, name: str, *labels: str) -> float:
    """The sum of the samples of `name` whose labels contain every one of `labels`."""
    total = 0.0
    for line in httpx.get(srv.base_url + "/metrics").text.splitlines():
        if line.startswith(f"tinyserve:{name}{{") and all(label in line.partition("}")[0] for label in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ---- generation: the same text as HTTP -------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"max_tokens": 8, "temperature": 0.0},
    {"max_tokens": 8, "temperature": 0.0, "stop": ["."]},
    {"max_tokens": 6, "temperature": 0.9, "seed": 7, "n": 2, "top_k": 20},
], ids=["greedy", "stop string", "seeded n=2"])
def test_generate_gives_the_text_http_gives_for_the_same_request(server, stub, fields):
    reply = stub.Generate(pb.GenerateRequest(text=PROMPT, **fields), metadata=AUTH, timeout=60)
    body = http(server, "/v1/completions", {"prompt": PROMPT, **fields}).json()
    assert [c.text for c in reply.choices] == [c["text"] for c in body["choices"]]
    assert [c.finish_reason for c in reply.choices] == [c["finish_reason"] for c in body["choices"]]
    assert reply.usage.prompt_tokens == body["usage"]["prompt_tokens"]
    assert reply.usage.completion_tokens == body["usage"]["completion_tokens"]
    assert sum(len(c.token_ids) for c in reply.choices) == reply.usage.completion_tokens
    assert reply.id.startswith("cmpl-") and reply.model == server.state.model_name


def test_token_id_prompts_and_logprobs(server, stub):
    ids = list(stub.Tokenize(pb.TokenizeRequest(prompt=PROMPT), metadata=AUTH).tokens)
    by_text = stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=5, temperature=0.0, logprobs=2),
                            metadata=AUTH, timeout=60)
    by_ids = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=5, temperature=0.0,
                                              logprobs=2), metadata=AUTH, timeout=60)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert list(by_ids.choices[0].token_ids) == list(by_text.choices[0].token_ids)
    http_logprobs = http(server, "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0.0,
                                                     "logprobs": 2}).json()["choices"][0]["logprobs"]
    logprobs = by_ids.choices[0].logprobs
    assert [lp.logprob for lp in logprobs] == pytest.approx(http_logprobs["token_logprobs"], abs=1e-5)
    assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in logprobs)
    assert [lp.token_id for lp in logprobs] == list(by_ids.choices[0].token_ids)


def test_stream_adds_up_to_the_unary_text_then_sends_the_usage(stub):
    request = pb.GenerateRequest(text=PROMPT, max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True)
    unary = stub.Generate(request, metadata=AUTH, timeout=60)
    messages = list(stub.GenerateStream(request, metadata=AUTH, timeout=60))
    *deltas, last = messages
    assert all(m.HasField("choice") and not m.HasField("usage") for m in deltas)
    assert not last.HasField("choice") and last.usage == unary.usage
    for index, choice in enumerate(unary.choices):
        mine = [m.choice for m in deltas if m.choice.index == index]
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.token_ids] == list(choice.token_ids)
        assert [c.finish_reason for c in mine] == [""] * (len(mine) - 1) + ["length"]
    assert len({m.id for m in messages}) == 1


# ---- errors: HTTP's messages as gRPC status codes ---------------------------------------------------

@pytest.mark.parametrize("fields, body", [
    ({"text": PROMPT, "temperature": -1.0}, {"prompt": PROMPT, "temperature": -1.0}),
    ({"text": PROMPT, "top_p": 1.5}, {"prompt": PROMPT, "top_p": 1.5}),
    ({"text": PROMPT, "max_tokens": -3}, {"prompt": PROMPT, "max_tokens": -3}),
    ({"text": PROMPT, "max_tokens": 5000}, {"prompt": PROMPT, "max_tokens": 5000}),
    ({"token_ids": pb.TokenIds(ids=[1, 10**8])}, {"prompt": [1, 10**8]}),
    ({"token_ids": pb.TokenIds(ids=[])}, {"prompt": []}),
    ({}, {}),
    ({"text": PROMPT, "priority": 5000}, {"prompt": PROMPT, "priority": 5000}),
    ({"text": PROMPT, "logit_bias": {10**8: 1.0}}, {"prompt": PROMPT, "logit_bias": {str(10**8): 1.0}}),
    ({"text": PROMPT, "guided_regex": "(unclosed"}, {"prompt": PROMPT, "guided_regex": "(unclosed"}),
    ({"text": PROMPT, "n": 2, "guided_choice": ["a", ""]}, {"prompt": PROMPT, "n": 2, "guided_choice": ["a", ""]}),
], ids=["temperature", "top_p", "negative max_tokens", "past the context", "token id", "empty ids", "no prompt",
        "priority", "logit_bias id", "regex", "choice"])
def test_bad_input_is_invalid_argument_with_https_message(server, stub, fields, body):
    refused = http(server, "/v1/completions", body)
    assert refused.status_code == 400, refused.text
    error = _rpc_error(lambda: stub.Generate(pb.GenerateRequest(**fields), metadata=AUTH, timeout=60))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == refused.json()["error"]["message"]
    trailers = dict(error.trailing_metadata())
    assert trailers["tinyserve-error-code"] == refused.json()["error"]["code"]
    assert trailers.get("tinyserve-error-param") == refused.json()["error"]["param"]
    _wait_idle(server)


def test_unknown_model_unknown_field_and_api_key(server, stub):
    missing = _rpc_error(lambda: stub.Generate(pb.GenerateRequest(model="gpt-5", text="x"), metadata=AUTH))
    http_message = http(server, "/v1/completions", {"model": "gpt-5", "prompt": "x"}).json()["error"]["message"]
    assert missing.code() == grpc.StatusCode.NOT_FOUND and missing.details() == http_message
    # a field this proto lacks (a newer client's, number 99) is refused, as an unknown JSON field is
    raw = pb.GenerateRequest(text="x").SerializeToString() + b"\x98\x06\x01"
    with grpc.insecure_channel(server.grpc_target) as channel:  # raw bytes: the stub cannot build them
        generate = channel.unary_unary("/tinyserve.v1.TinyServe/Generate",
                                       response_deserializer=pb.GenerateResponse.FromString)
        unknown = _rpc_error(lambda: generate(raw, metadata=AUTH, timeout=60))
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT and unknown.details().startswith("field 99: unknown")
    # bytes that are no GenerateRequest (a truncated string, bad UTF-8): INVALID_ARGUMENT, not grpcio's UNKNOWN
    for garbage in (b"\x12\x05Hel", b"\x0a\x02\xc3\x28\x12\x01x", b"\xff" * 16):
        with grpc.insecure_channel(server.grpc_target) as channel:
            generate = channel.unary_unary("/tinyserve.v1.TinyServe/Generate",
                                           response_deserializer=pb.GenerateResponse.FromString)
            broken = _rpc_error(lambda: generate(garbage, metadata=AUTH, timeout=60))
        assert broken.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage, broken.details())
        assert broken.details().startswith("the request is not a valid GenerateRequest: Error parsing message")
        assert dict(broken.trailing_metadata())["tinyserve-error-code"] == "invalid_message"
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        refused = _rpc_error(lambda: stub.ListModels(pb.ListModelsRequest(), metadata=metadata))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in refused.details()


def test_overload_is_resource_exhausted_and_cancelled_calls_free_their_requests(small_server):
    stats = lambda: small_server.state.engine.stats  # noqa: E731
    long = pb.GenerateRequest(text="Go on:", max_tokens=1000, ignore_eos=True)

    async def run():
        async with grpc.aio.insecure_channel(small_server.grpc_target) as channel:
            stub = tinyserve_pb2_grpc.TinyServeStub(channel)
            running = [stub.GenerateStream(long) for _ in range(2)]
            for call in running:
                await call.read()  # its first token: it has a seat
            waiting = [stub.Generate(long), stub.GenerateStream(long)]
            await asyncio.to_thread(_poll, lambda: stats().num_waiting == 2)
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(pb.GenerateRequest(text="x", max_tokens=2))
            assert time.monotonic() - start < 1.0  # refused at once, not after waiting
            for call in waiting + running:  # every client gives up: queued and running requests alike
                call.cancel()
            await asyncio.to_thread(_poll, lambda: stats().num_waiting == stats().num_running == 0, 5)
            return refused.value

    aborted_before = _metric(small_server, "request_success_total", 'api="grpc"', 'finished_reason="abort"')
    refused = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details().startswith("the server is overloaded (")
    trailers = dict(refused.trailing_metadata())
    assert trailers["tinyserve-error-code"] == "overloaded" and trailers["retry-after"] == "1"
    assert _metric(small_server, "request_rejected_total", 'api="grpc"', 'reason="overloaded"') == 1
    _wait_idle(small_server)
    # the four requests ended as aborts in the engine (not run on to max_tokens)
    _poll(lambda: _metric(small_server, "request_success_total", 'api="grpc"', 'finished_reason="abort"')
          - aborted_before == 4, 5)
    assert _metric(small_server, "num_requests_running") == 0


def test_a_stream_cancelled_mid_way_is_aborted_and_freed(server):
    aborted = lambda: _metric(server, "request_success_total", 'api="grpc"', 'finished_reason="abort"')  # noqa: E731
    before = aborted()
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = tinyserve_pb2_grpc.TinyServeStub(channel).GenerateStream(
            pb.GenerateRequest(text="Count to a thousand:", max_tokens=500, ignore_eos=True), metadata=AUTH)
        for _, _ in zip(range(3), call):
            pass
        call.cancel()
    _wait_idle(server, 2)
    _poll(lambda: aborted() - before == 1, 5)


# ---- the other RPCs, health, reflection, metrics ------------------------------------------------------

def test_tokenize_and_list_models_match_http(server, stub):
    mine = stub.Tokenize(pb.TokenizeRequest(prompt=PROMPT, add_special_tokens=False), metadata=AUTH)
    theirs = http(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert list(mine.tokens) == theirs["tokens"] and mine.count == theirs["count"]
    assert mine.max_model_len == theirs["max_model_len"] == 2048
    models = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    listed = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [(m.id, m.root, m.state, m.max_model_len, m.memory_bytes) for m in models] == \
        [(m["id"], m["root"], m["state"], m["max_model_len"], m["memory_bytes"]) for m in listed]
    assert not models[0].HasField("error")


def test_health_is_serving_and_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tinyserve.v1.TinyServe"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in answer.list_services_response.service}
        assert {"tinyserve.v1.TinyServe", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
        [described] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="tinyserve.v1.TinyServe")]))
        assert described.file_descriptor_response.file_descriptor_proto[0] == pb.DESCRIPTOR.serialized_pb


def test_request_metrics_carry_the_api(server, stub):
    def finished(api: str) -> float:
        return _metric(server, "request_success_total", f'api="{api}"', 'finished_reason="length"')

    def ttft_count(api: str) -> float:
        return _metric(server, "time_to_first_token_seconds_count", f'api="{api}"')

    before = {api: (finished(api), ttft_count(api)) for api in ("http", "grpc")}
    stub.Generate(pb.GenerateRequest(text="Hi", max_tokens=3, n=2, ignore_eos=True), metadata=AUTH, timeout=60)
    http(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    _wait_idle(server)
    assert (finished("grpc") - before["grpc"][0], ttft_count("grpc") - before["grpc"][1]) == (2, 2)
    assert (finished("http") - before["http"][0], ttft_count("http") - before["http"][1]) == (1, 1)
    assert server.state.default.metrics._api_of == {}  # every tagged request forgotten with its last sample


def test_the_committed_generated_code_matches_the_proto(tmp_path):
    from grpc_tools import protoc

    out = tmp_path / "descriptor.pb"
    root = PROTO.parents[4]
    assert protoc.main(["protoc", f"-I{root}", f"--descriptor_set_out={out}",
                        str(PROTO.relative_to(root))]) == 0
    from google.protobuf import descriptor_pb2

    generated = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in generated.message_type:  # the Python code generator leaves the JSON names out
        for field in [*message.field, *(f for nested in message.nested_type for f in nested.field)]:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert generated == committed, "regenerate tinyserve_pb2*.py (the command is in tinyserve.proto's header)"


# ---- a process: NOT_SERVING while loading and draining, SIGTERM drains gRPC calls and exits 0 ---------

def test_health_follows_loading_and_draining_and_sigterm_drains_grpc_calls():
    port, grpc_port = _free_port(), _free_port()
    proc = subprocess.Popen([*SERVE, "--port", str(port), "--grpc-port", str(grpc_port), "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # reconnect every 50 ms: grpcio's default backoff (1 s, growing) can outlast a quick load, and the
        # first Check would then come after it, SERVING
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 50)]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
            health, stub = health_pb2_grpc.HealthStub(channel), tinyserve_pb2_grpc.TinyServeStub(channel)
            seen = _health_until_serving(health, proc)
            assert seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING, seen  # while loading
            short = stub.GenerateStream(pb.GenerateRequest(text="Count:", max_tokens=4, ignore_eos=True))
            held = stub.GenerateStream(pb.GenerateRequest(text="Count:", max_tokens=1500, ignore_eos=True))
            assert next(short).choice.text and next(held).choice.text
            proc.send_signal(signal.SIGTERM)
            _poll(lambda: health.Check(health_pb2.HealthCheckRequest()).status
                  == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
            refused = _rpc_error(lambda: stub.Generate(pb.GenerateRequest(text="Hi", max_tokens=2), timeout=10))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.details() == "the server is shutting down"
            *_, last_delta, usage = short  # the drain lets a call in flight finish
            assert last_delta.choice.finish_reason == "length" and usage.usage.completion_tokens == 4
            assert proc.poll() is None  # the drain still waits for the other one, until its client gives up
            held.cancel()
            assert proc.wait(timeout=30) == 0
        output = proc.stdout.read()
        assert "Traceback" not in output and "aborting" not in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _health_until_serving(health, proc: subprocess.Popen, timeout: float = 300) -> list:
    """The distinct statuses Check gave, in order, until SERVING."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:  # not bound yet
            time.sleep(0.05)
            continue
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == health_pb2.HealthCheckResponse.SERVING:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"not SERVING after {timeout}s; saw {seen}")
