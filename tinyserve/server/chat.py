"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import functools
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tinyserve.server.generation import EventStreamResponse, Generation, event_stream, run_to_end
from tinyserve.server.intake import (compile_structured_output, encode_chat, parse_body,
                                     require_api_key, server_state, validate_prompt)
from tinyserve.server.logprobs import TokenTexts, chat_logprobs, prompt_logprobs
from tinyserve.server.protocol import ChatCompletionRequest, limits_context
from tinyserve.server.responses import (ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatMessage, ChatResponse,
                                        ToolCallDelta, ToolCallOut)
from tinyserve.server.tools import ToolCallStream, ToolPlan
from tinyserve.types import RequestOutput

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    state = server_state(request)
    state.admit()
    body = await parse_body(request, ChatCompletionRequest, limits_context(state.config))
    timeout = state.request_timeout(body.timeout)
    loaded = await state.acquire(body.model, arrival, timeout)  # 404, or loads the model on demand
    slot = state.registry.resolve(body.model)
    engine = loaded.engine
    with loaded.pending():  # a swap or unload waits for this request until its stream is open
        params = body.with_defaults(body.to_sampling_params(), loaded.sampling_defaults)
        tools = body.tool_plan()
        await compile_structured_output(engine, params, body.structured_output_param())
        native_tools = engine.tokenizer.template_renders_tools
        messages = [m.as_template_message(native_tools) for m in body.messages]
        if tools is not None and not native_tools:
            messages = tools.with_fallback_prompt(messages)
        template_tools = tools.template_kwargs()["tools"] if tools is not None and native_tools else None
        prompt_ids = await encode_chat(state, loaded, messages, body.add_generation_prompt, template_tools)
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        validate_prompt(engine, prompt_ids, params, "messages", max_tokens_param)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = Generation(engine, request_id, [prompt_ids], params, body.priority, arrival, timeout,
                                request.state.request_id, body.cache_salt)
        texts = loaded.token_texts if params.logprobs is not None else None
        # again, counting every sample, with no await before queueing (see completions)
        slot.admit(params.n, loaded, body.priority, params.n)
        generation.start(slot.ticket(params.n))
    head = {"id": request_id, "created": int(time.time()), "model": body.model or state.model_name}
    if body.stream:
        options = body.stream_options
        roles = [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                                 finish_reason=None)
                 for i in range(len(generation.choices))]  # the role first, as OpenAI does
        chunk = functools.partial(ChatChunk, **head)
        streams = [ToolCallStream(tools) for _ in generation.choices] if tools is not None else None
        stream = event_stream(generation, chunk, options is not None and options.include_usage,
                              _choice(texts, streams), roles,
                              continuous_usage=options is not None and options.continuous_usage_stats)
        return EventStreamResponse(stream, generation, write_timeout=state.config.stream_write_timeout)
    await run_to_end(generation, request)
    response = _response(generation, head, texts, tools)
    scored = generation.choices[0].prompt_logprobs  # one prompt: every choice carries the same
    if body.prompt_logprobs is not None and scored is not None:
        response.prompt_logprobs = prompt_logprobs(loaded.token_texts, scored, body.prompt_logprobs)
    return JSONResponse(response.dump())


def _choice(texts: TokenTexts | None, streams: list[ToolCallStream] | None):
    """Streaming: one output -> one choice delta. With tools, `streams[index]` holds back text that may be
    a call and turns each finished call into a tool_calls delta."""
    def choice(index: int, out: RequestOutput) -> ChatChunkChoice | None:
        text, calls = out.new_text, []
        if streams is not None:
            text, calls = streams[index].feed(text)
            if out.finished:
                text += streams[index].finish()
        if not text and not calls and not out.finished and not out.logprobs:
            return None  # text held back (a partial character, a stop-string prefix, a call being written)
        logprobs = chat_logprobs(texts, out.logprobs) if texts is not None and out.logprobs else None
        delta = ChatDelta(content=text) if text or not out.finished else ChatDelta()
        if calls:
            first = streams[index].num_calls - len(calls)
            delta.tool_calls = [ToolCallDelta(**call.as_openai(first + i)) for i, call in enumerate(calls)]
            delta.content = text or None
        reason = out.finish_reason.value if out.finished else None
        if reason == "stop" and streams is not None and streams[index].num_calls:
            reason = "tool_calls"
        return ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)

    return choice


def _response(generation: Generation, head: dict, texts: TokenTexts | None, tools: ToolPlan | None) -> ChatResponse:
    choices = []
    for index, c in enumerate(generation.choices):
        message, reason = ChatMessage(content="".join(c.text)), c.finish_reason
        if tools is not None:
            content, calls = tools.parse(message.content)
            if calls:
                message = ChatMessage(content=content, tool_calls=[ToolCallOut(**call.as_openai()) for call in calls])
                reason = "tool_calls" if reason == "stop" else reason
        choices.append(ChatChoice(index=index, message=message, finish_reason=reason,
                                  logprobs=chat_logprobs(texts, c.logprobs) if texts is not None else None))
    return ChatResponse(**head, choices=choices, usage=generation.usage())
