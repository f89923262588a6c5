"""Frozen configuration of the benchmarks, validated on construction (ValueError names the field).

cli.py builds these from its arguments; nothing here parses arguments or reads the environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from tinyserve.config import DEFAULT_MODEL, EngineConfig

DatasetName = Literal["random", "prefix-repetition", "sharegpt", "copy"]
DATASET_NAMES: tuple[str, ...] = get_args(DatasetName)
SLO_KEYS = ("ttft", "tpot", "e2el")  # goodput service-level objectives, in milliseconds
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's --percentile-metrics names
DEFAULT_CONCURRENCIES = (1, 4, 16, 64)
DEFAULT_OUTPUT_LEN = 128  # max_tokens of synthetic requests when DatasetConfig.output_len is unset


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts to send and how many tokens to ask back.

    random: each prompt is `prefix_len` shared tokens then a random part of about `input_len` tokens.
    prefix-repetition: `num_prefixes` prefixes of `prefix_len` tokens, each followed by several random
    suffixes of `input_len` tokens (a prefix-caching workload).
    sharegpt: the first user turn of each conversation in `path`; the reply's length is the output
    length unless `output_len` is set.
    copy: an instruction to repeat or lightly edit a shipped passage, then the passage (outputs that copy
    their input, prompt lookup's evaluation); the output length is the passage's unless `output_len` is set.
    """

    name: DatasetName = "random"
    num_prompts: int = 200
    seed: int = 0
    input_len: int = 256  # random part (random) or suffix (prefix-repetition), in tokens
    output_len: int | None = None  # None: DEFAULT_OUTPUT_LEN for synthetic datasets, the reply's for sharegpt
    range_ratio: float = 0.0  # lengths drawn uniformly in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 0  # shared prefix, in tokens
    num_prefixes: int = 8  # prefix-repetition only
    path: str | None = None  # sharegpt only: a JSON list of {"conversations": [...]}
    max_total_len: int = 2048  # sharegpt only: skip conversations whose prompt + reply exceed this
    tokenizer: str = DEFAULT_MODEL  # alias, .gguf file or Hugging Face folder used to count tokens

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset must be one of {', '.join(DATASET_NAMES)}, got {self.name!r}")
        _positive("num_prompts", self.num_prompts)
        _positive("input_len", self.input_len, allow_zero=self.name == "random" and self.prefix_len > 0)
        if self.output_len is not None:
            _positive("output_len", self.output_len)
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        _positive("prefix_len", self.prefix_len, allow_zero=self.name != "prefix-repetition")
        _positive("num_prefixes", self.num_prefixes)
        if self.name == "prefix-repetition" and self.num_prefixes > self.num_prompts:
            raise ValueError(f"num_prefixes ({self.num_prefixes}) must be <= num_prompts ({self.num_prompts})")
        if self.name == "sharegpt" and not self.path:
            raise ValueError("the sharegpt dataset needs a path to its JSON file (--dataset-path)")


@dataclass(frozen=True)
class ServeBenchConfig:
    """One load-generator run against one OpenAI-compatible server."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"  # or /v1/chat/completions
    # grpc: tinyserve's gRPC GenerateStream at grpc_target instead (completions only; base_url: /metrics)
    backend: Literal["http", "grpc"] = "http"
    grpc_target: str = "127.0.0.1:50051"
    model: str | None = None  # None: the first id that GET /v1/models lists
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    max_concurrency: int | None = None  # None: no limit beyond the arrival process
    request_rate: float = math.inf  # requests per second; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1.0 is a Poisson process
    seed: int = 0  # arrival times (the dataset has its own seed)
    num_warmups: int = 1  # requests sent and discarded before the timed run
    ignore_eos: bool = False  # sent as the vLLM extension `ignore_eos`
    temperature: float = 0.0
    extra_body: dict | None = None  # merged into every request body
    api_key: str | None = None
    timeout_s: float = 600.0  # per request: connect, and between two reads
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)  # e.g. {"ttft": 500, "tpot": 50}
    include_usage: bool = True  # ask for stream_options.include_usage
    show_progress: bool = True
    # vLLM's --percentile-metrics / --metric-percentiles: the summary shows these percentiles of these
    # metrics (and the JSON line p<q>_<metric>_ms); () keeps the standard median, P90 and P99 of all four
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS
    metric_percentiles: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.endpoint.startswith("/"):
            raise ValueError(f"endpoint must start with '/', got {self.endpoint!r}")
        if self.backend not in ("http", "grpc"):
            raise ValueError(f"backend must be http or grpc, got {self.backend!r}")
        if self.backend == "grpc" and self.is_chat:
            raise ValueError("the gRPC API serves completions only: leave endpoint at /v1/completions")
        if self.max_concurrency is not None:
            _positive("max_concurrency", self.max_concurrency)
        _positive("request_rate", self.request_rate)
        _positive("burstiness", self.burstiness)
        _positive("num_warmups", self.num_warmups, allow_zero=True)
        _positive("timeout_s", self.timeout_s)
        for key, value in self.goodput_slos_ms.items():
            if key not in SLO_KEYS:
                raise ValueError(f"goodput keys must be among {', '.join(SLO_KEYS)}, got {key!r}")
            _positive(f"goodput {key}", value)
        for name in self.percentile_metrics:
            if name not in PERCENTILE_METRICS:
                raise ValueError(f"percentile_metrics must be among {', '.join(PERCENTILE_METRICS)}, got {name!r}")
        for q in self.metric_percentiles:
            if not 0 < q <= 100:
                raise ValueError(f"metric_percentiles must be in (0, 100], got {q:g}")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def max_in_flight(self) -> int:
        """The most requests that can be open at once: the connection pool is sized to it, so that no
        request waits for a connection inside the client (that wait would be counted as server time)."""
        return min(self.max_concurrency or self.dataset.num_prompts, self.dataset.num_prompts)


@dataclass(frozen=True)
class SweepConfig:
    """The same workload at several concurrencies, against one or more servers, repeated."""

    serve: ServeBenchConfig  # the workload; its base_url and max_concurrency are replaced per point
    targets: tuple[tuple[str, str], ...]  # (label, base_url) of each server, compared side by side
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCIES
    num_runs: int = 1  # repeats of each point; tables show the median and the spread

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("a sweep needs at least one server (--base-url)")
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        _positive("num_runs", self.num_runs)


OFFLINE_DTYPE = "bfloat16"  # the offline recipe's dtype (the engine's own default is "auto")


@dataclass(frozen=True)
class OfflineBenchConfig:
    """The engine alone through the offline LLM API: random token-id prompts, ignore_eos, greedy.

    Defaults are the recipe of the engine issue: 256 prompts of 64-512 tokens, 32-256 output tokens, in
    bfloat16; `engine` is the whole engine config (`bench offline` takes every engine flag `serve` takes).
    """

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(dtype=OFFLINE_DTYPE))
    num_prompts: int = 256
    input_len_range: tuple[int, int] = (64, 512)  # inclusive
    output_len_range: tuple[int, int] = (32, 256)  # inclusive
    seed: int = EngineConfig.seed  # the workload's (the engine's is engine.seed)
    num_warmup_tokens: int = 8  # one short generate before the clock starts (0: none)

    def __post_init__(self) -> None:
        _positive("num_prompts", self.num_prompts)
        for name, (low, high) in (("input_len_range", self.input_len_range),
                                  ("output_len_range", self.output_len_range)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} must satisfy 1 <= min <= max, got {low}-{high}")
        _positive("num_warmup_tokens", self.num_warmup_tokens, allow_zero=True)
