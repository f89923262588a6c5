"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tinyserve.server.intake.generation import EventStreamResponse, Generation, event_stream, collect_while_connected
from tinyserve.server.intake.request_checks import body_reader, encode_chat, require_api_key, server_state, validate_prompt
from tinyserve.server.openai_api.logprobs import TokenTexts, chat_logprobs, prompt_logprobs
from tinyserve.server.registry.model_slot import ServedModel
from tinyserve.server.openai_api.protocol import ChatCompletionRequest
from tinyserve.server.intake.request_start import start_request
from tinyserve.server.openai_api.responses import (ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatCompletionMessage, ChatResponse,
                                        ToolCallDelta, ToolCallOut)
from tinyserve.server.state import ServerState
from tinyserve.server.openai_api.tools import ToolCallStream, ToolPlan
from tinyserve.types import RequestOutput, SamplingParams

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    started = await start_request(state, body_reader(request, ChatCompletionRequest),
                                  functools.partial(_encode, state), "chatcmpl", request.state.request_id)
    body, generation, loaded = started.body, started.generation, started.loaded
    tools = body.tool_plan()  # valid: to_sampling_params built it once already
    texts = loaded.token_texts if generation.params.logprobs is not None else None
    head = started.head()
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
    await collect_while_connected(generation, request)
    response = _response(generation, head, texts, tools)
    scored = generation.choices[0].prompt_logprobs  # one prompt: every choice carries the same
    if body.prompt_logprobs is not None and scored is not None:
        response.prompt_logprobs = prompt_logprobs(loaded.token_texts, scored, body.prompt_logprobs)
    return JSONResponse(response.dump())


async def _encode(state: ServerState, body: ChatCompletionRequest, loaded: ServedModel,
                  params: SamplingParams) -> list[list[int]]:
    """The conversation through the model's chat template (tools rendered by it, or as a system prompt
    when it cannot), checked by the engine: 400s name messages, or the client's max_tokens field."""
    tools, native_tools = body.tool_plan(), loaded.engine.tokenizer.template_renders_tools
    messages = [m.as_template_message(native_tools) for m in body.messages]
    if tools is not None and not native_tools:
        messages = tools.with_fallback_prompt(messages)
    template_tools = tools.template_kwargs()["tools"] if tools is not None and native_tools else None
    prompt_ids = await encode_chat(state, loaded, messages, body.add_generation_prompt, template_tools)
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    validate_prompt(loaded.engine, prompt_ids, params, "messages", max_tokens_param)
    return [prompt_ids]


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
        message, reason = ChatCompletionMessage(content="".join(c.text)), c.finish_reason
        if tools is not None:
            content, calls = tools.parse(message.content)
            if calls:
                message = ChatCompletionMessage(content=content, tool_calls=[ToolCallOut(**call.as_openai()) for call in calls])
                reason = "tool_calls" if reason == "stop" else reason
        choices.append(ChatChoice(index=index, message=message, finish_reason=reason,
                                  logprobs=chat_logprobs(texts, c.logprobs) if texts is not None else None))
    return ChatResponse(**head, choices=choices, usage=generation.usage())
