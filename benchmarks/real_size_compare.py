"""tinyserve and llama-server on the same real-size GGUF, one after the other (issue 45's side-by-side table).

    python benchmarks/real_size_compare.py FILE.gguf [FILE.gguf ...] [--runs 3] [--servers tinyserve llama-server]

(`--servers tinyserve-int4` adds the speed mode, `--quantization int4`: activations rounded to int8 per 32.)

For each file and each run, each server in turn is started (never two at once), and measured:
- ready: seconds from starting the process to the first 200 on /health (tinyserve answers 503 until its
  warm-up has run; llama-server until the model is loaded);
- workload A: 1 stream, 128 prompt tokens in, 128 out (`ignore_eos`), 2 requests (both
  servers have warmed up before /health says 200): TPOT p50;
- workload B: 16 streams at once, 256 in, 128 out, 16 requests: output tok/s, TTFT p50 and p99;
- peak resident memory: the sum over the server's process tree of each process's VmHWM (/proc/PID/status,
  file-backed pages included), polled every POLL_S while it runs.
The load is `tinyserve bench serve` (the same client for both servers). Each figure is the median of the runs,
with [min-max]. A watchdog kills a server whose tree passes --rss-limit-gib resident (16 GiB) and records it;
tinyserve is not started on files over --tinyserve-max-file-gib (4 GiB: the 8B, which passes 20 GiB while
loading, issue 45). Every run's figures go to --out (benchmarks/results/real-size.json), saved after each run
and kept across invocations (a later one adds its runs), and the table over all of them beside it (.md).

Servers: `tinyserve serve --model FILE --port P --max-model-len 8192` (defaults otherwise; the files say
131,072 tokens of context, which tinyserve refuses without --max-model-len, issue 45) and
`llama-server -m FILE -t 2 -np 16 -c 8192 --port P` (16 slots of 512 tokens: B's 384 plus the BOS and room).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = Path.home() / ".cache" / "tinyserve-real-size" / "logs"
LLAMA_SERVER = Path.home() / ".cache" / "llama.cpp" / "bin" / "llama-server"
POLL_S = 0.25
READY_TIMEOUT_S = 900
BENCH_TIMEOUT_S = 1800
WORKLOADS = {  # name -> tinyserve bench serve arguments
    "A": ["--max-concurrency", "1", "--num-prompts", "2", "--input-len", "128", "--output-len", "128"],
    "B": ["--max-concurrency", "16", "--num-prompts", "16", "--input-len", "256", "--output-len", "128"],
}


SPEED_MODES = {"tinyserve": [], "tinyserve-int4": ["--quantization", "int4"]}  # name -> its flags


def server_command(server: str, model: Path, port: int) -> list[str]:
    if server in SPEED_MODES:
        return [str(Path(sys.executable).with_name("tinyserve")), "serve", "--model", str(model), "--port", str(port),
                "--max-model-len", "8192", "--kv-cache-memory", "1", *SPEED_MODES[server]]  # the recorded runs' 1 GiB pool
    return [str(LLAMA_SERVER), "-m", str(model), "-t", "2", "-np", "16", "-c", "8192", "--port", str(port)]


def process_tree(root: int) -> list[int]:
    """root and its descendants alive now (from each task's children list)."""
    pids, i = [root], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*"):
            try:
                pids += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        i += 1
    return pids


def status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemoryWatch(threading.Thread):
    """Each process's VmHWM in a server's tree (kept after it exits), and a kill past the RSS limit."""

    def __init__(self, proc: subprocess.Popen, limit_kib: int):
        super().__init__(daemon=True)
        self.proc, self.limit_kib = proc, limit_kib
        self.hwm_kib: dict[int, int] = {}
        self.killed_at_kib: int | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set() and self.proc.poll() is None:
            self.sample()
            time.sleep(POLL_S)

    def sample(self) -> None:
        rss = 0
        for pid in process_tree(self.proc.pid):
            self.hwm_kib[pid] = max(self.hwm_kib.get(pid, 0), status_kib(pid, "VmHWM"))
            rss += status_kib(pid, "VmRSS")
        if rss > self.limit_kib and self.killed_at_kib is None:
            self.killed_at_kib = rss
            os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def peak_mib(self) -> float:
        return sum(self.hwm_kib.values()) / 1024


def wait_ready(port: int, proc: subprocess.Popen, start: float, timeout_s: float) -> float | None:
    """Seconds from start to the first 200 on /health; None if the process ended or the time ran out."""
    while time.monotonic() - start < timeout_s and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return None


def run_workload(name: str, port: int, model: Path, result_file: Path) -> dict:
    """One `tinyserve bench serve` run; the metrics of its result file (ttft_ms, tpot_ms: median, p99, ...)."""
    command = [sys.executable, "-m", "tinyserve.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
               "--tokenizer", str(model), "--ignore-eos", "--no-progress", "--seed", "0",
               "--result-file", str(result_file), *WORKLOADS[name]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, cwd=ROOT)
    if out.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"bench serve {name} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(result_file.read_text())["metrics"]


@dataclasses.dataclass
class Run:
    server: str
    model: str
    ready_s: float | None = None
    peak_mib: float | None = None
    a_tpot_p50_ms: float | None = None
    b_output_tok_s: float | None = None
    b_ttft_p50_ms: float | None = None
    b_ttft_p99_ms: float | None = None
    failed: int = 0
    note: str = ""
    date: str = ""  # when the server was started; empty for a server not started
    load_avg_1m: float | None = None  # the machine's load average then (other processes included)


def measure(server: str, model: Path, port: int, limit_kib: int, tag: str) -> Run:
    """Starts the server, waits for it, runs A then B, stops it; a Run either way."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    run = Run(server, model.name, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_avg_1m=os.getloadavg()[0])
    log = open(LOG_DIR / f"{tag}-server.log", "w")
    start = time.monotonic()
    proc = subprocess.Popen(server_command(server, model, port), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)
    watch = MemoryWatch(proc, limit_kib)
    watch.start()
    try:
        run.ready_s = wait_ready(port, proc, start, READY_TIMEOUT_S)
        if run.ready_s is None:
            run.note = "never ready" if watch.killed_at_kib is None else "killed past the RSS limit"
            return run
        a = run_workload("A", port, model, LOG_DIR / f"{tag}-A.json")
        b = run_workload("B", port, model, LOG_DIR / f"{tag}-B.json")
        run.a_tpot_p50_ms, run.b_output_tok_s = a["tpot_ms"]["median"], b["output_throughput"]
        run.b_ttft_p50_ms, run.b_ttft_p99_ms = b["ttft_ms"]["median"], b["ttft_ms"]["p99"]
        run.failed = a["num_failed"] + b["num_failed"]
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        run.note = f"error: {str(exc)[-300:]}"
    finally:
        watch.sample() if proc.poll() is None else None
        watch.stopped.set()
        stop(proc)
        watch.join()
        log.close()
        run.peak_mib = round(watch.peak_mib)
        if watch.killed_at_kib is not None:
            run.note = f"killed at {watch.killed_at_kib // 1024} MiB resident"
    return run


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


FIGURES = ["ready_s", "peak_mib", "a_tpot_p50_ms", "b_output_tok_s", "b_ttft_p50_ms", "b_ttft_p99_ms"]
HEADER = ["file", "server", "runs", "ready s", "peak RSS MiB", "A: TPOT p50 ms", "B: out tok/s", "B: TTFT p50 ms",
          "B: TTFT p99 ms", "failed", "note"]


def cell(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]  # a figure a run did not record
    if not values:
        return "-"
    fmt = lambda v: f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"  # noqa: E731
    median = fmt(statistics.median(values))
    return median if len(values) == 1 else f"{median} [{fmt(min(values))}-{fmt(max(values))}]"


def table_row(model: str, server: str, runs: list[Run]) -> str:
    done = [r for r in runs if r.b_ttft_p99_ms is not None]
    cells = [cell([getattr(r, f) for r in done]) for f in FIGURES]
    notes = "; ".join(sorted({r.note for r in runs if r.note}))
    return "| " + " | ".join([model, server, str(len(done)), *cells, str(sum(r.failed for r in runs)), notes]) + " |"


def table(runs: list[Run]) -> str:
    """One row per (file, server), in the order first measured."""
    keys = list(dict.fromkeys((r.model, r.server) for r in runs))
    rows = [table_row(m, s, [r for r in runs if (r.model, r.server) == (m, s)]) for m, s in keys]
    return "\n".join(["| " + " | ".join(HEADER) + " |", "|" + "---|" * 2 + "---:|" * 8 + "---|", *rows])


def recorded_command(server: str, port: int) -> str:
    """server_command as the results record it: no path of this machine (the checkout's relative, home as ~)."""
    def portable(arg: str) -> str:
        path = Path(arg)
        if path.is_absolute() and path.is_relative_to(ROOT):
            return str(path.relative_to(ROOT))
        return arg.replace(str(Path.home()), "~", 1) if path.is_absolute() else arg

    return " ".join(portable(arg) for arg in server_command(server, Path("FILE"), port))


def save(out: Path, runs: list[Run], port: int) -> None:
    """The runs (this invocation's after any already in out) to out (JSON) and the table beside it (.md)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"commands": {s: recorded_command(s, port) for s in (*SPEED_MODES, "llama-server")},
              "workloads": WORKLOADS, "runs": [dataclasses.asdict(r) for r in runs], "table": table(runs)}
    out.write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(record["table"] + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--servers", nargs="+", choices=[*SPEED_MODES, "llama-server"],
                        default=["tinyserve", "llama-server"])
    parser.add_argument("--port", type=int, default=8291)
    parser.add_argument("--rss-limit-gib", type=float, default=16.0)
    parser.add_argument("--tinyserve-max-file-gib", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real-size.json",
                        help="JSON of every run; runs already there are kept and the table covers them all")
    args = parser.parse_args(argv)
    # NOTE: a SIGTERM (a `timeout` around this script) must stop the server too: it runs in its own session
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    limit_kib = int(args.rss_limit_gib * 2**20)
    runs = [Run(**r) for r in json.loads(args.out.read_text())["runs"]] if args.out.exists() else []
    for model in args.files:
        servers = list(args.servers)
        if "tinyserve" in servers and model.stat().st_size > args.tinyserve_max_file_gib * 2**30:
            servers.remove("tinyserve")
            runs.append(Run("tinyserve", model.name, note="not started (issue 45: passes 20 GiB while loading)"))
        for i in range(args.runs):  # the servers alternate run by run, so a drift in load hits both
            for server in servers:
                run = measure(server, model, args.port, limit_kib, f"{model.stem}-{server}-{time.strftime('%H%M%S')}")
                print(json.dumps(dataclasses.asdict(run)), flush=True)
                runs.append(run)
                save(args.out, runs, args.port)  # after each run: a run stopped later keeps what was done
        save(args.out, runs, args.port)
    print(table(runs))


if __name__ == "__main__":
    main()
