"""One streamed request to an OpenAI-compatible server -> one RequestResult with client-side timestamps.

No retries anywhere: an overloaded server must show up as failed requests, not as slow successes. The
connection pool holds as many connections as requests can be in flight, so a request never waits for a
connection inside the client (that wait would be charged to the server's TTFT). trust_env is off: an
HTTP proxy picked up from the environment would sit between the benchmark and the server.
"""

from __future__ import annotations

import json
import time

import httpx

from tinyserve.bench import BenchError
from tinyserve.bench.config import ServeBenchConfig
from tinyserve.bench.datasets import SampleRequest
from tinyserve.bench.metrics import RequestResult

FAILED_FINISH_REASONS = ("error", "abort", "timeout")
SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


class StreamingClient:
    """An httpx.AsyncClient plus the request body and SSE parsing for completions and chat completions."""

    def __init__(self, config: ServeBenchConfig, model: str | None = None):
        self.config = config
        self.model = model or config.model
        self.url = config.base_url.rstrip("/") + config.endpoint
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        size = config.max_in_flight
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s),
            transport=httpx.AsyncHTTPTransport(  # retries=0: connection attempts are not retried either
                retries=0, limits=httpx.Limits(max_connections=size, max_keepalive_connections=size)),
            trust_env=False,
        )

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def discover_model(self) -> str:
        """The first model GET /v1/models lists (when --model was not given)."""
        url = self.config.base_url.rstrip("/") + "/v1/models"
        try:
            response = await self.http.get(url)
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise BenchError(f"cannot list the server's models at {url} ({exc!r}); pass --model") from exc
        return self.model

    async def spec_decode_counters(self) -> dict[str, float] | None:
        """The server's speculative-decoding counters from GET /metrics, summed over models (tinyserve's
        and vLLM's names), or None when it exposes none (speculation off, or no /metrics)."""
        try:
            response = await self.http.get(self.config.base_url.rstrip("/") + "/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        totals: dict[str, float] = {}
        for line in response.text.splitlines():
            name, _, value = line.partition(" ")
            name = name.split("{", 1)[0]
            for prefix in ("tinyserve:spec_decode_", "vllm:spec_decode_"):
                key = name.removeprefix(prefix).removesuffix("_total")
                if name.startswith(prefix) and key in SPEC_DECODE_COUNTERS:
                    totals[key] = totals.get(key, 0.0) + float(value.split()[0])
        return totals or None

    def body(self, request: SampleRequest) -> dict:
        body = {"model": self.model, "max_tokens": request.output_len, "temperature": self.config.temperature,
                "stream": True}
        if self.config.is_chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.config.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **(self.config.extra_body or {})}

    async def send(self, request: SampleRequest) -> RequestResult:
        result = RequestResult(request.prompt_len, request.output_len)
        result.start_time = time.perf_counter()
        try:
            async with self.http.stream("POST", self.url, json=self.body(request)) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode("utf-8", "replace")
                    _fail(result, f"http_{response.status_code}", detail)
                else:
                    await self._read_stream(response, result)
        except httpx.TimeoutException as exc:
            _fail(result, "timeout", repr(exc))
        except httpx.ConnectError as exc:
            _fail(result, "connect_error", repr(exc))
        except httpx.RemoteProtocolError as exc:
            _fail(result, "connection_closed", repr(exc))
        except httpx.HTTPError as exc:
            _fail(result, type(exc).__name__, repr(exc))
        result.end_time = time.perf_counter()
        return result

    async def _read_stream(self, response: httpx.Response, result: RequestResult) -> None:
        """Server-sent events: `data: {json}` lines, then `data: [DONE]`. Timestamps are taken as each
        line arrives, before parsing it."""
        parts: list[str] = []
        is_done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), event names
            now = time.perf_counter()
            data = line[5:].strip()
            if data == "[DONE]":
                is_done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                _fail(result, "bad_chunk", data[:200])
                return
            if "error" in chunk:
                _fail(result, "stream_error", json.dumps(chunk["error"])[:500])
                return
            self._take_chunk(chunk, now, parts, result)
        result.text = "".join(parts)
        if result.finish_reason in FAILED_FINISH_REASONS:
            _fail(result, f"finish_{result.finish_reason}", "")
        elif not is_done and result.finish_reason is None:
            _fail(result, "incomplete_stream", "the stream ended without a finish_reason or [DONE]")

    @staticmethod
    def _take_chunk(chunk: dict, now: float, parts: list[str], result: RequestResult) -> None:
        usage = chunk.get("usage")
        if usage:
            result.usage_completion_tokens = usage.get("completion_tokens")
            result.usage_prompt_tokens = usage.get("prompt_tokens")
        for choice in chunk.get("choices") or ():
            text = choice.get("text")
            if text is None:  # chat: reasoning models stream their thinking before the content
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content")
            if text:
                parts.append(text)
                result.chunk_times.append(now)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]


def _fail(result: RequestResult, reason: str, detail: str) -> None:
    result.error = reason
    result.error_detail = detail[:500]


def count_output_tokens(results: list[RequestResult], tokenizer=None) -> None:
    """Set each result's num_output_tokens: the server's usage.completion_tokens when it sent usage, else
    the streamed text re-tokenized (when a tokenizer is given), else the number of chunks with text."""
    for r in results:
        if r.usage_completion_tokens is not None:
            r.num_output_tokens = r.usage_completion_tokens
        elif tokenizer is not None and r.text:
            r.num_output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False))
        else:
            r.num_output_tokens = len(r.chunk_times)
