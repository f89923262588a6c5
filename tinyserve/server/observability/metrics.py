"""Prometheus metrics: the only module that imports prometheus_client.

Names follow vLLM's with the prefix `tinyserve:` and a `model_name` label on every series: one app may
serve several models, each a ServerMetrics bound to the app's MetricSet, which also counts the models'
loads, unloads and swaps. Each app registers into its own CollectorRegistry, so tests can build several
apps in one process. Gauges and the engine's running
totals (preemptions, prefix cache) are read from the latest EngineStats at scrape time; histograms and
token counters are fed per step from the engine thread (AsyncEngine.step_listeners). One finished
*sample* is one request here (n=2 counts two, as the engine schedules two sequences); its prompt tokens
are counted once, on sample 0. The per-request series (histograms, outcomes, refusals; not the token
totals) also carry an `api` label, the front door a request came in by (`http` or `grpc`): the engine
knows nothing of it, so every request is tagged as it starts (server/intake/request_start.py: `track_api` with
API, which gRPC's handlers set in their tasks and is http elsewhere), and admission's refusals count
under the same API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tinyserve.engine.observability.stats import EngineStats, LoopStats, SpecDecodeStats
from tinyserve.types import FinishReason, RequestOutput

if TYPE_CHECKING:  # only the type: server/observability/memory_stats.py's gathering reads torch's device memory
    from tinyserve.server.observability.memory_stats import MemorySnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 320.0, 640.0)
_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
MAX_TOKEN_BUCKET = 1 << 17  # the token histograms' ladder ends at the first rung above this
APIS = ("http", "grpc")
# every reason a refusal is counted under (ServerMetrics.rejected: the error codes of server/state.py's and
# server/registry/model_slot.py's admission), and the models' lifecycle labels: each series is exported at 0 from
# start-up, so a dashboard or an alert rule over it reads 0, not "no data", on a fresh server
REJECT_REASONS = ("overloaded", "too_many_samples", "loading", "model_unloaded", "model_failed", "engine_dead",
                  "shutting_down")
LOAD_OUTCOMES = ("ok", "failed")
UNLOAD_REASONS = ("admin", "evicted", "idle", "swap")
API: ContextVar[str] = ContextVar("tinyserve_api", default="http")  # the api of the request this task serves
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.025, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


class _EngineStatsCollector:
    """Gauges and engine-side totals of every loaded model, read from its newest snapshot on each scrape."""

    def __init__(self, get_models: Callable[[], list[tuple[str, EngineStats | None, LoopStats | None]]]):
        self.get_models = get_models

    def collect(self) -> Iterator[Metric]:
        models = [(name, stats, loop) for name, stats, loop in self.get_models()
                  if stats is not None and loop is not None]  # a model still loading has none
        if not models:
            return
        for name, doc, read in (
            ("num_requests_running", "Sequences in the running batch.", lambda s, _: s.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", lambda s, _: s.num_waiting),
            ("num_requests_paused", "Sequences set aside until their slow reader catches up.",
             lambda s, _: s.num_paused),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", lambda s, _: s.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(f"tinyserve:{name}", doc, labels=["model_name"])
            for model_name, stats, loop in models:
                gauge.add_metric([model_name], read(stats, loop))
            yield gauge
        for name, doc, read in (
            ("num_preemptions", "Sequences preempted (recomputed later) since start-up.",
             lambda s, _: s.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda s, _: s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s, _: s.prefix_cache_hits),
            ("prefill_tokens", "Tokens computed in prompt chunks (recomputes after preemption included).",
             lambda s, _: s.num_prefill_tokens),
            # where the engine thread's time goes: a starved step loop shows longer steps or more overhead
            ("engine_steps", "Engine steps run.", lambda _, loop: loop.num_steps),
            ("engine_step_seconds", "Seconds inside engine steps.", lambda _, loop: loop.step_seconds),
            ("engine_loop_overhead_seconds", "Engine-thread seconds around steps (inbox, delivery, metrics).",
             lambda _, loop: loop.overhead_seconds),
        ):
            counter = CounterMetricFamily(f"tinyserve:{name}", doc, labels=["model_name"])
            for model_name, stats, loop in models:
                counter.add_metric([model_name], read(stats, loop))
            yield counter
        speculating = [(model_name, stats.spec_decode) for model_name, stats, _ in models if stats.spec_decode]
        if speculating:
            yield from _spec_decode_counters(speculating)


def _spec_decode_counters(models: list[tuple[str, SpecDecodeStats]]) -> Iterator[Metric]:
    """vLLM's names: acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""
    for name, doc, read in (
        ("spec_decode_num_drafts", "Speculative proposals verified (one per sequence and step).",
         lambda spec: spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Proposed tokens verified.", lambda spec: spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", lambda spec: spec.num_accepted_tokens),
    ):
        counter = CounterMetricFamily(f"tinyserve:{name}", doc, labels=["model_name"])
        for model_name, spec in models:
            counter.add_metric([model_name], read(spec))
        yield counter
    per_position = CounterMetricFamily("tinyserve:spec_decode_num_accepted_tokens_per_pos",
                                       "Proposals accepted at each position of a draft (0 first).",
                                       labels=["model_name", "position"])
    for model_name, spec in models:
        for position, value in enumerate(spec.num_accepted_tokens_per_pos):
            per_position.add_metric([model_name, str(position)], value)
    yield per_position


