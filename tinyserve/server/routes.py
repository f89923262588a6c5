"""The small endpoints: models, tokenize / detokenize (behind the API key), health, metrics, version
(always open, for load balancers and scrapers)."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

import tinyserve
from tinyserve.server.errors import BadRequest
from tinyserve.server.intake import (check_model, encode, parse_body, render_chat, require_api_key,
                                     server_state)
from tinyserve.server.metrics import CONTENT_TYPE
from tinyserve.server.protocol import DetokenizeRequest, TokenizeRequest
from tinyserve.types import SamplingParams

api = APIRouter(dependencies=[Depends(require_api_key)])
public = APIRouter()
DEEP_HEALTH_TIMEOUT_S = 30.0


def _model_card(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "tinyserve",
            "root": state.engine_config.model, "max_model_len": state.max_model_len or None}


@api.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = server_state(request)
    return {"object": "list", "data": [_model_card(state, name) for name in state.served_model_names]}


@api.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> dict:
    state = server_state(request)
    check_model(state, name)
    return _model_card(state, name)


@api.post("/tokenize")
async def tokenize(request: Request) -> dict:
    state = server_state(request)
    engine = state.check_ready()
    body = await parse_body(request, TokenizeRequest)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        text = render_chat(engine, [m.as_template_message() for m in body.messages], body.add_generation_prompt)
        ids = await encode(engine, text, add_special_tokens=False)
    else:
        ids = await encode(engine, body.prompt, body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


@api.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state = server_state(request)
    engine = state.check_ready()
    body = await parse_body(request, DetokenizeRequest)
    check_model(state, body.model)
    vocab = engine.engine.model_config.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"tokens[{bad}] must be a token id in [0, {vocab}), got {body.tokens[bad]}",
                         param=f"tokens[{bad}]")
    return {"prompt": engine.tokenizer.decode(body.tokens)}


@public.get("/health")
async def health(request: Request, deep: bool = False) -> Response:
    state = server_state(request)
    ok, status = state.is_healthy()
    if ok and deep:
        ok, status = await _one_token(state)
    headers = None if ok else {"Retry-After": "5"}
    return JSONResponse({"status": status}, status_code=200 if ok else 503, headers=headers)


async def _one_token(state) -> tuple[bool, str]:
    """Runs a one-token greedy generation ahead of the queue."""
    engine = state.engine
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ids = engine.tokenizer.encode("Hi")

    async def run() -> bool:
        finals = [out async for out in engine.generate(f"health-{uuid.uuid4().hex}", ids, params, priority=-(2**31))
                  if out.finished]
        return bool(finals) and finals[0].finish_reason.value in ("length", "stop")

    try:
        return (True, "ok") if await asyncio.wait_for(run(), DEEP_HEALTH_TIMEOUT_S) else (False, "generation_failed")
    except (asyncio.TimeoutError, RuntimeError) as exc:
        return False, f"generation_failed: {type(exc).__name__}"


@public.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    body = state.metrics.render() if state.metrics is not None else b""
    return Response(body, media_type=CONTENT_TYPE)


@public.get("/version")
async def version() -> dict:
    return {"version": tinyserve.__version__}
