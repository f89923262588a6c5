"""Amplification: small or cheap-to-send bodies that ask for far more work than the server should do.

The bar (issue 14): 10,000 prompts x n=128, 300,000 stop strings, 50,000 stop ids, a vocabulary-sized
logit_bias, 100,000 messages and a 4 MiB prompt are each refused with a 400 (413 for a body over the
4 MiB limit) in < 100 ms at the client, or, if the documented limits accept one, a probe stream beside it
keeps its inter-token p99 under 2x its baseline; resident memory grows < 200 MiB; /version answers a
probe every 10 ms within 100 ms throughout. The documented limits themselves are checked at their edges:
a body at every cap is served, one over any cap is a 400 naming the field and the cap.

The bar's test runs the server as a process of its own (server_process.py), as a deployment would: its
RSS is read from /proc/<pid>, and the client and its probes do not share the server's GIL. (In one
process, encoding and sending a 3 MB body stalled the server's event loop and added 40-90 ms to a
refusal.) The caps' edge tests use the in-process server, which is faster to start.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from tinyserve.request_limits import RequestLimits

LIMITS = RequestLimits()
MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS = LIMITS.max_logit_bias, LIMITS.max_stop_string_chars
MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS = LIMITS.max_stop_strings, LIMITS.max_stop_token_ids

from .server_process import ServerProcess

VOCAB = 49152
MIB = 1 << 20
REFUSAL_LIMIT_S = 0.100
ATTEMPTS = 3
VERSION_PROBE_INTERVAL_S = 0.010
VERSION_PROBE_LIMIT_S = 0.100
RSS_GROWTH_LIMIT = 200 * MIB
MAX_PROMPTS, MAX_MESSAGES, MAX_SAMPLES = 64, 1024, 256  # documented limits (max_queue's default for samples)
MAX_N = 32  # --max-n's default: half of the tiny server's 64 seats
PROBE_BODY = {"prompt": "Count:", "max_tokens": 100, "ignore_eos": True, "stream": True, "temperature": 0.0}
HI = {"role": "user", "content": "hi"}

AMPLIFICATIONS = {  # name: (path, body, the param a refusal names; None: any)
    "10k_prompts_x_n128": ("/v1/completions", {"prompt": [[1]] * 10_000, "n": 128, "max_tokens": 1}, None),
    "300k_stop_strings": ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(300_000)]}, "stop"),
    "50k_stop_ids": ("/v1/completions", {"prompt": "hi", "stop_token_ids": [i % 1000 for i in range(50_000)]},
                     "stop_token_ids"),
    "vocab_logit_bias": ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 0.5 for i in range(VOCAB)}},
                         "logit_bias"),
    "100k_messages": ("/v1/chat/completions", {"messages": [HI] * 100_000, "max_tokens": 1}, "messages"),
    "4mib_prompt": ("/v1/completions", {"prompt": "a" * (4 * MIB), "max_tokens": 1}, None),
}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@dataclass
class Monitors:
    """What the probes saw while a body was being handled."""

    rss_baseline: int
    rss_peak: int = 0
    version_latencies: list[float] = field(default_factory=list)
    version_failures: list[str] = field(default_factory=list)
    stream_gaps: list[float] = field(default_factory=list)


def stream_token_gaps(client: httpx.Client, stop: threading.Event | None = None) -> list[float]:
    """Seconds between the token events of one probe stream (or of as much of it as ran before `stop`)."""
    gaps, last = [], None
    with client.stream("POST", "/v1/completions", json=PROBE_BODY) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {") or '"text":""' in line:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop is not None and stop.is_set():
                break
    return gaps


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else max(values, default=0.0)


@contextmanager
def monitored(base_url: str, pid: int, with_stream: bool) -> Iterator[Monitors]:
    """Samples the server's RSS, probes /version every 10 ms and (if asked) keeps a probe stream running,
    in threads."""
    monitors = Monitors(rss_baseline=rss_bytes(pid))
    monitors.rss_peak = monitors.rss_baseline
    stop = threading.Event()

    def sample_rss() -> None:
        while not stop.wait(0.005):
            monitors.rss_peak = max(monitors.rss_peak, rss_bytes(pid))

    def probe_version() -> None:
        with httpx.Client(base_url=base_url, timeout=5) as client:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get("/version").status_code == 200
                except httpx.HTTPError as exc:
                    ok = False
                    monitors.version_failures.append(f"{type(exc).__name__}: {exc}")
                elapsed = time.perf_counter() - start
                monitors.version_latencies.append(elapsed)
                if not ok and not monitors.version_failures:
                    monitors.version_failures.append("non-200 /version")
                stop.wait(max(0.0, VERSION_PROBE_INTERVAL_S - elapsed))

    def probe_stream() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not stop.is_set():
                monitors.stream_gaps += stream_token_gaps(client, stop)

    threads = [threading.Thread(target=t, daemon=True) for t in (sample_rss, probe_version)]
    if with_stream:
        threads.append(threading.Thread(target=probe_stream, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    try:
        yield monitors
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=70)


def wait_idle(server, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.state.engine.num_in_flight == 0 and server.num_free_blocks == server.num_blocks:
            return True
        time.sleep(0.02)
    return False


def process_is_idle(base_url: str, timeout: float = 15.0) -> bool:
    """Nothing running or waiting and every KV block free, as the server's /metrics reports it."""
    idle = {"tinyserve:num_requests_running", "tinyserve:num_requests_waiting", "tinyserve:kv_cache_usage_perc"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gauges = {}
        for line in httpx.get(base_url + "/metrics", timeout=5).text.splitlines():
            name = line.partition("{")[0]
            if name in idle:
                gauges[name] = float(line.rsplit(" ", 1)[1])
        if len(gauges) == len(idle) and not any(gauges.values()):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def tiny_server_process(tmp_path_factory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("amplification"))
    try:
        server.wait_health({200})
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def baseline_gap_p99(tiny_server_process) -> float:
    """The probe stream's inter-token p99 with nothing beside it."""
    with httpx.Client(base_url=tiny_server_process.base_url, timeout=60) as client:
        stream_token_gaps(client)  # warm: first-request costs are not the baseline
        gaps = stream_token_gaps(client) + stream_token_gaps(client)
    return p99(gaps)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# NOTE: a latency bar (< 100 ms at the client) measured on every CI run; best of ATTEMPTS, as the docstring says
@pytest.mark.reliability
@pytest.mark.parametrize("name", list(AMPLIFICATIONS))
def test_amplification_is_refused_fast_or_harmless(tiny_server_process, baseline_gap_p99, name):
    """Sent ATTEMPTS times; the fastest refusal must beat the bar: a cost of the server's is paid on
    every attempt, while the machine's other load (a shared CI box) is not."""
    path, body, param = AMPLIFICATIONS[name]
    content = json.dumps(body).encode()
    del body
    server = tiny_server_process
    assert process_is_idle(server.base_url), "the previous test left work behind"
    responses, elapsed = [], []
    with httpx.Client(base_url=server.base_url, timeout=20) as client:
        client.get("/version")  # the connection is open before the clock starts
        with monitored(server.base_url, server.proc.pid, with_stream=True) as monitors:
            for _ in range(ATTEMPTS):
                start = time.perf_counter()
                responses.append(client.post(path, content=content, headers={"content-type": "application/json"}))
                elapsed.append(time.perf_counter() - start)
            time.sleep(0.2)  # the probes keep watching while the server cleans up
    growth = monitors.rss_peak - monitors.rss_baseline
    latencies = monitors.version_latencies
    print(f"{name}: {len(content) / MIB:.2f} MiB body -> {[r.status_code for r in responses]} in "
          f"{', '.join(f'{t * 1e3:.0f}' for t in elapsed)} ms; RSS +{growth / MIB:.1f} MiB; /version max "
          f"{max(latencies) * 1e3:.1f} ms over {len(latencies)} probes; stream p99 "
          f"{p99(monitors.stream_gaps) * 1e3:.1f} ms (baseline {baseline_gap_p99 * 1e3:.1f})")
    if all(r.status_code == 200 for r in responses):
        assert p99(monitors.stream_gaps) < 2 * baseline_gap_p99, "an accepted body slowed the probe stream"
    else:
        expected = 413 if len(content) > 4 * MIB else 400
        assert [r.status_code for r in responses] == [expected] * ATTEMPTS, responses[0].text[:500]
        error = error_of(responses[0])
        if param is not None:
            assert error["param"] == param, error
        assert min(elapsed) < REFUSAL_LIMIT_S, f"refused after {min(elapsed) * 1e3:.0f} ms at best"
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / MIB:.0f} MiB"
    assert not monitors.version_failures, monitors.version_failures[:3]
    assert max(latencies) < VERSION_PROBE_LIMIT_S, f"/version took {max(latencies) * 1e3:.0f} ms"
    assert process_is_idle(server.base_url), "blocks or streams left behind"