class _MemoryCollector:
    """Memory series from a MemorySnapshot (server/observability/memory_stats.py) taken at each scrape; the process's
    series have no model_name (one process holds every model)."""

    def __init__(self, get_memory: Callable[[], MemorySnapshot]):
        self.get_memory = get_memory

    def collect(self) -> Iterator[Metric]:
        memory = self.get_memory()
        for name, doc, value in (
            ("process_resident_memory_bytes", "Resident set of the server process.", memory.process_rss_bytes),
            ("memory_limit_bytes", "Memory the process may use: its cgroup limit, else the machine's.",
             memory.memory_limit_bytes),
        ):
            if value is not None:
                yield GaugeMetricFamily(f"tinyserve:{name}", doc, value=value)
        for name, doc, read in (
            ("device_memory_allocated_bytes", "CUDA memory held by tensors.", lambda d: d.allocated_bytes),
            ("device_memory_reserved_bytes", "CUDA memory held by torch's caching allocator.",
             lambda d: d.reserved_bytes),
            ("device_memory_total_bytes", "CUDA device memory.", lambda d: d.total_bytes),
        ):
            if memory.devices:
                gauge = GaugeMetricFamily(f"tinyserve:{name}", doc, labels=["device"])
                for device in memory.devices:
                    gauge.add_metric([device.device], read(device))
                yield gauge
        if not memory.models:
            return
        for name, doc, read in (
            ("model_weight_bytes", "Bytes of the model's weights (a draft model's included).",
             lambda m: m.weight_bytes),
            ("kv_cache_bytes", "Bytes of the KV pool.", lambda m: m.kv_bytes),
            ("kv_cache_cached_blocks", "KV blocks holding a prefix-cache hash (used or free).",
             lambda m: m.num_cached_blocks),
            ("engine_alive", "1 while the model's engine steps, 0 once it died or stopped.", lambda m: int(m.is_alive)),
        ):
            gauge = GaugeMetricFamily(f"tinyserve:{name}", doc, labels=["model_name"])
            for model in memory.models:
                gauge.add_metric([model.model_name], read(model))
            yield gauge
        blocks = GaugeMetricFamily("tinyserve:kv_cache_blocks", "KV blocks by state: used (held by requests) or "
                                   "free (cached ones included).", labels=["model_name", "state"])
        for model in memory.models:
            blocks.add_metric([model.model_name, "used"], model.num_used_blocks)
            blocks.add_metric([model.model_name, "free"], model.num_free_blocks)
        yield blocks


