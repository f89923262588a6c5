"""Two replicas behind vllm-router on loopback (docs/REPLICAS.md): requests through the router get OpenAI
bodies, a stream arrives whole and says the same as the plain request, and with the cache-aware policy each
of two long prefixes stays on one replica, the two on different replicas, and every follow-up finds its
prefix in that replica's cache.

The replicas are two in-process servers on the default model (one load, two engines); the router is the
`vllm-router` binary from the test extra, as docs/REPLICAS.md starts it."""

import json
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import start_default_model_server

PREFIX_WORDS = 300  # of the default model's tokens, about 1 each: several blocks of 16, so a cache hit is plain


def _router_binary() -> str:
    # the venv's own bin first: `make test` runs .venv/bin/pytest without activating the venv
    path = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if path is None:
        pytest.skip("vllm-router is not installed (it is in the test extra: `make setup` installs it)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counter(metrics_text: str, name: str) -> float:
    """The sum of a tinyserve counter over its labels."""
    return sum(float(v) for v in re.findall(rf"^tinyserve:{name}_total{{[^}}]*}} (\S+)$", metrics_text, re.M))


def _gauge(metrics_text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^tinyserve:{name}{{[^}}]*}} (\S+)$", metrics_text, re.M))


class Replicas:
    def __init__(self, servers, router_url: str):
        self.servers, self.url = servers, router_url

    def successes(self) -> list[float]:
        return [_counter(httpx.get(s.base_url + "/metrics").text, "request_success") for s in self.servers]

    def complete(self, prompt: str, **fields) -> tuple[dict, int]:
        """(the response body, the index of the replica that served it): requests are sent one at a time,
        so the replica whose finished-requests counter moved is the one the router chose."""
        before = self.successes()
        r = httpx.post(self.url + "/v1/completions", timeout=120,
                       json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        moved = [i for i, (a, b) in enumerate(zip(self.successes(), before)) if a > b]
        assert len(moved) == 1, f"finished-request counters moved on replicas {moved}"
        return r.json(), moved[0]


@pytest.fixture(scope="module")
def replicas(smollm2_loaded, tmp_path_factory):
    router = _router_binary()
    # strict about fields, as served by default: the router re-serializes each request with SGLang's extras
    # (no_stop_trim, return_hidden_states, ...), which tinyserve accepts at the values it sends
    # (server/intake/router_fields.py, docs/REPLICAS.md)
    servers = [start_default_model_server(smollm2_loaded) for _ in range(2)]
    port, log = _free_port(), tmp_path_factory.mktemp("router") / "router.log"
    proc = subprocess.Popen([router, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                             "--worker-urls", *(s.base_url for s in servers), "--prometheus-port", str(_free_port()),
                             "--worker-startup-check-interval", "1", "--log-level", "warning"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"vllm-router exited {proc.returncode}: {log.read_text()[-2000:]}"
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not bound yet
            assert time.monotonic() < deadline, f"vllm-router not ready after 30 s: {log.read_text()[-2000:]}"
            time.sleep(0.1)
        yield Replicas(servers, url)
    finally:
        proc.terminate()
        proc.wait(10)
        for s in servers:
            s.stop()


def _prefix(initial: str, seed: int) -> str:
    # distinct first words: the router's tree matches characters, so two prefixes share nothing with it
    rng = random.Random(seed)
    words = "river stone cloud maple orbit lantern copper meadow signal harbor velvet summit".split()
    return initial + " " + " ".join(rng.choice(words) for _ in range(PREFIX_WORDS))


def test_completion_and_chat_through_the_router_are_openai_bodies(replicas):
    body, _ = replicas.complete("The capital of France is", max_tokens=8, ignore_eos=True)
    assert body["object"] == "text_completion" and body["model"] == "smollm2-135m"
    assert body["choices"][0]["text"] and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8  # ignore_eos went through the router

    r = httpx.post(replicas.url + "/v1/chat/completions", timeout=120,
                   json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stream_through_the_router_arrives_whole(replicas):
    prompt = "Write a list of three colours:"
    plain, _ = replicas.complete(prompt, max_tokens=12, ignore_eos=True)
    events = []
    with httpx.stream("POST", replicas.url + "/v1/completions", timeout=120,
                      json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain["choices"][0]["text"]  # greedy: the stream says what the plain request said
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_cache_aware_routing_keeps_each_prefix_on_one_replica(replicas):
    """Prefix A's first request is held open (a long stream) while B's first request arrives, so the
    router's least-loaded choice sends B to the other replica; then follow-ups of A and B, in an order
    round-robin would split, each go to their prefix's replica and find the prefix cached there."""
    prefix_a, prefix_b = _prefix("Alpha", 1), _prefix("Zulu", 2)
    before = replicas.successes()
    first_a_started = threading.Event()

    def hold_a():
        with httpx.stream("POST", replicas.url + "/v1/completions", timeout=120,
                          json={"model": "smollm2-135m", "prompt": prefix_a + " question 0:", "max_tokens": 64,
                                "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                first_a_started.set()  # its prompt is computed: its blocks are cached from here on

    holder = threading.Thread(target=hold_a, daemon=True)
    holder.start()
    assert first_a_started.wait(60), "the first request of prefix A never streamed"
    running = [_gauge(httpx.get(s.base_url + "/metrics").text, "num_requests_running") for s in replicas.servers]
    assert sorted(running) == [0, 1], running
    home_a = running.index(1)
    r = httpx.post(replicas.url + "/v1/completions", timeout=120,
                   json={"model": "smollm2-135m", "prompt": prefix_b + " question 0:", "max_tokens": 4})
    assert r.status_code == 200, r.text
    holder.join(60)
    served = [a - b for a, b in zip(replicas.successes(), before)]
    assert served == [1, 1], f"the first requests of A and B should go to different replicas, not {served}"
    home_b = 1 - home_a

    for label, prefix, home in [("A", prefix_a, home_a), ("A", prefix_a, home_a), ("B", prefix_b, home_b),
                                ("B", prefix_b, home_b), ("A", prefix_a, home_a), ("B", prefix_b, home_b)]:
        body, served_by = replicas.complete(f"{prefix} question {random.random():.6f}:")
        assert served_by == home, f"a follow-up of prefix {label} went to replica {served_by}, not {home}"
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= body["usage"]["prompt_tokens"] - 32, (label, body["usage"])  # all but the suffix's blocks
