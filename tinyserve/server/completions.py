"""POST /v1/completions: prompt as a string, a list of strings, token ids, or a list of token id lists;
with echo, each prompt's text (and its tokens' logprobs) comes before its choices' own (max_tokens 0: only it).
`start_completion`, from a validated body to a queued request, is the gRPC API's too (server/grpc_service.py)."""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tinyserve.server.generation import EventStreamResponse, Generation, event_stream, run_to_end
from tinyserve.server.intake import (compile_structured_output, encode_prompt, parse_body,
                                     require_api_key, server_state, validate_prompt)
from tinyserve.server.logprobs import TokenTexts, completion_logprobs, echoed_prompt_logprobs, prompt_logprobs
from tinyserve.server.model_slot import LoadedModel
from tinyserve.server.protocol import CompletionRequest, limits_context
from tinyserve.server.responses import (CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse,
                                        CompletionResponseChoice)
from tinyserve.server.state import ServerState
from tinyserve.types import RequestOutput, TokenLogprob

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    state.admit()
    body = await parse_body(request, CompletionRequest, limits_context(state.config))
    started = await start_completion(state, body, arrival, request.state.request_id)
    generation, texts = started.generation, started.loaded.token_texts
    echo = _Echo(body, started.prompts, texts) if body.echo else None
    head = {"id": generation.request_id, "created": int(time.time()), "model": body.model or state.model_name}
    if body.stream:
        options = body.stream_options
        choice = _choice(texts if body.logprobs is not None else None, generation.params.n, echo)
        chunk = functools.partial(CompletionChunk, **head)
        stream = event_stream(generation, chunk, options is not None and options.include_usage, choice,
                              continuous_usage=options is not None and options.continuous_usage_stats)
        return EventStreamResponse(stream, generation, write_timeout=state.config.stream_write_timeout)
    await run_to_end(generation, request)
    return JSONResponse(_response(generation, head, texts, body, echo).dump())


@dataclass
class StartedCompletion:
    loaded: LoadedModel  # the load the request was admitted to, kept to its end
    prompts: list[list[int]]  # each prompt's ids
    generation: Generation  # started: queued in the engine


async def start_completion(state: ServerState, body: CompletionRequest, arrival: float, client_request_id: str,
                           api: str = "http") -> StartedCompletion:
    """A validated completion body to a queued engine request, for HTTP and gRPC alike: its model (404, or
    loaded on demand), its sampling parameters over the model's defaults, its grammar compiled, its
    prompts tokenized and checked by the engine (400), and admission counting every sample (503)."""
    timeout = state.request_timeout(body.timeout)
    loaded = await state.acquire(body.model, arrival, timeout)  # 404, or loads the model on demand
    engine = loaded.engine
    with loaded.pending():  # a swap or unload waits for this request until its stream is open
        params = body.with_defaults(body.to_sampling_params(), loaded.sampling_defaults)
        await compile_structured_output(engine, params, body.structured_output_param())
        prompts = [p if isinstance(p, list) else await encode_prompt(loaded, p) for p in body.prompt]
        for ids in prompts:
            validate_prompt(engine, ids, params, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation = Generation(engine, request_id, prompts, params, body.priority, arrival, timeout,
                                client_request_id, body.cache_salt)
        # again, counting every sample, with no await before queueing: the awaits above let other requests in
        slot = state.registry.resolve(body.model)
        slot.admit(len(prompts) * params.n, loaded, body.priority, params.n)
        slot.metrics.track_api(request_id, len(prompts) * params.n, api)
        generation.start(slot.ticket(len(prompts) * params.n))
    return StartedCompletion(loaded, prompts, generation)


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
