"""The engine issue's offline benchmark in one run: tinyserve (continuous batching) against transformers'
static batching (batches of 16, left padding) and against tinyserve with max_num_seqs=1, on the same
workload: 256 prompts of 64-512 random tokens, 32-256 output tokens with ignore_eos, seed 0, bfloat16.

Each case runs in its own process, so that its peak RSS is its own; cases alternate across repeats so
that drift on a shared machine spreads over all of them. Prints a Markdown table (median [min-max] over
repeats, ratios of medians) and one JSON line; writes the JSON to benchmarks/results/.

    .venv/bin/python benchmarks/offline_compare.py                      # the full recipe (hours on 2 cores)
    .venv/bin/python benchmarks/offline_compare.py --num-prompts 32     # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from tinyserve.bench.metrics import Spread

HERE = Path(__file__).resolve().parent
CASES = ("tinyserve", "transformers", "tinyserve-seq1")


def case_command(case: str, args: argparse.Namespace) -> list[str]:
    num_prompts = args.seq1_num_prompts if case == "tinyserve-seq1" and args.seq1_num_prompts else args.num_prompts
    lengths = ["--input-len-range", *map(str, args.input_len_range),
               "--output-len-range", *map(str, args.output_len_range)]
    common = ["--dtype", args.dtype, "--num-prompts", str(num_prompts), "--seed", str(args.seed), *lengths]
    if case == "transformers":
        return [sys.executable, str(HERE / "hf_static_batching.py"), "--batch-size", str(args.batch_size), *common]
    seqs = "1" if case == "tinyserve-seq1" else str(args.max_num_seqs)
    return [sys.executable, "-m", "tinyserve.cli", "bench", "offline", "--max-num-seqs", seqs,
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), *common]


def run_case(case: str, args: argparse.Namespace) -> dict | None:
    """One case in its own process; None (and its stderr shown) if it failed: the other cases still count."""
    command = case_command(case, args)
    print(f"[{time.strftime('%H:%M:%S')}] {case}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode != 0:
        print(f"  {case} failed ({done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
        return None
    record = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {record['output_tokens_per_s']:.1f} output tok/s in {record['elapsed_s']:.0f}s, "
          f"peak RSS {record['peak_rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return {"case": case, **record}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "num_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def table(runs: dict[str, list[dict]]) -> tuple[str, dict]:
    spreads = {case: {key: Spread.of([r[key] for r in records])
                      for key in ("output_tokens_per_s", "elapsed_s", "peak_rss_mib")}
               for case, records in runs.items()}
    base = spreads["tinyserve"]["output_tokens_per_s"].median if "tinyserve" in spreads else None
    lines = ["| engine | prompts | output tok/s | tinyserve is x faster | elapsed s | peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for case, s in spreads.items():
        ratio = base / s["output_tokens_per_s"].median if base else float("nan")
        lines.append(f"| {case} | {runs[case][0]['num_prompts']} | {s['output_tokens_per_s']} | {ratio:.2f} | "
                     f"{s['elapsed_s']} | {s['peak_rss_mib']} |")
    summary = {case: {k: vars(v) for k, v in s.items()} for case, s in spreads.items()}
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma separated, among {', '.join(CASES)}")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--seq1-num-prompts", type=int, default=None,
                        help="fewer prompts for max_num_seqs=1 (its tok/s barely depends on the count)")
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers static batch size")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}")
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case in cases:
            if (record := run_case(case, args)) is not None:
                runs[case].append(record)
    runs = {case: records for case, records in runs.items() if records}
    if not runs:
        raise SystemExit("every case failed")
    text, summary = table(runs)
    print(text)
    record = {"bench": "offline_compare", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
              "args": {k: v for k, v in vars(args).items() if k != "result_file"}, "summary": summary, "runs": runs}
    path = args.result_file or HERE / "results" / f"offline-compare-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"bench": "offline_compare", "result_file": str(path), "summary": summary}))


if __name__ == "__main__":
    main()
