"""A tiny server (serve_tiny.py) as a process of its own: for what a server in the test's own process
cannot show (signals and exit codes; latency without the client's threads sharing the server's GIL)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SCRIPT = Path(__file__).with_name("serve_tiny.py")
SHUTDOWN_TIMEOUT_S = 1.0
EXIT_BUDGET_S = SHUTDOWN_TIMEOUT_S + 10  # the shutdown bar: shutdown_timeout + 10 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, tmp_path: Path, *extra: str):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        self.hang_file = tmp_path / f"hang-{self.port}"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--port", str(self.port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
             "--hang-file", str(self.hang_file), *extra],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_health(self, want: set[int], timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                status = httpx.get(self.base_url + "/health", timeout=2).status_code
                if status in want:
                    return status
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"/health never answered {want}:\n{self.log()}")

    def wait_exit(self) -> tuple[int, float]:
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=EXIT_BUDGET_S + 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {EXIT_BUDGET_S + 5:.0f}s after the signal:\n{self.log()}") from None
        return code, time.monotonic() - start

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
