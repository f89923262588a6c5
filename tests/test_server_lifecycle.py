"""`tinyserve serve` as a process: 503 while loading, then SIGTERM with requests in flight: new work gets
503, a short request completes, a long one is aborted after --shutdown-timeout, and the process exits 0."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120) -> set[str]:
    """The /health statuses seen until it says ok."""
    seen, deadline = set(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            r = httpx.get(base + "/health", timeout=2)
            seen.add(f"{r.status_code} {r.json()['status']}")
            if r.status_code == 200:
                return seen
        except httpx.TransportError:
            pass  # not bound yet
        time.sleep(0.05)
    raise AssertionError(f"not ready after {timeout}s; saw {seen}")


class _Stream(threading.Thread):
    def __init__(self, base: str, max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.body = base, {"prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.events: list[str] = []
        self.first_token = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.base + "/v1/completions", json=self.body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first_token.set()

    def finish_reason(self) -> str | None:
        return json.loads(self.events[-2])["choices"][0]["finish_reason"]


def test_sigterm_drains_in_flight_requests_and_exits_zero():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tinyserve.cli", "serve", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--kv-cache-memory", "0.25", "--shutdown-timeout", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = _wait_ready(base, proc)
        assert "503 loading" in seen
        short, long = _Stream(base, 12), _Stream(base, 1500)
        for s in (short, long):
            s.start()
            assert s.first_token.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"]
        assert httpx.get(base + "/health", timeout=10).status_code == 503
        short.join(30)
        assert short.events[-1] == "[DONE]" and short.finish_reason() == "length"
        start = time.monotonic()
        long.join(30)
        assert long.events[-1] == "[DONE]" and long.finish_reason() == "abort"
        assert time.monotonic() - start < 10
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read()
        assert "Traceback" not in output and "request finished" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
