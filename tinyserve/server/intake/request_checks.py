"""The pieces of the generation endpoints' front door: the API key, body parsing (400, size caps first),
tokenization, and the engine's validation (400 with the numbers). server/intake/request_start.py puts them in
order with admission (503 before any work) and the model check (404).

Work that grows with the body runs off the event loop: long prompts are tokenized in a worker thread
(Tokenizer.encode releases the GIL for them), and chat templates are rendered and encoded there too.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import pydantic_core
from fastapi import Request
from pydantic import BaseModel, ValidationError

from tinyserve.engine.loop.async_engine import AsyncEngine
from tinyserve.server.errors import BadRequest, Unauthorized, bad_request_from_validation
from tinyserve.server.registry.model_slot import ServedModel
from tinyserve.server.openai_api.protocol import entry_caps, limits_context, refuse_unknown_fields
from tinyserve.server.state import ServerState
from tinyserve.types import InvalidRequest, SamplingParams

M = TypeVar("M", bound=BaseModel)
# prompts longer than this (characters) are tokenized in a worker thread, off the event loop
_THREAD_TOKENIZE_CHARS = 8192
_PARSE_FIRST_BYTES = 64 << 10  # bodies from this size are parsed before they are validated (parse_body)
# msgspec.Raw keeps a value as its bytes: counting a list's entries this way builds no dicts or strings
_TOP_LEVEL_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENTRIES = msgspec.json.Decoder(list[msgspec.Raw] | dict[str, msgspec.Raw])


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


async def parse_body(request: Request, model: type[M], context: dict[str, Any] | None = None) -> M:
    """`context` reaches the model's validators (protocol.limits_context: the server's size caps) and
    says whether fields the model does not declare are refused (a 400 naming the first) or ignored.

    NOTE: a large body is parsed to Python objects first, then validated: `model_validate_json` hands a
    list to a "before" validator only after converting the whole JSON tree again, so a size cap checked
    there cost ~10x the parse on a 100,000-message body. Strict validation accepts the same in both
    modes; small bodies keep JSON mode for its error wording ("a valid array", not "a valid list")."""
    body = await request.body()
    parsed = _validate(body, model, context)
    refuse_unknown_fields(parsed, context)
    return parsed


def body_reader(request: Request, model: type[M]) -> Callable[[], Awaitable[M]]:
    """The request's body as `model` under the server's size caps, read when called: after admission
    (request_start.start_request)."""
    return lambda: parse_body(request, model, limits_context(server_state(request).config))


def _validate(body: bytes, model: type[M], context: dict[str, Any] | None) -> M:
    try:
        if len(body) < _PARSE_FIRST_BYTES:
            return model.model_validate_json(body, context=context)
        refuse_long_lists(body, entry_caps(model, context))
        try:
            # cache keys only: caching every value slowed a body of many distinct strings, no cache one of
            # many repeated keys (docs/PERFORMANCE.md, "Numbers behind the code's comments")
            data = pydantic_core.from_json(body, cache_strings="keys")
        except ValueError as exc:
            raise BadRequest(f"malformed JSON body: {exc}", code="invalid_json") from None
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise bad_request_from_validation(exc) from None


def refuse_long_lists(body: bytes, caps: dict[str, int]) -> None:
    """400 for a field with more entries than its cap, counted without building them: parsing 100,000
    messages into dicts blocks the event loop ~4x longer than this count (docs/PERFORMANCE.md). A body this
    cannot read (malformed, nested past msgspec's depth, not an object, a field of another type) is left to
    parse_body's own errors."""
    try:
        fields = _TOP_LEVEL_FIELDS.decode(body)
        for name, cap in caps.items():
            if name in fields and (count := len(_ENTRIES.decode(fields[name]))) > cap:
                raise BadRequest(f"{name} must have at most {cap} entries, got {count}", param=name)
    except (msgspec.MsgspecError, RecursionError):  # msgspec raises the latter past its nesting depth
        return


def check_fits(loaded: ServedModel, num_chars: int, param: str) -> None:
    """A text of more characters than the context's tokens can cover is refused without tokenizing it."""
    max_token_chars = loaded.engine.tokenizer.max_token_chars
    if max_token_chars is not None and num_chars > loaded.max_model_len * max_token_chars:
        raise BadRequest(f"{param} has {num_chars} characters, more than the model's context of "
                         f"{loaded.max_model_len} tokens can hold", param=param, code="context_length_exceeded")


async def encode(engine: AsyncEngine, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) > _THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens)
    return engine.tokenizer.encode(text, add_special_tokens)


async def encode_prompt(loaded: ServedModel, text: str) -> list[int]:
    check_fits(loaded, len(text), "prompt")
    return await encode(loaded.engine, text)


async def encode_chat(state: ServerState, loaded: ServedModel, messages: list[dict],
                      add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    """The conversation's prompt ids, rendered and encoded in a worker thread. Special-token text in
    content is encoded as text, and in a name refused, unless the server trusts its clients
    (allow_special_tokens_in_messages)."""
    engine = loaded.engine
    if engine.tokenizer.chat_template is None:  # a base model's GGUF, say: no way to know its turn format
        raise BadRequest("this model has no chat template (its checkpoint carries none), so chat messages cannot "
                         "be turned into a prompt: start the server with --chat-template FILE, or send the "
                         "prompt as text to /v1/completions", param="messages", code="chat_template_missing")
    check_fits(loaded, sum(len(m["content"]) for m in messages), "messages")
    trusted = state.config.allow_special_tokens_in_messages
    for i, message in enumerate(messages):  # a template may render a name as it is, special tokens and all
        if not trusted and engine.tokenizer.has_special_text(message.get("name", "")):
            raise BadRequest(f"messages[{i}].name: must not spell a special token (the server's "
                             "--allow-special-tokens-in-messages allows it)", param=f"messages[{i}].name")
    try:
        return await asyncio.to_thread(engine.tokenizer.encode_chat, messages, add_generation_prompt, trusted, tools)
    except ValueError as exc:  # the template's own message, e.g. roles that must alternate
        raise BadRequest(f"messages: {exc}", param="messages") from None


def validate_prompt(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, param: str,
                    max_tokens_param: str = "max_tokens") -> None:
    """The engine's checks (context length with both numbers, token id ranges), the one time they run for
    a request, as a 400 naming the field: `param` (prompt or messages) for the prompt's own faults, the
    client's spelling of max_tokens, else the sampling field the rule names."""
    try:
        engine.validate(prompt_ids, params)
    except InvalidRequest as exc:
        named = {"prompt": param, "max_tokens": max_tokens_param}.get(exc.param, exc.param)
        raise BadRequest(exc.message, param=named, code=exc.code) from None


async def compile_structured_output(engine: AsyncEngine, params: SamplingParams, param: str | None) -> None:
    """A grammar that cannot compile is a 400 naming the field it came from (`param`), before queueing."""
    if params.structured_output is None:
        return
    try:
        await engine.compile_structured_output(params.structured_output)
    except InvalidRequest as exc:
        raise BadRequest(f"{param}: {exc.message}", param=param, code=exc.code) from None
