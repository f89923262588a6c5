"""Prometheus metrics: the only module that imports prometheus_client.

Names follow vLLM's with the prefix `tinyserve:` and a `model_name` label. Each app registers into its
own CollectorRegistry, so tests can build several apps in one process. Gauges and the engine's running
totals (preemptions, prefix cache) are read from the latest EngineStats at scrape time; histograms and
token counters are fed per step from the engine thread (AsyncEngine.step_listeners). One finished
*sample* is one request here (n=2 counts two, as the engine schedules two sequences); its prompt tokens
are counted once, on sample 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tinyserve.engine.stats import EngineStats, LoopStats, SpecDecodeStats
from tinyserve.types import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 320.0, 640.0)
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
    """Gauges and engine-side totals, read from the newest snapshot on every scrape."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None],
                 get_loop_stats: Callable[[], LoopStats | None]):
        self.model_name, self.get_stats, self.get_loop_stats = model_name, get_stats, get_loop_stats

    def collect(self) -> Iterator[Metric]:
        stats, loop = self.get_stats(), self.get_loop_stats()
        if stats is None or loop is None:  # still loading
            return
        label = [self.model_name]
        for name, doc, value in (
            ("num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
            ("num_requests_paused", "Sequences set aside until their slow reader catches up.", stats.num_paused),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", stats.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(f"tinyserve:{name}", doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        for name, doc, value in (
            ("num_preemptions", "Sequences preempted (recomputed later) since start-up.", stats.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            # where the engine thread's time goes: a starved step loop shows longer steps or more overhead
            ("engine_steps", "Engine steps run.", loop.num_steps),
            ("engine_step_seconds", "Seconds inside engine steps.", loop.step_seconds),
            ("engine_loop_overhead_seconds", "Engine-thread seconds around steps (inbox, delivery, metrics).",
             loop.overhead_seconds),
        ):
            counter = CounterMetricFamily(f"tinyserve:{name}", doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter
        if stats.spec_decode is not None:
            yield from _spec_decode_counters(label, stats.spec_decode)


def _spec_decode_counters(label: list[str], spec: SpecDecodeStats) -> Iterator[Metric]:
    """vLLM's names: acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Speculative proposals verified (one per sequence and step).", spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens),
    ):
        counter = CounterMetricFamily(f"tinyserve:{name}", doc, labels=["model_name"])
        counter.add_metric(label, value)
        yield counter
    per_position = CounterMetricFamily("tinyserve:spec_decode_num_accepted_tokens_per_pos",
                                       "Proposals accepted at each position of a draft (0 first).",
                                       labels=["model_name", "position"])
    for position, value in enumerate(spec.num_accepted_tokens_per_pos):
        per_position.add_metric([*label, str(position)], value)
    yield per_position


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, get_stats: Callable[[], EngineStats | None],
                 get_loop_stats: Callable[[], LoopStats | None] = lambda: None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, get_stats, get_loop_stats))
        label, reg = ["model_name"], self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"tinyserve:{name}", doc, label, registry=reg, buckets=buckets).labels(model_name)

        tokens = _token_buckets(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prompt_hist = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_hist = histogram("request_generation_tokens", "Generated tokens per request.", tokens)
        self.prompt_tokens = Counter("tinyserve:prompt_tokens", "Prompt tokens of finished requests.",
                                     label, registry=reg).labels(model_name)
        self.generation_tokens = Counter("tinyserve:generation_tokens", "Generated tokens.",
                                         label, registry=reg).labels(model_name)
        self._success = Counter("tinyserve:request_success", "Finished requests by finish reason.",
                                label + ["finished_reason"], registry=reg)
        self._rejected = Counter("tinyserve:request_rejected",
                                 "Requests refused by admission (503, or 400 too_many_samples).",
                                 label + ["reason"], registry=reg)
        self.model_name = model_name
        # (request id, prompt index, sample index) -> when its last token came; engine thread only
        self._last_token_time: dict[tuple[str, int, int], float] = {}

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        """Engine thread, once per step: inter-token latencies, token counts, finished samples."""
        num_new = 0
        for out in outputs:
            key = (out.request_id, out.prompt_index, out.index)
            if out.new_token_ids:
                num_new += len(out.new_token_ids)
                last = self._last_token_time.get(key)
                if last is not None:  # several tokens at once (speculation) share the wait between them
                    for _ in out.new_token_ids:
                        self.itl.observe((now - last) / len(out.new_token_ids))
                self._last_token_time[key] = now
            if out.finished:
                self._last_token_time.pop(key, None)
                self._on_finished(out, now)
        if num_new:
            self.generation_tokens.inc(num_new)

    def _on_finished(self, out: RequestOutput, now: float) -> None:
        self._success.labels(self.model_name, out.finish_reason.value).inc()
        m, usage = out.metrics, out.usage
        if usage is not None:
            if out.index == 0:
                self.prompt_tokens.inc(usage.prompt_tokens)
                self.prompt_hist.observe(usage.prompt_tokens)
            self.generation_hist.observe(usage.completion_tokens)
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        self.e2e.observe((m.finished_time or now) - m.arrival_time)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
