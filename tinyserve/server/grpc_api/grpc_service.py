"""The gRPC API's handlers (proto/tinyserve.proto): Generate, GenerateStream, Tokenize, ListModels.

A GenerateRequest becomes the JSON body of the same completion (`completion_body`: the fields it sets,
by their names) and starts as every HTTP request does (request_start.start_request: admission before any
work, CompletionRequest's validation, the model, sampling defaults, `completions.encode_completion`'s
tokenizing and engine checks, the second admission, the metrics' api="grpc", the same Generation); so the
checks, their messages and the sampling parameters are HTTP's. An APIError becomes a gRPC status
(`status_code`) with the same message. A call that ends early (cancelled, or past its deadline) cancels its
handler's task, which closes the generation: the engine aborts the request and frees its blocks, as for an
HTTP client that disconnects. Streamed writes go through HTTP's slow-reader guard (server/intake/slow_reader.py):
one blocked on a full flow-control window pauses the request until the writes flow again; one that waits
stream_write_timeout ends the call.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
import uuid

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from pydantic import ValidationError

from tinyserve.engine.loop.async_engine import EngineDeadError
from tinyserve.server.openai_api.completions import encode_completion
from tinyserve.server.errors import APIError, BadRequest, ServiceUnavailable, Unauthorized, bad_request_from_validation
from tinyserve.server.intake.generation import Generation, collect
from tinyserve.server.intake.request_checks import encode
from tinyserve.server.observability.metrics import API
from tinyserve.server.grpc_api.proto import tinyserve_pb2 as pb
from tinyserve.server.grpc_api.proto import tinyserve_pb2_grpc
from tinyserve.server.openai_api.protocol import CompletionRequest, limits_context, refuse_unknown_fields
from tinyserve.server.intake.request_start import StartedRequest, start_request
from tinyserve.server.routes import model_card
from tinyserve.server.intake.slow_reader import SlowReaderGuard
from tinyserve.server.state import ServerState
from tinyserve.types import RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TinyServe"].full_name  # tinyserve.v1.TinyServe
_BY_HTTP_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    504: grpc.StatusCode.DEADLINE_EXCEEDED, 507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# 503s that say "too much work now": the client should back off; every other 503 is UNAVAILABLE
_EXHAUSTED_CODES = frozenset({"overloaded", "too_many_connections"})


def status_code(error: APIError) -> grpc.StatusCode:
    if error.status == 503:
        return grpc.StatusCode.RESOURCE_EXHAUSTED if error.code in _EXHAUSTED_CODES else grpc.StatusCode.UNAVAILABLE
    return _BY_HTTP_STATUS.get(error.status, grpc.StatusCode.INTERNAL)


def error_metadata(error: APIError) -> tuple[tuple[str, str], ...]:
    """The OpenAI body's code and param, and the Retry-After header, as trailing metadata."""
    pairs = [("tinyserve-error-code", error.code), ("tinyserve-error-param", error.param),
             ("retry-after", (error.headers or {}).get("Retry-After"))]
    return tuple((key, value) for key, value in pairs if value is not None)


def message_fields(message: Message) -> dict:
    """The fields `message` sets, as a JSON body spells them (map keys as strings, nested messages as
    objects); a field left unset is absent, so it gets the body's default."""
    fields = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            fields[field.name] = {str(key): item for key, item in value.items()}
        elif field.is_repeated:
            fields[field.name] = [message_fields(v) if isinstance(v, Message) else v for v in value]
        else:
            fields[field.name] = message_fields(value) if isinstance(value, Message) else value
    return fields


def refuse_unknown_proto_fields(message: Message, allow: bool) -> None:
    """A field this server's proto does not have (a newer client's) is a 400, as an unknown JSON field."""
    unknown = [] if allow else list(unknown_fields.UnknownFieldSet(message))
    if unknown:
        number = unknown[0].field_number
        raise BadRequest(f"field {number}: unknown field; this server does not implement it (a server started "
                         "with --allow-unknown-fields ignores such fields)", param=f"field {number}",
                         code="unknown_parameter")


def completion_body(request: pb.GenerateRequest, state: ServerState, stream: bool) -> CompletionRequest:
    """The CompletionRequest of the JSON body this request spells, validated as HTTP validates one."""
    config = state.config
    refuse_unknown_proto_fields(request, config.allow_unknown_fields)
    fields = message_fields(request)
    fields.pop("token_ids", None)
    if request.HasField("token_ids"):
        fields["prompt"] = list(request.token_ids.ids)
    elif request.HasField("text"):
        fields["prompt"] = fields.pop("text")
    context = limits_context(config)
    try:
        body = CompletionRequest.model_validate({**fields, "stream": stream}, context=context)
    except ValidationError as exc:
        raise bad_request_from_validation(exc) from None
    refuse_unknown_fields(body, context)
    return body


class Undecodable:
    """What a request's bytes decode to when they are no message of its type (the handler answers
    INVALID_ARGUMENT): grpcio itself would answer UNKNOWN with the parser's exception and log a traceback."""

    def __init__(self, message_name: str, reason: str):
        self.message_name, self.reason = message_name, reason


