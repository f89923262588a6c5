"""The small endpoints: models, tokenize / detokenize (behind the API key), health, metrics, version
(always open, for load balancers and scrapers)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

import tinyserve
from tinyserve.server.errors import BadRequest
from tinyserve.server.intake.request_checks import encode, encode_chat, parse_body, require_api_key, server_state
from tinyserve.server.observability.metrics import CONTENT_TYPE
from tinyserve.server.openai_api.protocol import DetokenizeRequest, TokenizeRequest, limits_context
from tinyserve.server.openai_api.responses import (DetokenizeResponse, HealthResponse, ModelCard, ModelList,
                                        SamplingDefaultsInfo, TokenizeResponse, VersionResponse)
from tinyserve.server.registry.model_slot import ModelSlot
from tinyserve.server.state import ServerState
from tinyserve.types import SamplingParams

api = APIRouter(dependencies=[Depends(require_api_key)])
public = APIRouter()
DEEP_HEALTH_TIMEOUT_S = 30.0
DEEP_HEALTH_REUSE_S = 2.0  # a deep probe's result answers every probe for this long after it
_THREAD_DETOKENIZE_TOKENS = 8192  # longer /detokenize requests are checked and decoded off the event loop


def model_card(state: ServerState, slot: ModelSlot, name: str) -> ModelCard:
    # root is the served name, never the source: that may be a path on the server's disk
    loaded = slot.current
    defaults = loaded.sampling_defaults if loaded is not None else None
    info = None if defaults is None else SamplingDefaultsInfo(**defaults.as_fields())
    return ModelCard(id=name, created=state.created, root=slot.name,
                     max_model_len=loaded.max_model_len if loaded is not None else None,
                     default_sampling_params=info, state=slot.phase, memory_bytes=slot.memory_bytes,
                     error=slot.error, load_seconds=slot.load_seconds)


@api.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = server_state(request)
    return ModelList(data=[model_card(state, slot, name) for slot in state.registry.slots
                           for name in slot.names]).dump()


@api.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> dict:
    state = server_state(request)
    return model_card(state, state.registry.resolve(name), name).dump()


@api.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state = server_state(request)
    state.check_phase()
    body = await parse_body(request, TokenizeRequest, limits_context(state.config))
    loaded = await state.acquire(body.model, time.monotonic(), state.config.request_timeout)
    engine = loaded.engine
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("prompt: give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:  # the ids a chat completion would get
        messages = [m.as_template_message() for m in body.messages]
        ids = await encode_chat(state, loaded, messages, body.add_generation_prompt)
    else:
        ids = await encode(engine, body.prompt, body.add_special_tokens)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=loaded.max_model_len).dump()


@api.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state = server_state(request)
    state.check_phase()
    body = await parse_body(request, DetokenizeRequest, limits_context(state.config))
    engine = (await state.acquire(body.model, time.monotonic(), state.config.request_timeout)).engine
    vocab = engine.engine.model_config.vocab_size

    def check_and_decode(tokens: list[int]) -> str:
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"tokens[{bad}] must be a token id in [0, {vocab}), got {tokens[bad]}",
                             param=f"tokens[{bad}]")
        return engine.tokenizer.decode(tokens)

    if len(body.tokens) > _THREAD_DETOKENIZE_TOKENS:
        return DetokenizeResponse(prompt=await asyncio.to_thread(check_and_decode, body.tokens)).dump()
    return DetokenizeResponse(prompt=check_and_decode(body.tokens)).dump()


@public.get("/health")
async def health(request: Request, deep: bool = False, model: str | None = None) -> Response:
    """The server's health, or with `model` that model's (404 for a name it does not serve)."""
    state = server_state(request)
    ok, status = state.is_healthy(model)
    probed = state.default if model is None else state.registry.resolve(model)
    if ok and deep and probed is state.default and probed.current is not None:  # the probe runs on the first
        probe = getattr(request.app.state, "deep_health_probe", None)
        if probe is None:
            probe = request.app.state.deep_health_probe = DeepHealthProbe()
        ok, status = await probe.check(state)
    headers = None if ok else {"Retry-After": "5"}
    return JSONResponse(HealthResponse(status=status).dump(), status_code=200 if ok else 503, headers=headers)


class DeepHealthProbe:
    """A one-token greedy generation at priority -(max_priority + 1), ahead of every client. /health is
    open, so a flood of deep probes must not flood the engine: probes that arrive while one runs await
    that one, and its result answers every probe for DEEP_HEALTH_REUSE_S after it ends; at most one
    probe generation is ever queued. One per app (kept on app.state)."""

    def __init__(self) -> None:
        self._running: asyncio.Future[tuple[bool, str]] | None = None
        self._result: tuple[bool, str] = (False, "generation_failed")
        self._finished_at = float("-inf")

    async def check(self, state: ServerState) -> tuple[bool, str]:
        if self._running is None and time.monotonic() - self._finished_at < DEEP_HEALTH_REUSE_S:
            return self._result
        if self._running is None:
            self._running = asyncio.ensure_future(self._run(state))
        # shielded: a prober that hangs up must not cancel the generation the others are waiting on
        return await asyncio.shield(self._running)

    async def _run(self, state: ServerState) -> tuple[bool, str]:
        try:
            result = await asyncio.wait_for(_one_token(state), DEEP_HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            result = (False, "generation_timed_out")
        except Exception:  # noqa: BLE001 - the engine died or refused: the probe's answer, not a 500
            result = (False, "generation_failed")
        self._result, self._finished_at, self._running = result, time.monotonic(), None
        return result


async def _one_token(state: ServerState) -> tuple[bool, str]:
    engine = state.engine
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ids = engine.tokenizer.encode("Hi")
    finals = [out async for out in engine.generate(f"health-{uuid.uuid4().hex}", ids, params,
                                                   priority=-(state.config.limits.max_priority + 1)) if out.finished]
    ok = bool(finals) and finals[0].finish_reason.value in ("length", "stop")
    return (True, "ok") if ok else (False, "generation_failed")


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@public.get("/version")
async def version() -> dict:
    return VersionResponse(version=tinyserve.__version__).dump()
