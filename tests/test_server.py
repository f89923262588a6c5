"""The HTTP server against the official `openai` client and raw httpx, on live servers on loopback.

One model load per module: every server here builds its engine from the same loaded model (engines may
share one: the KV pools travel with each step, not in the model).
"""

import asyncio
import json
import logging
import random
import time

import httpx
import openai
import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.loader.model_loader import load_model
from tinyserve.server.launcher import BackgroundServer

KEY = "test-key"
MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
ENGINE = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                      scheduler=SchedulerConfig(max_model_len=2048))


@pytest.fixture(scope="module")
def loaded():
    return load_model(ENGINE.model, ENGINE.dtype, "cpu")


def _start(loaded, engine_config=ENGINE, **server_kwargs):
    config = ServerConfig(port=0, **server_kwargs)
    return BackgroundServer(engine_config, config, lambda cfg: LLMEngine(cfg, loaded=loaded)).start()


@pytest.fixture(scope="module")
def server(loaded):
    srv = _start(loaded, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small_server(loaded):
    """Two sequences at a time, two waiting at most."""
    engine = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                          scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=2))
    srv = _start(loaded, engine, max_queue=2)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def _metric(base_url: str, name: str, label: str = "", default: float | None = None) -> float:
    """The first sample of `name` whose labels contain `label` (e.g. 'finished_reason="abort"')."""
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(f"tinyserve:{name}{{") and label in line.partition("}")[0]:
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise KeyError(name)
    return default


