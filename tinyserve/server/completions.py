"""POST /v1/completions: prompt as a string, a list of strings, token ids, or a list of token id lists."""

from __future__ import annotations

import functools
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tinyserve.server.generation import EventStreamResponse, Generation, event_stream, run_to_end
from tinyserve.server.intake import (check_model, encode_prompt, parse_body, require_api_key, server_state,
                                     validate_prompt)
from tinyserve.server.logprobs import TokenTexts, completion_logprobs
from tinyserve.server.protocol import CompletionRequest, limits_context
from tinyserve.server.responses import (CompletionChoice, CompletionChunk, CompletionResponse,
                                        CompletionResponseChoice)
from tinyserve.types import RequestOutput

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    engine = state.admit()
    body = await parse_body(request, CompletionRequest, limits_context(state.config))
    check_model(state, body.model)
    params = body.with_defaults(body.to_sampling_params(), state.sampling_defaults)
    prompts = [p if isinstance(p, list) else await encode_prompt(state, engine, p) for p in body.prompt]
    for ids in prompts:
        validate_prompt(engine, ids, params, "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    generation = Generation(engine, request_id, prompts, params, body.priority, arrival,
                            state.config.request_timeout, request.state.request_id, body.cache_salt)
    texts = state.token_texts if params.logprobs is not None else None
    head = {"id": request_id, "created": int(time.time()), "model": body.model or state.model_name}
    # again, counting every sample, with no await before queueing: the awaits above let other requests in
    state.admit(len(prompts) * params.n)
    generation.start()
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        choice = _choice(texts, [0] * len(generation.choices))
        chunk = functools.partial(CompletionChunk, **head)
        return EventStreamResponse(event_stream(generation, chunk, include_usage, choice), generation,
                                   write_timeout=state.config.stream_write_timeout)
    await run_to_end(generation, request)
    return JSONResponse(_response(generation, head, texts).dump())


def _choice(texts: TokenTexts | None, offsets: list[int]):
    """Streaming: one output -> one choice delta (offsets: each choice's text offset so far)."""
    def choice(index: int, out: RequestOutput) -> CompletionChoice | None:
        if not out.new_text and not out.finished and not out.logprobs:
            return None  # the detokenizer is holding text back (partial character or stop-string prefix)
        logprobs = None
        if texts is not None and out.logprobs:
            logprobs = completion_logprobs(texts, out.logprobs, offsets[index])
            offsets[index] += sum(map(len, logprobs.tokens))
        reason = out.finish_reason.value if out.finished else None
        return CompletionChoice(index=index, text=out.new_text, logprobs=logprobs, finish_reason=reason)

    return choice


def _response(generation: Generation, head: dict, texts: TokenTexts | None) -> CompletionResponse:
    choices = [
        CompletionResponseChoice(index=index, text="".join(c.text), finish_reason=c.finish_reason,
                                 logprobs=completion_logprobs(texts, c.logprobs, 0) if texts is not None else None)
        for index, c in enumerate(generation.choices)
    ]
    return CompletionResponse(**head, choices=choices, usage=generation.usage())
