"""`tinyserve serve` as a process: 503 while loading, then SIGTERM with requests in flight: new work gets
503, a short request completes, a long one is aborted after --shutdown-timeout, and the process exits 0.
A second signal aborts the streams at once (exit 128 + its number), SIGTERM while loading exits 0 at
once, a hung engine step delays the exit by a bounded time; and the API key never comes from argv."""

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tinyserve.cli import build_parser, main, server_config_from_args

SERVE = [sys.executable, "-m", "tinyserve.cli", "serve", "--dtype", "float32", "--max-model-len", "2048",
         "--kv-cache-memory", "0.25"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> set[str]:
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


def short_and_long_streams(base: str, first_token_s: float) -> tuple[_Stream, _Stream]:
    """A stream of 12 tokens and one of 1,500, both started and past their first token."""
    short, long = _Stream(base, 12), _Stream(base, 1500)
    for s in (short, long):
        s.start()
        assert s.first_token.wait(first_token_s)
    return short, long


def test_sigterm_drains_in_flight_requests_and_exits_zero():
    with _serving("--shutdown-timeout", "8") as (proc, base):  # the short one finishes well inside it on a slow CPU
        seen = _wait_ready(base, proc)
        assert "503 loading" in seen
        short, long = short_and_long_streams(base, 30)
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


@contextlib.contextmanager
def _serving(*args: str, cmd: list[str] = SERVE) -> Iterator[tuple[subprocess.Popen, str]]:
    """`cmd --port P *args` as a process, killed on the way out if it is still running."""
    port = _free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exit_code_within(proc: subprocess.Popen, seconds: float) -> int:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running {seconds}s after the signal:\n{proc.communicate()[0]}") from None


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM twice", "SIGTERM then SIGINT"])
def test_a_second_signal_aborts_the_streams_at_once_and_exits_128_plus_its_number(second):
    with _serving("--shutdown-timeout", "60") as (proc, base):
        _wait_ready(base, proc)
        streams = [_Stream(base, 1500) for _ in range(2)]
        for s in streams:
            s.start()
            assert s.first_token.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        start = time.monotonic()
        proc.send_signal(second)
        for s in streams:
            s.join(10)
            assert s.events[-1] == "[DONE]" and s.finish_reason() == "abort"
        assert _exit_code_within(proc, 15) == 128 + second
        assert time.monotonic() - start < 15
        output = proc.stdout.read()
        assert "Traceback" not in output and "aborting" in output


def test_sigterm_while_the_model_loads_exits_zero_at_once():
    with _serving() as (proc, base):
        seen, deadline = set(), time.monotonic() + 60
        while "503 loading" not in seen and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(base + "/health", timeout=2)
                seen.add(f"{r.status_code} {r.json()['status']}")
            except httpx.TransportError:
                time.sleep(0.02)
        assert seen == {"503 loading"}, seen
        proc.send_signal(signal.SIGTERM)
        assert _exit_code_within(proc, 10) == 0
        assert "Traceback" not in proc.stdout.read()


# `tinyserve serve` whose engine step hangs (as in a wedged kernel) once the file argv[1] exists
HANGING_SERVE = [sys.executable, "-c", """
import os, sys, time
from tinyserve import cli
from tinyserve.engine.loop.llm_engine import LLMEngine
hang_file, step = sys.argv.pop(1), LLMEngine.step
def hanging_step(self):
    while os.path.exists(hang_file):
        time.sleep(0.05)
    return step(self)
LLMEngine.step = hanging_step
sys.exit(cli.main(sys.argv[1:]))
"""]


def test_a_hung_step_delays_the_exit_by_a_bounded_time(tmp_path):
    hang_file = tmp_path / "hang"
    with _serving("--shutdown-timeout", "2", cmd=[*HANGING_SERVE, str(hang_file), *SERVE[3:]]) as (proc, base):
        _wait_ready(base, proc)
        stream = _Stream(base, 1500)
        stream.start()
        assert stream.first_token.wait(30)
        hang_file.touch()
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stream.join(15)
        assert stream.events[-1] == "[DONE]" and stream.finish_reason() == "abort"
        assert _exit_code_within(proc, 2 + 10) == 0
        assert time.monotonic() - start < 2 + 10
        assert "Traceback" not in proc.stdout.read()


def _config(*argv: str):
    return server_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_the_api_key_comes_from_a_file_or_the_environment_never_argv(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TINYSERVE_API_KEY", raising=False)
    assert _config().api_key is None
    monkeypatch.setenv("TINYSERVE_API_KEY", "from-env")
    assert _config().api_key == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("  from-file\n")
    assert _config("--api-key-file", str(key_file)).api_key == "from-file"  # the file wins over the env
    with pytest.raises(ValueError, match="--api-key-file") as exc:
        _config("--api-key", "hunter2")
    assert "hunter2" not in str(exc.value)
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    for path, message in ((tmp_path / "missing", "does not exist"), (empty, "is empty")):
        assert main(["serve", "--api-key-file", str(path)]) == 1  # before any model is loaded
        assert f"api_key_file '{path}' {message}" in capsys.readouterr().err


def test_the_limit_flags_reach_the_server_config():
    config = _config("--max-prompts-per-request", "8", "--max-messages", "16", "--allow-special-tokens-in-messages",
                     "--stream-write-timeout", "4.5", "--body-read-timeout", "6", "--max-connections", "100",
                     "--keep-alive-timeout", "2")
    assert (config.limits.max_prompts_per_request, config.limits.max_messages, config.allow_special_tokens_in_messages) == (8, 16, True)
    assert (config.stream_write_timeout, config.body_read_timeout) == (4.5, 6.0)
    assert (config.max_connections, config.keep_alive_timeout) == (100, 2.0)
    defaults = _config()
    assert not defaults.allow_special_tokens_in_messages and defaults.limits.max_prompts_per_request == 64


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_every_command_prints_its_help(command, capsys):
    """argparse %-formats help strings: one stray "%" in a default's text crashes --help."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    assert "usage: tinyserve" in capsys.readouterr().out
