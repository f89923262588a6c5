"""The gRPC API's handlers (proto/tinyserve.proto): Generate, GenerateStream, Tokenize, ListModels.

A GenerateRequest becomes the JSON body of the same completion (`completion_body`: the fields it sets,
by their names) and goes through the HTTP path's own code: admission before any work (ServerState.admit),
CompletionRequest's validation, `completions.start_completion` (model, sampling defaults, tokenizing, the
engine's checks, the second admission), the same Generation; so the checks, their messages and the
sampling parameters are HTTP's. An APIError becomes a gRPC status (`status_code`) with the same message.
A call that ends early (cancelled, or past its deadline) cancels its handler's task, which closes the
generation: the engine aborts the request and frees its blocks, as for an HTTP client that disconnects.
A streamed write that waits WRITE_BLOCKED_S on a full flow-control window pauses the request (its seat
and blocks go to others) until the writes flow again; one that waits stream_write_timeout ends the call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
import uuid

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from pydantic import ValidationError

from tinyserve.engine.async_engine import EngineDeadError
from tinyserve.server.completions import start_completion
from tinyserve.server.errors import APIError, BadRequest, ServiceUnavailable, Unauthorized, bad_request_from_validation
from tinyserve.server.generation import WRITE_BLOCKED_S, Generation, collect
from tinyserve.server.intake import encode
from tinyserve.server.metrics import API
from tinyserve.server.proto import tinyserve_pb2 as pb
from tinyserve.server.proto import tinyserve_pb2_grpc
from tinyserve.server.protocol import CompletionRequest, limits_context, refuse_unknown_fields
from tinyserve.server.routes import model_card
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

    async def _start(self, request: pb.GenerateRequest, context, stream: bool) -> tuple[Generation, dict]:
        arrival = time.monotonic()
        self.state.admit()
        body = completion_body(request, self.state, stream)
        client_request_id = dict(context.invocation_metadata() or ()).get("x-request-id") or uuid.uuid4().hex
        generation = (await start_completion(self.state, body, arrival, client_request_id, api="grpc")).generation
        head = {"id": generation.request_id, "model": body.model or self.state.model_name, "created": int(time.time())}
        return generation, head

    @_grpc_handler
    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        generation, head = await self._start(request, context, stream=False)
        await collect(generation)  # a cancelled call cancels this task: the generation closes, the request aborts
        choices = [pb.Choice(index=i, text="".join(c.text), token_ids=c.token_ids, finish_reason=c.finish_reason or "",
                             logprobs=_logprobs(c.logprobs)) for i, c in enumerate(generation.choices)]
        return pb.GenerateResponse(**head, choices=choices, usage=_usage(generation))

    @_grpc_handler
    async def GenerateStream(self, request: pb.GenerateRequest, context) -> None:
        # NOTE: written with context.write, not as an async generator: a cancelled call then cancels this
        # coroutine wherever it waits, and the finally below closes the generation at once (a suspended
        # generator would be closed only when collected)
        generation, head = await self._start(request, context, stream=True)
        writer = _StreamWriter(context, generation, self.state.config.stream_write_timeout)
        try:
            async for index, out in generation.outputs():
                if out.new_text or out.new_token_ids or out.finished:
                    await writer.write(pb.GenerateStreamResponse(**head, choice=_delta(index, out)))
                if out.error:
                    raise generation.engine_error()
            await writer.write(pb.GenerateStreamResponse(**head, usage=_usage(generation)))
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


class _StreamWriter:
    """Writes of one stream, with HTTP's rules for a slow reader (generation.EventStreamResponse)."""

    def __init__(self, context: grpc.aio.ServicerContext, generation: Generation, write_timeout: float):
        self.context, self.generation, self.write_timeout = context, generation, write_timeout

    async def write(self, message: pb.GenerateStreamResponse) -> None:
        is_blocked = False

        def on_blocked() -> None:
            nonlocal is_blocked
            is_blocked = True
            self.generation.set_writer_blocked(True)

        timer = asyncio.get_running_loop().call_later(WRITE_BLOCKED_S, on_blocked)
        try:
            await asyncio.wait_for(self.context.write(message), self.write_timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailable(f"the client read nothing for {self.write_timeout:g}s", code="write_timeout",
                                     retry_after=None) from None
        finally:
            timer.cancel()
        if is_blocked:
            self.generation.set_writer_blocked(False)


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