def _wait_idle(srv, timeout: float) -> float:
    """Seconds until nothing runs and every KV block is free (fails after `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        stats = srv.state.engine.stats
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"not idle after {timeout}s: {srv.state.engine.stats}")


# ---- the openai client ------------------------------------------------------------------------------

def test_completion_greedy_and_stop_string(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.startswith(" Paris")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["."])
    assert stopped.choices[0].text == " Paris" and stopped.choices[0].finish_reason == "stop"


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
    ], max_completion_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_include_usage_counts_tokens(client, server):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, logprobs=0,
                                            stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    tokens = [t for c in chunks[:-1] for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert usage.completion_tokens == len(tokens) == 7
    prompt_count = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT},
                              headers={"Authorization": f"Bearer {KEY}"}).json()["count"]
    assert usage.prompt_tokens == prompt_count
    assert "".join(ch.text for c in chunks[:-1] for ch in c.choices) == "".join(tokens)
    assert [ch.finish_reason for c in chunks[:-1] for ch in c.choices][-1] == "length"


def test_chat_streaming_n2_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "length", 1: "length"} and usage.completion_tokens == 10
    assert all(texts.values())


def test_n2_and_seed_reproducibility(client):
    def sample(seed):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                      seed=seed, n=2)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)], r.usage

    (a, usage), (b, _) = sample(1234), sample(1234)
    assert a == b and len(a) == 2 and a[0] != a[1]
    assert usage.completion_tokens == 16


def test_batch_of_prompts_with_n(client):
    prompts = [[19556], [9707, 11, 1046]]  # token ids ("Hello", " juice We")
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples agree
    assert r.usage.prompt_tokens == 1 + 3 and r.usage.completion_tokens == 12
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0, stream=True)
    finished = sorted(c.index for chunk in stream for c in chunk.choices if c.finish_reason)
    assert finished == [0, 1]


def test_logprobs_formats(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(len(top) <= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert abs(max(lp.top_logprobs[0].values()) - lp.token_logprobs[0]) < 1e-5  # greedy took the best
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert bytes(content[0].bytes).decode() == content[0].token


def test_error_classes(client, server):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", temperature=3.5)
    assert exc.value.body["param"] == "temperature" and "[0.0, 2.0]" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 3000}])
    assert "2048" in exc.value.body["message"] and exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2045)
    assert exc.value.body["param"] == "max_tokens" and "2045" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-5", prompt="x")
    assert exc.value.body["param"] == "model"
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_overload_burst_gets_503_then_recovers(small_server):
    client = openai.AsyncOpenAI(base_url=small_server.base_url + "/v1", api_key="none", max_retries=0)

    async def one(i):
        start = time.monotonic()
        try:
            r = await client.completions.create(model=MODEL, prompt=f"Request {i}:", max_tokens=8,
                                                extra_body={"ignore_eos": True})
            return "ok", r.choices[0].finish_reason, time.monotonic() - start
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and exc.response.headers["retry-after"]
            assert exc.body["code"] == "overloaded"
            return "503", None, time.monotonic() - start

    async def burst():
        return await asyncio.gather(*(one(i) for i in range(6)))  # 3 x max_queue

    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == "ok"]
    rejected = [r for r in results if r[0] == "503"]
    assert len(ok) >= 2 and len(rejected) >= 2, results
    assert all(reason == "length" for _, reason, _ in ok)
    assert max(t for *_, t in rejected) < 1.0  # refused at once, not after waiting
    _wait_idle(small_server, 5)
    after = httpx.post(small_server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert after.status_code == 200


# ---- concurrency, disconnects, timeouts -------------------------------------------------------------

def test_64_concurrent_streams_complete_without_leaks(server):
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    rng = random.Random(0)
    lengths = [rng.randint(2, 12) for _ in range(64)]

    async def one(i, max_tokens):
        stream = await client.completions.create(model=MODEL, prompt=f"Story {i}: " + "word " * rng.randint(1, 16),
                                                 max_tokens=max_tokens, stream=True, temperature=0.8,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        reasons, usage = [], None
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
        return reasons, usage.completion_tokens

    async def run():
        return await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))

    results = asyncio.run(run())
    assert [r for r, _ in results] == [["length"]] * 64
    assert [n for _, n in results] == lengths
    _wait_idle(server, 2)
    assert _metric(server.base_url, "kv_cache_usage_perc") == 0.0


def test_disconnected_streams_are_aborted_and_freed(server):
    async def one(client, i):
        body = {"prompt": f"Count to a thousand, {i}:", "max_tokens": 500, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    return  # leaving the block closes the connection mid-stream

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=30) as client:
            await asyncio.gather(*(one(client, i) for i in range(20)))

    def num_aborted() -> float:
        return _metric(server.base_url, "request_success_total", 'finished_reason="abort"', default=0.0)

    aborted_before = num_aborted()
    asyncio.run(run())
    assert _wait_idle(server, 1.0) < 1.0
    assert _metric(server.base_url, "num_requests_running") == 0
    assert num_aborted() - aborted_before == 20  # each ended by the engine as an abort, not run on to max_tokens


def _poll(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_disconnect_while_waiting_frees_the_queue(small_server):
    stats = lambda: small_server.state.engine.stats  # noqa: E731
    long_body = {"prompt": "Go on:", "max_tokens": 1000, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=small_server.base_url, timeout=60) as client:
            holders = [asyncio.create_task(client.post("/v1/completions", json=long_body)) for _ in range(2)]
            await asyncio.to_thread(_poll, lambda: stats().num_running == 2, 30)
            short = {"prompt": "x", "max_tokens": 5}
            waiters = [asyncio.create_task(client.post("/v1/completions", json=short)),
                       asyncio.create_task(_collect_stream(client, {**short, "stream": True}))]
            await asyncio.to_thread(_poll, lambda: stats().num_waiting == 2, 30)
            for task in waiters:  # the clients give up while their requests are still queued
                task.cancel()
            await asyncio.to_thread(_poll, lambda: stats().num_waiting == 0, 2)
            for task in holders:  # and the two running ones go away too
                task.cancel()
            await asyncio.to_thread(_poll, lambda: stats().num_running == 0, 2)

    asyncio.run(run())
    _wait_idle(small_server, 2)


def test_deadlines_count_from_arrival_and_a_queued_request_is_never_computed(loaded):
    """One seat, the server's --request-timeout 2.5 s. A runs (its own timeout of 50 s is capped to 2.5)
    and returns its text so far; B (1 s, streamed) and C (2 s) wait behind it and time out unscheduled."""
    one_seat = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                            scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=1))
    srv = _start(loaded, one_seat, request_timeout=2.5, warmup=False)
    body = {"prompt": "Go on:", "max_tokens": 1000, "ignore_eos": True}
    try:
        prefill_before = _metric(srv.base_url, "prefill_tokens_total", default=0.0)

        async def ended(coroutine):
            return await coroutine, time.monotonic() - start

        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                a = asyncio.create_task(ended(client.post("/v1/completions", json={**body, "timeout": 50})))
                await asyncio.to_thread(_poll, lambda: srv.state.engine.stats.num_running == 1, 10)
                return await asyncio.gather(
                    a, ended(_collect_stream(client, {**body, "stream": True, "timeout": 1.0})),
                    ended(client.post("/v1/completions", json={**body, "timeout": 2.0})))

        start = time.monotonic()
        (a, a_s), (b, b_s), (c, c_s) = asyncio.run(run())
        assert 2.5 <= a_s < 4.0 and 1.0 <= b_s < 2.0 and 2.0 <= c_s < 3.5, (a_s, b_s, c_s)
        assert a.status_code == 200, a.text
        choice, usage = a.json()["choices"][0], a.json()["usage"]
        assert choice["finish_reason"] == "timeout" and choice["text"] and 0 < usage["completion_tokens"] < 1000
        # streamed: the choice's finish reason, then the error event, then [DONE]
        assert json.loads(b[-3])["choices"][0]["finish_reason"] == "timeout"
        assert json.loads(b[-2])["error"]["code"] == "request_timeout" and b[-1] == "[DONE]"
        assert c.status_code == 504 and c.json()["error"]["code"] == "request_timeout"  # no token: nothing to return
        _wait_idle(srv, 2)
        # only A's prompt was ever computed; every one of them is counted as a timeout
        prompt_tokens = len(srv.state.engine.tokenizer.encode(body["prompt"]))
        assert _metric(srv.base_url, "prefill_tokens_total") - prefill_before == prompt_tokens
        assert _metric(srv.base_url, "request_success_total", 'finished_reason="timeout"') == 3
    finally:
        srv.stop()


async def _collect_stream(client, body) -> list[str]:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


# ---- the small endpoints, headers, metrics, logs ---------------------------------------------------

def test_models_tokenize_detokenize_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    headers = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}, headers=headers).json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, headers=headers).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                      headers=headers).json()
    assert chat["count"] > 3 and chat["max_model_len"] == 2048
    assert httpx.get(server.base_url + "/version").json()["version"]
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_health_metrics_open_and_request_id(server):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/health?deep=1").status_code == 200
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    generated = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert len(generated.headers["x-request-id"]) == 32
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"tinyserve:{name}" in text, name
    assert 'finished_reason="length"' in text and f'model_name="{MODEL}"' in text


def test_one_log_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="tinyserve.requests"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "tinyserve.requests"]
    assert len(lines) == 1
    for field in ("id=cmpl-", "prompt_tokens=5", "output_tokens=3", "queue_s=", "ttft_s=", "total_s=",
                  "finish_reason=length"):
        assert field in lines[0], lines[0]


def test_engine_death_fails_streams_and_health(loaded):
    srv = _start(loaded)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
                task = asyncio.create_task(_collect_stream(
                    client, {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}))
                await asyncio.sleep(0.5)
                srv.state.engine.engine.step = _boom
                return await task

        events = asyncio.run(run())
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert httpx.get(srv.base_url + "/health").status_code == 503
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()


def _boom():
    raise RuntimeError("simulated engine failure")
