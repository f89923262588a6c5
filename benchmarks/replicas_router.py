"""Workload D through two tinyserve replicas behind a router (docs/REPLICAS.md): the router's cache-aware
policy against round-robin, side by side in one run, with one replica alone and one server on the whole
machine as references.

Starts two replicas (`tinyserve serve --threads 1`, so the two share the cores), then
vllm-router with `--policy cache_aware` and with `--policy round_robin` in front of the same two (and
sglang-router's cache_aware, where it is installed), and runs `tinyserve bench serve` on workload D
(benchmarks/README.md: 16 concurrent, 8 prefixes of 512 tokens, 4 prompts each + 32, 64 out, 32 prompts)
through each, RUNS rounds, the order of the targets rotated each round. Every measurement gets its own
dataset seed, so no prefix is cached before it starts: the hit rate is what routing earns within a run.
It is read from each replica's /metrics (tinyserve:prefix_cache_hits / prefix_cache_queries) before and
after each measurement and summed over the replicas. Then the replicas stop and one server with torch's
default threads takes the same measurements ("one server, all cores": what the two replicas replace).

Prints a table of medians [min-max] and one JSON line; writes benchmarks/results/replicas-D.json.

    .venv/bin/python benchmarks/replicas_router.py [--runs 3] [--result-file PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
MODEL = "smollm2-135m"
WORKLOAD_D = ["--dataset", "prefix-repetition", "--num-prefixes", "8", "--prefix-len", "512", "--input-len", "32",
              "--output-len", "64", "--num-prompts", "32", "--max-concurrency", "16", "--ignore-eos",
              "--temperature", "0", "--num-warmups", "0", "--no-progress"]
REPLICA_PORTS, SINGLE_PORT = (18081, 18082), 18083
ROUTERS = [  # label, binary, policy, port
    ("vllm-router cache_aware", "vllm-router", "cache_aware", 18181),
    ("vllm-router round_robin", "vllm-router", "round_robin", 18182),
    ("sglang-router cache_aware", "sglang-router", "cache_aware", 18183),
]


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not bound yet
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@contextmanager
def _process(args: list[str], ready_url: str, log: Path):
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        _wait(ready_url, proc, log)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _serve(port: int, log: Path, *extra: str):
    url = f"http://127.0.0.1:{port}"
    return _process([str(BIN / "tinyserve"), "serve", "--port", str(port), *extra], url + "/health", log)


def _router(binary: str, policy: str, port: int, workers: list[str], log: Path):
    # sglang-router's `launch` subcommand is its plain router (the other, `server`, also starts SGLang)
    is_sglang = Path(binary).name == "sglang-router"
    cmd = [binary, "launch"] if is_sglang else [binary]
    args = [*cmd, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers,
            "--prometheus-port", str(port + 20000), "--worker-startup-check-interval", "1",
            "--log-level", "warn" if is_sglang else "warning"]
    return _process(args, f"http://127.0.0.1:{port}/v1/models", log)


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: sum(float(v) for v in re.findall(rf"^tinyserve:{name}_total{{[^}}]*}} (\S+)$", text, re.M))
            for name in ("prefix_cache_queries", "prefix_cache_hits", "request_success")}


def _measure(label: str, url: str, replicas: list[str], seed: int, tmp: Path) -> dict:
    """One workload-D run through `url`; the replicas' counters are read before and after it."""
    before = [_counters(r) for r in replicas]
    result_file = tmp / f"{label.replace(' ', '_')}-{seed}.json"
    subprocess.run([str(BIN / "tinyserve"), "bench", "serve", "--base-url", url, "--model", MODEL, *WORKLOAD_D,
                    "--seed", str(seed), "--result-file", str(result_file)], check=True, stdout=subprocess.DEVNULL)
    after = [_counters(r) for r in replicas]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    metrics = json.loads(result_file.read_text())["metrics"]
    queries, hits = sum(d["prefix_cache_queries"] for d in delta), sum(d["prefix_cache_hits"] for d in delta)
    row = {"target": label, "seed": seed, "failed": metrics["num_failed"], "failures": metrics["failures"],
           "out tok/s": metrics["output_throughput"], "TTFT p50 ms": metrics["ttft_ms"]["median"],
           "TTFT p99 ms": metrics["ttft_ms"]["p99"], "hit rate": hits / queries if queries else None,
           "requests per replica": [d["request_success"] for d in delta]}
    print(json.dumps(row), flush=True)
    return row


def _summary(rows: list[dict]) -> list[dict]:
    out = []
    for label in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == label]
        entry = {"target": label, "runs": len(mine), "failed": sum(r["failed"] for r in mine)}
        for key in ("out tok/s", "TTFT p50 ms", "TTFT p99 ms", "hit rate"):
            values = [r[key] for r in mine]
            entry[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        entry["requests per replica"] = [r["requests per replica"] for r in mine]
        out.append(entry)
    return out


def _table(summary: list[dict]) -> str:
    fmt = lambda s, f: f"{s['median']:{f}} [{s['min']:{f}}-{s['max']:{f}}]"  # noqa: E731
    lines = ["| target | out tok/s | TTFT p50 ms | TTFT p99 ms | prefix hit rate | requests per replica | failed |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for e in summary:
        split = "; ".join("/".join(f"{n:.0f}" for n in run) for run in e["requests per replica"])
        lines.append(f"| {e['target']} | {fmt(e['out tok/s'], '.1f')} | {fmt(e['TTFT p50 ms'], '.0f')} | "
                     f"{fmt(e['TTFT p99 ms'], '.0f')} | {fmt(e['hit rate'], '.3f')} | {split} | {e['failed']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--result-file", type=Path,
                        default=Path(__file__).parent / "results" / "replicas-D.json")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="replicas-"))
    replicas = [f"http://127.0.0.1:{p}" for p in REPLICA_PORTS]
    rows: list[dict] = []
    with ExitStack() as stack:
        for port in REPLICA_PORTS:
            stack.enter_context(_serve(port, tmp / f"replica-{port}.log", "--threads", "1"))
        targets = [("one replica direct (1 thread)", replicas[0], replicas[:1])]
        for label, binary, policy, port in ROUTERS:
            path = shutil.which(binary, path=str(BIN)) or shutil.which(binary)
            if path is None:
                print(f"{binary} is not installed: skipping {label}", file=sys.stderr)
                continue
            stack.enter_context(_router(path, policy, port, replicas, tmp / f"router-{port}.log"))
            targets.append((label, f"http://127.0.0.1:{port}", replicas))
        for run in range(args.runs):
            order = targets[run % len(targets):] + targets[:run % len(targets)]
            for i, (label, url, read) in enumerate(order):
                rows.append(_measure(label, url, read, 1000 + 100 * run + i, tmp))
    single = f"http://127.0.0.1:{SINGLE_PORT}"
    with _serve(SINGLE_PORT, tmp / "single.log"):
        for run in range(args.runs):
            rows.append(_measure("one server, all cores (direct)", single, [single], 5000 + run, tmp))
    summary = _summary(rows)
    print(_table(summary))
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps({"kind": "replicas-router", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                            "workload": WORKLOAD_D, "summary": summary, "rows": rows}, indent=1))
    print(json.dumps({"bench": "replicas_router", "result_file": str(args.result_file),
                      "summary": {e["target"]: {k: e[k]["median"] for k in ("out tok/s", "hit rate")} | {
                          "failed": e["failed"]} for e in summary}}))


if __name__ == "__main__":
    main()