def _decoder(message_class: type[Message]):
    def decode(raw: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(raw)
        except DecodeError as exc:
            return Undecodable(message_class.DESCRIPTOR.name, str(exc)[:200])

    return decode


def add_service(service: TinyServeService, server: grpc.aio.Server) -> None:
    """tinyserve_pb2_grpc.add_TinyServeServicer_to_server, with requests decoded by `_decoder`."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["TinyServe"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=_decoder(getattr(pb, method.input_type.name)),
                                     response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _grpc_handler(handler):
    """Each RPC: its metrics under api="grpc", the API key checked, an APIError answered as its status."""
    @functools.wraps(handler)
    async def run(self: TinyServeService, request, context: grpc.aio.ServicerContext):
        API.set("grpc")  # this task serves one gRPC call: admission's refusals count under grpc
        try:
            self.check_api_key(context)
            if isinstance(request, Undecodable):
                raise BadRequest(f"the request is not a valid {request.message_name}: {request.reason}",
                                 code="invalid_message")
            return await handler(self, request, context)
        except APIError as exc:
            await context.abort(status_code(exc), exc.message, trailing_metadata=error_metadata(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001 - a bug: logged; the client gets HTTP's 500 message, no internals
            request_id = dict(context.invocation_metadata() or ()).get("x-request-id", "-")
            logger.exception("unexpected error in gRPC call %s", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal server error (request id {request_id})",
                                trailing_metadata=(("tinyserve-error-code", "internal_error"),))

    return run


class TinyServeService(tinyserve_pb2_grpc.TinyServeServicer):
    def __init__(self, state: ServerState):
        self.state = state

    def check_api_key(self, context: grpc.aio.ServicerContext) -> None:
        """`authorization: Bearer <key>` metadata when a key is configured, as HTTP's header."""
        key = self.state.config.api_key
        if key is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")

    async def _start(self, request: pb.GenerateRequest, context, stream: bool) -> StartedRequest[CompletionRequest]:
        async def read_body() -> CompletionRequest:
            return completion_body(request, self.state, stream)

        client_request_id = dict(context.invocation_metadata() or ()).get("x-request-id") or uuid.uuid4().hex
        return await start_request(self.state, read_body, encode_completion, "cmpl", client_request_id)

    @_grpc_handler
    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        started = await self._start(request, context, stream=False)
        generation = started.generation
        await collect(generation)  # a cancelled call cancels this task: the generation closes, the request aborts
        choices = [pb.Choice(index=i, text="".join(c.text), token_ids=c.token_ids, finish_reason=c.finish_reason or "",
                             logprobs=_logprobs(c.logprobs)) for i, c in enumerate(generation.choices)]
        return pb.GenerateResponse(**started.head(), choices=choices, usage=_usage(generation))

    @_grpc_handler
    async def GenerateStream(self, request: pb.GenerateRequest, context) -> None:
        # NOTE: written with context.write, not as an async generator: a cancelled call then cancels this
        # coroutine wherever it waits, and the finally below closes the generation at once (a suspended
        # generator would be closed only when collected)
        started = await self._start(request, context, stream=True)
        generation, head = started.generation, started.head()
        guard = SlowReaderGuard(context.write, generation.set_writer_blocked, self.state.config.stream_write_timeout)
        try:
            async for index, out in generation.outputs():
                if out.new_text or out.new_token_ids or out.finished:
                    await _write(guard, pb.GenerateStreamResponse(**head, choice=_delta(index, out)))
                if out.error:
                    raise generation.engine_error()
            await _write(guard, pb.GenerateStreamResponse(**head, usage=_usage(generation)))
        except EngineDeadError as exc:
            raise generation.engine_error(exc) from None
        finally:
            generation.close()

    @_grpc_handler
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self.state.check_phase()
        refuse_unknown_proto_fields(request, self.state.config.allow_unknown_fields)
        loaded = await self.state.acquire(request.model if request.HasField("model") else None, time.monotonic(),
                                          self.state.config.request_timeout)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = await encode(loaded.engine, request.prompt, add_special)
        return pb.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=loaded.max_model_len)

    @_grpc_handler
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        cards = [model_card(self.state, slot, name) for slot in self.state.registry.slots for name in slot.names]
        return pb.ListModelsResponse(models=[
            pb.ModelInfo(id=c.id, root=c.root, max_model_len=c.max_model_len, state=c.state,
                         memory_bytes=c.memory_bytes, error=c.error) for c in cards])


async def _write(guard: SlowReaderGuard, message: pb.GenerateStreamResponse) -> None:
    """One streamed message under HTTP's slow-reader rules; a client that read nothing for the write
    timeout ends the call (server/intake/slow_reader.py)."""
    try:
        await guard.send(message)
    except TimeoutError:
        raise ServiceUnavailable(f"the client read nothing for {guard.write_timeout:g}s", code="write_timeout",
                                 retry_after=None) from None


def _delta(index: int, out: RequestOutput) -> pb.Choice:
    reason = out.finish_reason.value if out.finished else ""
    return pb.Choice(index=index, text=out.new_text, token_ids=out.new_token_ids, finish_reason=reason,
                     logprobs=_logprobs(out.logprobs or ()))


def _logprobs(logprobs: list[TokenLogprob] | tuple) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top]) for lp in logprobs]


def _usage(generation: Generation) -> pb.Usage:
    usage = generation.usage()
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens, cached_tokens=usage.prompt_tokens_details.cached_tokens)
