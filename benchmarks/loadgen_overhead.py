"""How much CPU does the load generator itself use? Drive a fake OpenAI server (in its own process, so its
CPU is not counted) at several streamed-token rates and print, per rate, the tokens/s achieved and the
client's CPU share of one core. A share well below 1.0 at a rate means the client is not the bottleneck there.

    .venv/bin/python benchmarks/loadgen_overhead.py [--num-prompts 200] [--output-len 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing

from tinyserve.bench.config import DatasetConfig, ServeBenchConfig
from tinyserve.bench.datasets import build_requests, load_tokenizer
from tinyserve.bench.fake_server import FakeOpenAIServer, FakeServerConfig
from tinyserve.bench.serve import run_serve


def _serve_forever(config: FakeServerConfig, port_queue) -> None:
    async def main():
        server = FakeOpenAIServer(config)
        url = await server.start()
        port_queue.put(url)
        await asyncio.Event().wait()

    asyncio.run(main())


def measure(concurrency: int, itl_s: float, args, requests) -> dict:
    queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve_forever, args=(FakeServerConfig(ttft_s=0.05, itl_s=itl_s), queue),
                                     daemon=True)
    server.start()
    try:
        url = queue.get(timeout=30)
        dataset = DatasetConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
        config = ServeBenchConfig(base_url=url, model="fake", dataset=dataset, max_concurrency=concurrency,
                                  show_progress=False)
        run = run_serve(config, requests, load_tokenizer(dataset.tokenizer))
    finally:
        server.terminate()
        server.join()
    m = run.metrics
    return {"bench": "loadgen_overhead", "concurrency": concurrency, "server_itl_ms": itl_s * 1000,
            "offered_tok_s": round(concurrency / itl_s) if itl_s else None,
            "output_tok_s": round(m.output_throughput, 1), "chunks": sum(len(r.chunk_times) for r in run.results),
            "duration_s": round(run.duration_s, 2), "client_cpu_s": round(run.client_cpu_s, 2),
            "client_cpu_share": round(run.client_cpu_share, 3), "failed": m.num_failed,
            "itl_p50_ms": round(m.itl_ms.median, 2), "itl_p99_ms": round(m.itl_ms.p99, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--points", default="16:0.02,16:0.008,64:0.01,64:0.004,64:0",
                        help="concurrency:server_itl_s pairs, comma separated")
    args = parser.parse_args()
    dataset = DatasetConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
    requests = build_requests(dataset, load_tokenizer(dataset.tokenizer))
    for point in args.points.split(","):
        concurrency, itl = point.split(":")
        print(json.dumps(measure(int(concurrency), float(itl), args, requests)), flush=True)


if __name__ == "__main__":
    main()
