"""One streamed request to tinyserve's gRPC API (GenerateStream) -> one RequestResult, timed as the HTTP
client times its SSE stream (bench/client.py), so `bench serve --backend grpc` and `--backend http`
against one server compare the two front doors.

The request carries what the HTTP body would: max_tokens, temperature, ignore_eos, the prompt's text,
and --extra-body's fields that the proto has (a field it lacks is an error, not dropped in silence).
No retries; one channel (HTTP/2 multiplexes every stream over it). GET /metrics still goes over HTTP
(base_url), for the speculative-decoding counters.
"""

from __future__ import annotations

import time

import grpc

from tinyserve.bench import BenchError
from tinyserve.bench.client import FAILED_FINISH_REASONS, StreamingClient, _fail
from tinyserve.bench.config import ServeBenchConfig
from tinyserve.bench.datasets import SampleRequest
from tinyserve.bench.metrics import RequestResult
from tinyserve.server.grpc_api.proto import tinyserve_pb2 as pb
from tinyserve.server.grpc_api.proto import tinyserve_pb2_grpc


class GrpcStreamingClient:
    def __init__(self, config: ServeBenchConfig, model: str | None = None):
        self.config = config
        self.model = model or config.model
        self.url = f"grpc://{config.grpc_target}"
        self.metadata = (("authorization", f"Bearer {config.api_key}"),) if config.api_key else ()
        self.channel = grpc.aio.insecure_channel(config.grpc_target)
        self.stub = tinyserve_pb2_grpc.TinyServeStub(self.channel)
        self.http = StreamingClient(config, model)  # /metrics only
        unknown = sorted(set(config.extra_body or ()) - set(pb.GenerateRequest.DESCRIPTOR.fields_by_name))
        if unknown:
            raise BenchError(f"--extra-body: the gRPC GenerateRequest has no field {unknown[0]!r}")

    async def __aenter__(self) -> GrpcStreamingClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.http.__aexit__(*exc)

    async def discover_model(self) -> str:
        try:
            reply = await self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata,
                                               timeout=self.config.timeout_s)
            self.model = reply.models[0].id
        except (grpc.RpcError, IndexError) as exc:
            raise BenchError(f"cannot list the server's models at {self.url} ({exc!r}); pass --model") from exc
        return self.model

    async def spec_decode_counters(self) -> dict[str, float] | None:
        return await self.http.spec_decode_counters()

    def message(self, request: SampleRequest) -> pb.GenerateRequest:
        fields = {"text": request.prompt, "max_tokens": request.output_len, "temperature": self.config.temperature,
                  "ignore_eos": self.config.ignore_eos, **(self.config.extra_body or {})}
        if self.model is not None:
            fields["model"] = self.model
        return pb.GenerateRequest(**fields)

    async def send(self, request: SampleRequest) -> RequestResult:
        result = RequestResult(request.prompt_len, request.output_len)
        result.start_time = time.perf_counter()
        parts: list[str] = []
        try:
            call = self.stub.GenerateStream(self.message(request), metadata=self.metadata,
                                            timeout=self.config.timeout_s)
            async for message in call:
                now = time.perf_counter()
                if message.HasField("usage"):
                    result.usage_completion_tokens = message.usage.completion_tokens
                    result.usage_prompt_tokens = message.usage.prompt_tokens
                choice = message.choice
                if choice.text:
                    parts.append(choice.text)
                    result.chunk_times.append(now)
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
        except grpc.aio.AioRpcError as exc:
            _fail(result, f"grpc_{exc.code().name.lower()}", exc.details() or "")
        result.end_time = time.perf_counter()
        result.text = "".join(parts)
        if result.error is None and result.finish_reason in FAILED_FINISH_REASONS:
            _fail(result, f"finish_{result.finish_reason}", "")
        elif result.error is None and result.usage_completion_tokens is None:
            _fail(result, "incomplete_stream", "the stream ended without its usage message")
        return result
