"""Malformed and out-of-range requests, table-driven: each gets its documented status and OpenAI's error
shape, and the server keeps serving. Unknown fields are a 400 naming them (see server/openai_api/protocol.py)."""

import json

import httpx
import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.request_limits import RequestLimits
from tinyserve.server.launcher import BackgroundServer

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    engine = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                          scheduler=SchedulerConfig(max_model_len=2048))
    config = ServerConfig(port=0, api_key=KEY, limits=RequestLimits(max_body_bytes=MAX_BODY), warmup=False)
    srv = BackgroundServer(engine, config).start()
    yield srv
    srv.stop()


def completion(**fields):
    return json.dumps({"prompt": "Hello", "max_tokens": 1, **fields}).encode()


def chat(**fields):
    return json.dumps({"messages": USER, "max_tokens": 1, **fields}).encode()


# (name, path, raw body, headers (None: the right key), status, param (None: not checked), message fragment)
CASES = [
    ("bad json", C, b"{bad", None, 400, None, "malformed JSON"),
    ("empty body", C, b"", None, 400, None, "malformed JSON"),
    ("body is an array", C, b"[1, 2]", None, 400, None, "JSON object"),
    ("invalid utf-8", C, b'{"prompt": "\xff\xfe"}', None, 400, None, "malformed JSON"),
    ("prompt missing", C, b'{"max_tokens": 1}', None, 400, "prompt", "field required"),
    ("prompt wrong type", C, completion(prompt=5), None, 400, "prompt", "must be a string"),
    ("prompt empty list", C, completion(prompt=[]), None, 400, "prompt", "must not be empty"),
    ("prompt empty string", C, completion(prompt=""), None, 400, "prompt", "empty"),
    ("prompt token out of vocab", C, completion(prompt=[1, 10**7]), None, 400, "prompt", "token ids"),
    ("prompt over context", C, completion(prompt="hello " * 3000), None, 400, "prompt", "2048"),
    ("prompt+max_tokens over context", C, completion(max_tokens=2048), None, 400, "max_tokens", "2048"),
    ("temperature string", C, completion(temperature="hot"), None, 400, "temperature", "number"),
    ("temperature negative", C, completion(temperature=-1), None, 400, "temperature", "[0.0, 2.0]"),
    ("temperature huge", C, completion(temperature=1e300), None, 400, "temperature", "[0.0, 2.0]"),
    ("top_p zero", C, completion(top_p=0), None, 400, "top_p", "(0.0, 1.0]"),
    ("top_k negative", C, completion(top_k=-5), None, 400, "top_k", ">= 1"),
    ("max_tokens negative", C, completion(max_tokens=-5), None, 400, "max_tokens", ">= 1"),
    ("max_tokens huge", C, completion(max_tokens=10**18), None, 400, "max_tokens", "2048"),
    ("max_tokens float", C, completion(max_tokens=1.5), None, 400, "max_tokens", "integer"),
    ("n zero", C, completion(n=0), None, 400, "n", "[1, 128]"),
    ("n huge", C, completion(n=10**6), None, 400, "n", "[1, 128]"),
    ("n boolean", C, completion(n=True), None, 400, "n", "integer"),
    ("logprobs too many", C, completion(logprobs=100), None, 400, "logprobs", "[0, 20]"),
    ("stop empty string", C, completion(stop=[""]), None, 400, "stop", "non-empty"),
    ("stop wrong type", C, completion(stop=5), None, 400, "stop", "string"),
    ("seed negative", C, completion(seed=-1), None, 400, "seed", "2**63"),
    ("logit_bias bad key", C, completion(logit_bias={"abc": 1}), None, 400, "logit_bias", "token ids"),
    ("logit_bias out of range", C, completion(logit_bias={"5": 1000}), None, 400, "logit_bias", "[-100.0, 100.0]"),
    ("min_tokens above max", C, completion(min_tokens=5), None, 400, "min_tokens", "max_tokens"),
    ("priority string", C, completion(priority="high"), None, 400, "priority", "integer"),
    ("suffix unsupported", C, completion(suffix="."), None, 400, "suffix", "not supported"),
    ("best_of other than n", C, completion(best_of=2), None, 400, "best_of", "must equal n"),
    ("max_tokens 0 without echo", C, completion(max_tokens=0), None, 400, "max_tokens", "0 with prompt_logprobs"),
    ("stream_options without stream", C, completion(stream_options={"include_usage": True}), None, 400,
     "stream_options", "stream"),
    ("unknown model", C, completion(model="gpt-4o"), None, 404, "model", "does not exist"),
    ("unknown field refused", C, completion(frobnicate=1, store=True), None, 400, "frobnicate", "unknown field"),
    ("chat-only field on completions", C, completion(store=False), None, 400, "store", "unknown field"),
    ("chat store true", CHAT, chat(store=True), None, 400, "store", "stores no completions"),
    ("chat messages empty", CHAT, chat(messages=[]), None, 400, "messages", "at least one"),
    ("chat messages not a list", CHAT, chat(messages="hi"), None, 400, "messages", "array"),
    ("chat unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), None, 400,
     "messages[0].role", "'user'"),
    ("chat tool role without its call id", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), None, 400,
     "messages[0].tool_call_id", "required"),
    ("chat unknown role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), None, 400, "messages[0].role", None),
    ("chat content wrong type", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, 400,
     "messages[0].content", "string"),
    ("chat image part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     None, 400, "messages[0].content", "only text"),
    ("chat user content null", CHAT, chat(messages=[{"role": "user", "content": None}]), None, 400,
     "messages[0].content", "required"),
    ("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs", "logprobs"),
    ("chat top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=50), None, 400, "top_logprobs", "[0, 20]"),
    ("chat max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), None, 400, "max_completion_tokens",
     ">= 1"),
    ("chat tool without its function", CHAT, chat(tools=[{"type": "function"}]), None, 400, "tools[0].function",
     "required"),
    ("chat response_format unknown type", CHAT, chat(response_format={"type": "xml"}), None, 400,
     "response_format.type", "json_schema"),
    ("chat prompt over context", CHAT, chat(messages=[{"role": "user", "content": "hi " * 3000}]), None, 400,
     "messages", "2048"),
    ("body over the limit", C, completion(prompt="x" * MAX_BODY), None, 413, None, "exceeds the limit"),
    ("missing api key", C, completion(), {}, 401, None, "API key"),
    ("wrong api key", C, completion(), {"Authorization": "Bearer nope"}, 401, None, "API key"),
    ("detokenize bad id", "/detokenize", b'{"tokens": [-1]}', None, 400, "tokens[0]", "token id"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param,fragment", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(server, name, path, body, headers, status, param, fragment):
    r = httpx.post(server.base_url + path, content=body, headers=AUTH if headers is None else headers, timeout=30)
    assert r.status_code == status, r.text
    if status == 200:
        return
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str) and "Traceback" not in r.text
    if param is not None:
        assert error["param"] == param, error
    if fragment is not None:
        assert fragment in error["message"], error


def test_unknown_route_and_method(server):
    r = httpx.get(server.base_url + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.base_url + C, headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()


def test_chunked_body_over_the_limit(server):
    def chunks():  # no Content-Length: the limit is enforced as the body arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 4096 + 1):
            yield b"x" * 4096
        yield b'"}'

    r = httpx.post(server.base_url + C, content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_still_serving_after_the_table(server):
    r = httpx.post(server.base_url + C, json={"prompt": "Hello", "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    stats = server.state.engine.stats
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
