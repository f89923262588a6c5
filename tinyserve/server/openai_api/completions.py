"""POST /v1/completions: prompt as a string, a list of strings, token ids, or a list of token id lists;
with echo, each prompt's text (and its tokens' logprobs) comes before its choices' own (max_tokens 0: only it).
Started by request_start.start_request; `encode_completion`, a body's prompts to checked ids, is the gRPC
API's too (server/grpc_api/grpc_service.py)."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tinyserve.server.intake.generation import EventStreamResponse, Generation, event_stream, collect_while_connected
from tinyserve.server.intake.request_checks import body_reader, encode_prompt, require_api_key, server_state, validate_prompt
from tinyserve.server.openai_api.logprobs import TokenTexts, completion_logprobs, echoed_prompt_logprobs, prompt_logprobs
from tinyserve.server.registry.model_slot import ServedModel
from tinyserve.server.openai_api.protocol import CompletionRequest
from tinyserve.server.intake.request_start import start_request
from tinyserve.server.openai_api.responses import (CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse,
                                        CompletionResponseChoice)
from tinyserve.types import RequestOutput, SamplingParams, TokenLogprob

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    started = await start_request(state, body_reader(request, CompletionRequest), encode_completion, "cmpl",
                                  request.state.request_id)
    body, generation, texts = started.body, started.generation, started.loaded.token_texts
    echo = _Echo(body, generation.prompts, texts) if body.echo else None
    head = started.head()
    if body.stream:
        options = body.stream_options
        choice = _choice(texts if body.logprobs is not None else None, generation.params.n, echo)
        chunk = functools.partial(CompletionChunk, **head)
        stream = event_stream(generation, chunk, options is not None and options.include_usage, choice,
                              continuous_usage=options is not None and options.continuous_usage_stats)
        return EventStreamResponse(stream, generation, write_timeout=state.config.stream_write_timeout)
    await collect_while_connected(generation, request)
    return JSONResponse(_response(generation, head, texts, body, echo).dump())


async def encode_completion(body: CompletionRequest, loaded: ServedModel, params: SamplingParams) -> list[list[int]]:
    """Each prompt's ids (text tokenized, ids as sent), checked by the engine: 400s name the prompt. The
    gRPC API's too (server/grpc_api/grpc_service.py)."""
    prompts = [p if isinstance(p, list) else await encode_prompt(loaded, p) for p in body.prompt]
    for ids in prompts:
        validate_prompt(loaded.engine, ids, params, "prompt")
    return prompts


class _Echo:
    """echo: each prompt's text before its choices' text and, with logprobs, its tokens' logprobs before
    theirs (the first token's null), the completion's text offsets counting from the prompt's start."""

    def __init__(self, body: CompletionRequest, prompts: list[list[int]], texts: TokenTexts):
        self.prompts, self.texts, self.k = prompts, texts, body.logprobs
        # the prompt as sent; token ids are decoded as they are, special tokens included
        self.prompt_texts = [p if isinstance(p, str) else texts.tokenizer.decode(p, skip_special_tokens=False)
                             for p in body.prompt]

    def logprobs(self, prompt_index: int, prompt_logprobs: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        """The prompt's part of a choice's logprobs; None when not asked, or when the run ended before its
        prompt was computed (an abort)."""
        if self.k is None or prompt_logprobs is None:
            return None
        return echoed_prompt_logprobs(self.texts, self.prompts[prompt_index], prompt_logprobs, self.k)


def _choice(texts: TokenTexts | None, n: int, echo: _Echo | None):
    """Streaming: one output -> one choice delta; with echo a choice's first one starts with its prompt."""
    offsets: dict[int, int] = {}  # each choice's text offset so far (with echo: set by its first output)

    def choice(index: int, out: RequestOutput) -> CompletionChoice | None:
        is_echo_start = echo is not None and index not in offsets
        if not is_echo_start and not out.new_text and not out.finished and not out.logprobs:
            return None  # the detokenizer is holding text back (partial character or stop-string prefix)
        text, logprobs = out.new_text, None
        if is_echo_start:
            prompt_text = echo.prompt_texts[index // n]
            text, logprobs = prompt_text + text, echo.logprobs(index // n, out.prompt_logprobs)
            offsets[index] = len(prompt_text)
        if texts is not None and out.logprobs:
            generated = completion_logprobs(texts, out.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(map(len, generated.tokens))
            logprobs = generated if logprobs is None else logprobs + generated
        reason = out.finish_reason.value if out.finished else None
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)

    return choice


def _response(generation: Generation, head: dict, texts: TokenTexts, body: CompletionRequest,
              echo: _Echo | None) -> CompletionResponse:
    n = generation.params.n
    choices = []
    for index, c in enumerate(generation.choices):
        text, logprobs, offset = "".join(c.text), None, 0
        if echo is not None:
            prompt_text = echo.prompt_texts[index // n]
            text, logprobs, offset = prompt_text + text, echo.logprobs(index // n, c.prompt_logprobs), len(prompt_text)
        if body.logprobs is not None:
            generated = completion_logprobs(texts, c.logprobs, offset)
            logprobs = generated if logprobs is None else logprobs + generated
        reported = None
        if body.prompt_logprobs is not None and c.prompt_logprobs is not None:
            reported = prompt_logprobs(texts, c.prompt_logprobs, body.prompt_logprobs)
        choices.append(CompletionResponseChoice(index=index, text=text, finish_reason=c.finish_reason,
                                                logprobs=logprobs, prompt_logprobs=reported))
    return CompletionResponse(**head, choices=choices, usage=generation.usage())
