"""The front door of the generation endpoints, in order: admission (503 before any work), body parsing
(400), model check (404), tokenization, and the engine's validation (400 with the numbers)."""

from __future__ import annotations

import asyncio
import secrets
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.server.errors import BadRequest, NotFound, Unauthorized, bad_request_from_validation
from tinyserve.server.state import ServerState
from tinyserve.types import SamplingParams

M = TypeVar("M", bound=BaseModel)
# prompts longer than this (characters) are tokenized in a worker thread, off the event loop
_THREAD_TOKENIZE_CHARS = 20_000


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def require_api_key(request: Request) -> None:
    """FastAPI dependency of the API routes: `Authorization: Bearer <key>` when a key is configured."""
    key = server_state(request).config.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")


async def parse_body(request: Request, model: type[M]) -> M:
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise bad_request_from_validation(exc) from None


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.served_model_names:
        raise NotFound(f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


async def encode(engine: AsyncEngine, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) > _THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens)
    return engine.tokenizer.encode(text, add_special_tokens)


def render_chat(engine: AsyncEngine, messages: list[dict], add_generation_prompt: bool) -> str:
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise BadRequest(str(exc), param="messages") from None


def validate_prompt(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, param: str,
                    max_tokens_param: str = "max_tokens") -> None:
    """The engine's checks (context length with both numbers, token id range) as a 400."""
    try:
        engine.engine.validate(prompt_ids, params)
    except ValueError as exc:
        message = str(exc)
        named = max_tokens_param if "max_tokens" in message else "logit_bias" if "logit_bias" in message else param
        raise BadRequest(message, param=named, code="context_length_exceeded" if "context" in message else
                         "invalid_value") from None