OVER_LIMITS = {  # name: (path, body, param, the cap its message states)
    "prompts": ("/v1/completions", {"prompt": ["hi"] * (MAX_PROMPTS + 1)}, "prompt", MAX_PROMPTS),
    "token_id_prompts": ("/v1/completions", {"prompt": [[1]] * (MAX_PROMPTS + 1)}, "prompt", MAX_PROMPTS),
    "messages": ("/v1/chat/completions", {"messages": [HI] * (MAX_MESSAGES + 1)}, "messages", MAX_MESSAGES),
    "stop_strings": ("/v1/completions", {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop",
                     MAX_STOP_STRINGS),
    "stop_string_chars": ("/v1/chat/completions", {"messages": [HI], "stop": "x" * (MAX_STOP_STRING_CHARS + 1)},
                          "stop", MAX_STOP_STRING_CHARS),
    "stop_token_ids": ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
                       "stop_token_ids", MAX_STOP_TOKEN_IDS),
    "logit_bias": ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
                   "logit_bias", MAX_LOGIT_BIAS),
    "n": ("/v1/chat/completions", {"messages": [HI], "n": 129}, "n", 128),
    "n_per_request": ("/v1/chat/completions", {"messages": [HI], "n": MAX_N + 1}, "n", MAX_N),
    "prompts_x_n": ("/v1/completions", {"prompt": ["a"] * 9, "n": MAX_SAMPLES // 9 + 1}, "n", MAX_SAMPLES),
}


@pytest.mark.parametrize("name", list(OVER_LIMITS))
def test_one_over_a_cap_is_a_400_naming_field_and_cap(live_tiny_server, name):
    path, body, param, cap = OVER_LIMITS[name]
    response = httpx.post(live_tiny_server.base_url + path, json={"max_tokens": 1, **body}, timeout=20)
    assert response.status_code == 400, response.text[:500]
    error = error_of(response)
    assert error["param"] == param, error
    assert str(cap) in error["message"].replace(",", ""), f"the message does not state the cap: {error}"


def test_a_body_at_every_cap_is_served(tiny_server_factory):
    """Limits are inclusive: the largest documented body is served, not refused."""
    stops = [chr(0x4E00 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]  # never generated
    at_caps = {"stop": stops, "stop_token_ids": list(range(VOCAB - MAX_STOP_TOKEN_IDS, VOCAB)),
               "logit_bias": {str(i): 0.5 for i in range(MAX_LOGIT_BIAS)}, "max_tokens": 2, "min_tokens": 2}
    completion = {"prompt": [[1, 2]] * MAX_PROMPTS, "n": MAX_SAMPLES // MAX_PROMPTS, **at_caps}
    chat = {"messages": [{"role": "user", "content": ""}] * MAX_MESSAGES, "n": MAX_N, **at_caps}
    with tiny_server_factory(max_model_len=8192) as server:
        for path, body, num_choices in (("/v1/completions", completion, MAX_SAMPLES), ("/v1/chat/completions", chat, MAX_N)):
            response = httpx.post(server.base_url + path, json=body, timeout=120)
            assert response.status_code == 200, f"{path}: {response.text[:500]}"
            choices = response.json()["choices"]
            assert len(choices) == num_choices and {c["finish_reason"] for c in choices} == {"length"}
        assert wait_idle(server), "blocks or streams left behind"