class MetricSet:
    """Every metric of one app, each with a `model_name` label; `for_model` binds one model's series.
    Token histograms share one bucket ladder (up to MAX_TOKEN_BUCKET), since the models' contexts differ."""

    def __init__(self, get_models: Callable[[], list[tuple[str, EngineStats | None, LoopStats | None]]] = list,
                 max_token_bucket: int = MAX_TOKEN_BUCKET, get_memory: Callable[[], MemorySnapshot] | None = None):
        self.registry = reg = CollectorRegistry()
        reg.register(_EngineStatsCollector(get_models))
        if get_memory is not None:
            reg.register(_MemoryCollector(get_memory))
        label, per_api = ["model_name"], ["model_name", "api"]
        tokens = _token_buckets(max_token_bucket)
        self.histograms = {name: Histogram(f"tinyserve:{name}", doc, per_api, registry=reg, buckets=buckets)
                           for name, doc, buckets in (
            ("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS),
            ("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS),
            ("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS),
            ("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS),
            ("request_prompt_tokens", "Prompt tokens per request.", tokens),
            ("request_generation_tokens", "Generated tokens per request.", tokens),
        )}
        self.prompt_tokens = Counter("tinyserve:prompt_tokens", "Prompt tokens of finished requests.",
                                     label, registry=reg)
        self.generation_tokens = Counter("tinyserve:generation_tokens", "Generated tokens.", label, registry=reg)
        self.success = Counter("tinyserve:request_success", "Finished requests by finish reason.",
                               per_api + ["finished_reason"], registry=reg)
        self.admission_limit = Gauge("tinyserve:admission_limit",
                                     "Samples admission lets wait (--max-queue, or adaptive admission's limit).",
                                     label, registry=reg)
        self.rejected = Counter("tinyserve:request_rejected",
                                "Requests refused by admission (503, or 400 too_many_samples).",
                                per_api + ["reason"], registry=reg)
        # the models' lifecycle (server/registry/model_slot.py): outcome ok or failed; unload reason
        self.loads = Counter("tinyserve:model_loads", "Model loads by outcome.", label + ["outcome"], registry=reg)
        self.unloads = Counter("tinyserve:model_unloads", "Model unloads by reason (admin, evicted, idle, swap).",
                               label + ["reason"], registry=reg)
        self.swaps = Counter("tinyserve:model_swaps", "Model swaps by outcome.", label + ["outcome"], registry=reg)
        self.load_seconds = Histogram("tinyserve:model_load_seconds", "Time to load a model (build + warm-up).",
                                      label, registry=reg, buckets=_LOAD_BUCKETS)
        self.swap_seconds = Histogram("tinyserve:model_swap_seconds",
                                      "Swap: start of the new model's load to the old one's memory freed.",
                                      label, registry=reg, buckets=_LOAD_BUCKETS)

    def for_model(self, model_name: str) -> ServerMetrics:
        return ServerMetrics(model_name, metric_set=self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServerMetrics:
    """One model's series of a MetricSet (its own set when none is given: a lone model, tests)."""

    def __init__(self, model_name: str, max_model_len: int | None = None,
                 get_stats: Callable[[], EngineStats | None] = lambda: None,
                 get_loop_stats: Callable[[], LoopStats | None] = lambda: None, metric_set: MetricSet | None = None):
        if metric_set is None:
            metric_set = MetricSet(lambda: [(model_name, get_stats(), get_loop_stats())],
                                   max_model_len or MAX_TOKEN_BUCKET)
        self.metric_set, self.registry, self.model_name = metric_set, metric_set.registry, model_name
        self.series = {api: _RequestSeries(metric_set, model_name, api) for api in APIS}
        for api in APIS:
            for finish_reason in FinishReason:
                metric_set.success.labels(model_name, api, finish_reason.value)
            for reason in REJECT_REASONS:
                metric_set.rejected.labels(model_name, api, reason)
        for outcome in LOAD_OUTCOMES:
            metric_set.loads.labels(model_name, outcome)
            metric_set.swaps.labels(model_name, outcome)
        for reason in UNLOAD_REASONS:
            metric_set.unloads.labels(model_name, reason)
        metric_set.load_seconds.labels(model_name)
        metric_set.swap_seconds.labels(model_name)
        self.prompt_tokens = metric_set.prompt_tokens.labels(model_name)
        self.generation_tokens = metric_set.generation_tokens.labels(model_name)
        # (request id, prompt index, sample index) -> when its last token came; engine thread only
        self._last_token_time: dict[tuple[str, int, int], float] = {}
        # request id -> [api, samples not finished yet], for the requests not of http; set on the event
        # loop before the request is queued, dropped on the engine thread with its last sample
        self._api_of: dict[str, list] = {}

    def track_api(self, request_id: str, num_samples: int, api: str) -> None:
        """Count the request's samples under `api` (call before queueing it)."""
        if api != "http":
            self._api_of[request_id] = [api, num_samples]

    def _series_of(self, out: RequestOutput) -> _RequestSeries:
        tracked = self._api_of.get(out.request_id)
        if tracked is None:
            return self.series["http"]
        if out.finished:
            tracked[1] -= 1
            if tracked[1] == 0:
                del self._api_of[out.request_id]
        return self.series[tracked[0]]

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        """Engine thread, once per step: inter-token latencies, token counts, finished samples."""
        num_new = 0
        for out in outputs:
            key = (out.request_id, out.prompt_index, out.index)
            series = self._series_of(out)
            if out.new_token_ids:
                num_new += len(out.new_token_ids)
                last = self._last_token_time.get(key)
                if last is not None:  # several tokens at once (speculation) share the wait between them
                    for _ in out.new_token_ids:
                        series.itl.observe((now - last) / len(out.new_token_ids))
                self._last_token_time[key] = now
            if out.finished:
                self._last_token_time.pop(key, None)
                series.on_finished(out, now)
                if out.index == 0 and out.usage is not None:
                    self.prompt_tokens.inc(out.usage.prompt_tokens)
        if num_new:
            self.generation_tokens.inc(num_new)

    def set_admission_limit(self, limit: float) -> None:
        self.metric_set.admission_limit.labels(self.model_name).set(limit)

    def rejected(self, reason: str) -> None:
        self.metric_set.rejected.labels(self.model_name, API.get(), reason).inc()

    def render(self) -> bytes:
        return self.metric_set.render()


class _RequestSeries:
    """One model's request series for one api."""

    def __init__(self, metric_set: MetricSet, model_name: str, api: str):
        self.metric_set, self.model_name, self.api = metric_set, model_name, api
        h = {name: hist.labels(model_name, api) for name, hist in metric_set.histograms.items()}
        self.ttft, self.itl = h["time_to_first_token_seconds"], h["inter_token_latency_seconds"]
        self.e2e, self.queue = h["e2e_request_latency_seconds"], h["request_queue_time_seconds"]
        self.prompt_hist, self.generation_hist = h["request_prompt_tokens"], h["request_generation_tokens"]

    def on_finished(self, out: RequestOutput, now: float) -> None:
        self.metric_set.success.labels(self.model_name, self.api, out.finish_reason.value).inc()
        m, usage = out.metrics, out.usage
        if usage is not None:
            if out.index == 0:
                self.prompt_hist.observe(usage.prompt_tokens)
            self.generation_hist.observe(usage.completion_tokens)
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        self.e2e.observe((m.finished_time or now) - m.arrival_time)
