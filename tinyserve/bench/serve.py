"""The load generator: requests leave on an arrival schedule (all at once, Poisson, or gamma-bursty), at
most max_concurrency at a time, each streamed and timed by the client; then metrics over the run.

The load generator must not be the bottleneck, so it measures itself: the CPU seconds this process spent
during the timed run (time.process_time, every thread) over the run's wall time is its CPU share, in
units of one core. A share near 1.0 means the numbers describe the client, not the server.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from tinyserve.bench import BenchError
from tinyserve.bench.client import StreamingClient, count_output_tokens
from tinyserve.bench.config import ServeBenchConfig
from tinyserve.bench.datasets import SampleRequest
from tinyserve.bench.metrics import (RequestResult, ServeMetrics, compute_metrics, output_token_timeline,
                                      timeline_bin_s)
from tinyserve.bench.progress import ProgressBar

CLIENT_BOTTLENECK_SHARE = 0.7  # above this CPU share (of one core), warn that the client may limit the run


@dataclass
class ServeRun:
    config: ServeBenchConfig
    model: str
    results: list[RequestResult]  # in dataset order
    start: float  # perf_counter when the first request was due
    duration_s: float  # first request due -> last stream over
    client_cpu_s: float  # CPU seconds of this process during the timed run
    metrics: ServeMetrics
    # the server's speculative decoding over the timed run (its /metrics counters, after minus before):
    # num_drafts, num_draft_tokens, num_accepted_tokens, acceptance_rate, mean_accepted_length
    spec_decode: dict[str, float] | None = None

    @property
    def client_cpu_share(self) -> float:
        return self.client_cpu_s / self.duration_s if self.duration_s > 0 else 0.0


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is due, in seconds from the start. Inter-arrival gaps are gamma-distributed with
    mean 1 / rate (shape 1: exponential, a Poisson process; smaller shapes: burstier). inf: all at 0."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    gaps[0] = 0.0  # the first request leaves at once
    return np.cumsum(gaps).tolist()


async def _warm_up(client: StreamingClient, requests: list[SampleRequest], num_warmups: int) -> None:
    # A different first token: the warm-up must not leave the timed prompts in the server's prefix cache.
    samples = [requests[i % len(requests)] for i in range(num_warmups)]
    warmups = [replace(r, prompt="Warm-up. " + r.prompt) for r in samples]
    for result in await asyncio.gather(*(client.send(r) for r in warmups)):
        if not result.success:
            raise BenchError(f"warm-up request to {client.url} failed ({result.error}): {result.error_detail[:300]}")


async def _timed_run(client: StreamingClient, requests: list[SampleRequest], config: ServeBenchConfig,
                     progress: ProgressBar) -> tuple[list[RequestResult], float, float, float]:
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async def one(request: SampleRequest) -> RequestResult:
        if limit is None:
            return await client.send(request)
        async with limit:  # FIFO: requests enter in arrival order
            return await client.send(request)

    tasks = []
    start, cpu_start = time.perf_counter(), time.process_time()
    progress.start = start
    for request, offset in zip(requests, offsets):
        delay = start + offset - time.perf_counter()  # absolute deadlines: sleeps do not accumulate drift
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(request))
        task.add_done_callback(lambda t: progress.update(t.result()))
        tasks.append(task)
    results = list(await asyncio.gather(*tasks))
    return results, start, time.perf_counter() - start, time.process_time() - cpu_start


async def run_serve_async(config: ServeBenchConfig, requests: list[SampleRequest], tokenizer=None,
                          label: str = "bench") -> ServeRun:
    async with _client(config) as client:
        model = client.model or await client.discover_model()
        if config.num_warmups:
            await _warm_up(client, requests, config.num_warmups)
        progress = ProgressBar(len(requests), label, enabled=config.show_progress)
        before = await client.spec_decode_counters()
        try:
            results, start, duration, cpu = await _timed_run(client, requests, config, progress)
        finally:
            progress.close()
        spec_decode = _spec_decode_over_run(before, await client.spec_decode_counters())
    count_output_tokens(results, tokenizer)
    metrics = compute_metrics(results, duration, config.goodput_slos_ms, config.metric_percentiles)
    return ServeRun(config, model, results, start, duration, cpu, metrics, spec_decode)


def _client(config: ServeBenchConfig):
    if config.backend == "grpc":
        from tinyserve.bench.grpc_client import GrpcStreamingClient  # grpcio only where asked for

        return GrpcStreamingClient(config)
    return StreamingClient(config)


def _spec_decode_over_run(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if after is None:
        return None
    delta = {key: value - (before or {}).get(key, 0.0) for key, value in after.items()}
    drafts, draft_tokens, accepted = (delta.get(k, 0.0) for k in ("num_drafts", "num_draft_tokens",
                                                                   "num_accepted_tokens"))
    return {**delta, "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0}


def run_serve(config: ServeBenchConfig, requests: list[SampleRequest], tokenizer=None,
              label: str = "bench") -> ServeRun:
    if not requests:
        raise BenchError("no requests to send")
    return asyncio.run(run_serve_async(config, requests, tokenizer, label))


def jsonable(obj):
    """inf (request_rate) as the string "inf": json.dumps would write Infinity, which is not JSON."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def _request_record(r: RequestResult, start: float) -> dict:
    ms = lambda s: None if s is None else round(s * 1000.0, 3)  # noqa: E731
    return {"start_s": round(r.start_time - start, 6), "prompt_len": r.prompt_len, "max_tokens": r.output_len,
            "output_tokens": r.num_output_tokens, "usage_completion_tokens": r.usage_completion_tokens,
            "num_chunks": len(r.chunk_times), "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot),
            "e2el_ms": ms(r.latency), "itl_ms": [ms(g) for g in r.itls], "finish_reason": r.finish_reason,
            "error": r.error, "error_detail": r.error_detail or None}


