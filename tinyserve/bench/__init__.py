"""Benchmarks that measure the way the field measures: `bench serve` drives any OpenAI-compatible server
with streamed requests and reports vLLM's metrics (TTFT, TPOT, ITL, latency, throughput, goodput);
`bench offline` times the engine alone; `bench sweep` runs one workload at several concurrencies.

Layers: config (dataclasses) and datasets (prompts of known token lengths) at the bottom; metrics (pure
arithmetic over client-side timestamps); client (one streamed request -> one RequestResult); serve, sweep
and offline drive runs; report/ formats tables and plots. Nothing here imports transformers; matplotlib
is imported only when a plot is asked for.
"""


class BenchError(Exception):
    """A benchmark that cannot run as asked (server unreachable, missing optional package, bad file)."""
