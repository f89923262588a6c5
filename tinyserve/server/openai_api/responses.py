"""OpenAI response bodies as pydantic models: every body the server sends is built from one of these
(protocol.py holds the request bodies). `dump()` gives the JSON object in the field order below, which is
the order clients see; optional members that OpenAI leaves out (rather than sending null) are noted."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict:
        return self.model_dump()


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Body):
    error: ErrorDetail


class PromptTokensDetails(_Body):
    cached_tokens: int


class UsageInfo(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# logprobs, in the two formats (logprobs.py builds them)

class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]  # null for an echoed prompt's first token (it has no context)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def __add__(self, other: CompletionLogprobs) -> CompletionLogprobs:
        """The entries of `self` then `other` (echo: the prompt's, then the completion's)."""
        return CompletionLogprobs(**{name: getattr(self, name) + getattr(other, name) for name in type(self).model_fields})


class PromptLogprob(_Body):
    """One entry of vLLM's prompt_logprobs: [null, {"<token id>": {logprob, rank, decoded_token}, ...}, ...]."""

    logprob: float
    rank: int  # 1: the most likely token at its position
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob]


# /v1/completions

class CompletionChoice(_Body):
    """A choice of a streamed chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponseChoice(_Body):
    """A choice of the whole (non-streamed) response: the same members, finish_reason before logprobs."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = None  # left out unless asked for (vLLM's field)


class _Head(_Body):
    """The members every completion body and chunk starts with; subclasses fix `object`."""

    id: str
    object: str
    created: int
    model: str


class CompletionResponse(_Head):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo

    def dump(self) -> dict:
        body = self.model_dump()
        for choice in body["choices"]:
            if choice["prompt_logprobs"] is None:
                del choice["prompt_logprobs"]
        return body


class CompletionChunk(_Head):
    """One SSE event. `usage` is sent (null until the last chunk) only when the client asked for it
    (generation.event_stream drops it otherwise)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# /v1/chat/completions

class FunctionCallOut(_Body):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(_Body):
    """A streamed call: sent whole, in one chunk (`index` numbers the calls of the choice)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatCompletionMessage(_Body):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda calls: calls is None)


class ChatChoice(_Body):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatResponse(_Head):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # left out unless asked for (vLLM's field)

    def dump(self) -> dict:
        body = self.model_dump()
        if body["prompt_logprobs"] is None:
            del body["prompt_logprobs"]
        return body


class ChatDelta(_Body):
    """What a chunk adds to the message: the role once, first; then content; nothing on the final chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None

    def dump(self) -> dict:
        body = self.model_dump()
        body["delta"] = self.delta.model_dump(exclude_none=True)  # absent members, not nulls
        return body


class ChatChunk(_Head):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None  # as CompletionChunk's

    def dump(self) -> dict:
        body = self.model_dump()
        body["choices"] = [choice.dump() for choice in self.choices]
        return body


# the small endpoints

class SamplingDefaultsInfo(_Body):
    """The sampling fields a request that leaves them out gets (config.SamplingDefaults)."""

    temperature: float
    top_p: float
    top_k: int | None  # null: no top-k cut
    min_p: float
    repetition_penalty: float


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tinyserve"
    root: str
    max_model_len: int | None
    default_sampling_params: SamplingDefaultsInfo | None  # null until the model has loaded
    # the model's life in this server (server/registry/model_slot.py) and the memory its loads hold
    state: Literal["loaded", "loading", "unloaded", "failed"]
    memory_bytes: int  # weights + KV pool of its loads (0 when unloaded)
    error: str | None = None  # why its last load failed
    load_seconds: float | None = None  # its last load (build + warm-up)


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Body):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Body):
    prompt: str


class HealthResponse(_Body):
    status: str


class VersionResponse(_Body):
    version: str