def run_record(run: ServeRun) -> dict:
    """Everything about a run, for the JSON result file and the plots."""
    config = asdict(run.config)
    config.pop("api_key", None)
    bin_s = timeline_bin_s(run.duration_s)
    return jsonable({
        "kind": "serve",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": run.model,
        "config": config,
        "metrics": asdict(run.metrics),
        "spec_decode": run.spec_decode,
        "client": {"cpu_s": run.client_cpu_s, "wall_s": run.duration_s, "cpu_share": run.client_cpu_share,
                   "num_with_usage": sum(r.usage_completion_tokens is not None for r in run.results)},
        "timeline": {"bin_s": bin_s, "output_tokens_per_s": output_token_timeline(run.results, run.start,
                                                                                  run.duration_s, bin_s)},
        "requests": [_request_record(r, run.start) for r in run.results],
    })


def summary_line(run: ServeRun) -> dict:
    """The one JSON line a run prints, to compare runs with `jq` or a spreadsheet."""
    m = run.metrics
    return jsonable({
        "bench": "serve", "model": run.model, "base_url": run.config.base_url, "endpoint": run.config.endpoint,
        "backend": run.config.backend,
        "num_prompts": len(run.results), "max_concurrency": run.config.max_concurrency,
        "request_rate": run.config.request_rate, "completed": m.num_completed, "failed": m.num_failed,
        "duration_s": round(m.duration_s, 3), "request_throughput": round(m.request_throughput, 3),
        "output_throughput": round(m.output_throughput, 2), "total_output_tokens": m.total_output_tokens,
        "ttft_median_ms": round(m.ttft_ms.median, 2), "tpot_median_ms": round(m.tpot_ms.median, 2),
        "itl_median_ms": round(m.itl_ms.median, 2), "e2el_median_ms": round(m.e2el_ms.median, 2),
        "goodput": None if m.goodput is None else round(m.goodput, 3),
        "client_cpu_share": round(run.client_cpu_share, 4),
        **{f"{key}_{name}_ms": round(value, 2) for name in run.config.percentile_metrics
           for key, value in getattr(m, f"{name}_ms").percentiles.items()},
        **({} if run.spec_decode is None else {
            "spec_acceptance_rate": round(run.spec_decode["acceptance_rate"], 4),
            "spec_mean_accepted_length": round(run.spec_decode["mean_accepted_length"], 3)}),
    })
