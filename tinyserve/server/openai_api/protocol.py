"""OpenAI request bodies as pydantic models, and their translation into SamplingParams.

Decisions (the malformed-input tests assert them):
- Types are strict: "0.5" is not a number, true is not an integer, 1.0 is not an integer.
- No field is accepted in silence: every field a model here declares is honoured, or accepted as a no-op
  only where doing nothing is its meaning here (each says why: `user`, `metadata`, ...), or refused with a
  400 naming it for the values we cannot honour (`store: true`, `suffix`, `best_of` != n, `functions`,
  non-text content parts). A field no model declares (nested ones included: `stream_options.x`,
  `messages[0].x`) is a 400 naming it with code `unknown_parameter`, unless the server runs with
  --allow-unknown-fields (ServerConfig.allow_unknown_fields), for clients that send other servers' extras.
  Structured-output fields: server/openai_api/constraints.py; tools: server/openai_api/tools.py; the fields routers add:
  server/intake/router_fields.py.
- Sampling fields a body leaves out (absent or null) get the server's defaults (`with_defaults`).
- Ranges are checked by SamplingParams (one source of truth) and reported as 400 with `param` set.
- Sizes are capped before any per-item work: prompts per completion and messages per chat come from the
  server's RequestLimits (tinyserve/request_limits.py), passed as the validation context (`limits_context`),
  and are checked before pydantic validates the items; so are priority, timeout, cache_salt and
  /detokenize's tokens. A body keeps its limits (`limits`) for the sampling caps of `sampling_params`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tinyserve.config import SamplingDefaults, ServerConfig
from tinyserve.server.openai_api.constraints import ResponseFormat, StructuredOutputsField, structured_output_of
from tinyserve.server.errors import BadRequest
from tinyserve.server.intake.router_fields import RouterChatFields, RouterFields
from tinyserve.server.openai_api.tools import NamedToolChoice, ToolCall, ToolDefinition, ToolPlan
from tinyserve.request_limits import RequestLimits
from tinyserve.types import InvalidRequest, SamplingParams, StructuredOutput

DEFAULT_LIMITS = RequestLimits()


def limits_context(config: ServerConfig) -> dict[str, Any]:
    """The validation context that carries the server's request-size caps (and whether unknown fields are
    ignored) to the validators below and to refuse_unknown_fields."""
    return {"limits": config.limits, "allow_unknown_fields": config.allow_unknown_fields}


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Every field of a validated body, and of the models nested in it, that no model declares, named as
    the client wrote it ('stream_options.foo', 'messages[2].foo'). Extra fields are kept (extra="allow")
    so that they can be named here."""
    names = [prefix + name for name in body.model_extra or {}]
    for name in body.model_fields_set:
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            names += unknown_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    names += unknown_fields(item, f"{prefix}{name}[{i}].")
    return names


def refuse_unknown_fields(body: BaseModel, context: dict[str, Any] | None) -> None:
    """400 naming the first unknown field, unless the server ignores them (allow_unknown_fields)."""
    if (context or {}).get("allow_unknown_fields"):
        return
    unknown = unknown_fields(body)
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field; this server does not implement it (a server started "
                         "with --allow-unknown-fields ignores such fields)", param=unknown[0], code="unknown_parameter")


def entry_caps(model: type[BaseModel], context: dict[str, Any] | None) -> dict[str, int]:
    """The most entries each top-level list (or object) field of `model` may hold, for a guard that counts
    them before a large body becomes Python objects (intake.refuse_long_lists). The validators below and
    SamplingParams stay the checks of record; this only makes the refusal cheap."""
    limits = limits_of(context)
    caps = {"messages": limits.max_messages, "stop": limits.max_stop_strings,
            "stop_token_ids": limits.max_stop_token_ids, "logit_bias": limits.max_logit_bias}
    return {name: cap for name, cap in caps.items() if name in model.model_fields}


def limits_of(context: dict[str, Any] | None) -> RequestLimits:
    """The limits a validation context carries (the defaults without one: a body built in a test)."""
    return (context or {}).get("limits", DEFAULT_LIMITS)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # kept to be named: refuse_unknown_fields
    _limits: RequestLimits = PrivateAttr(default=DEFAULT_LIMITS)

    @model_validator(mode="after")
    def _keep_limits(self, info: ValidationInfo) -> _Strict:
        self._limits = limits_of(info.context)
        return self


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the whole request's usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far
    # OpenAI pads chunks with an `obfuscation` field against length side channels; clients discard it,
    # so sending none is what a client asking either way gets in effect: a no-op
    include_obfuscation: bool = True


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's common extras)."""

    model: str | None = None  # optional here: curl users may leave it out; the served model is used
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM clients send -1 (or 0) for "no top-k"
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str]
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs and top k
    priority: int = 0  # lower runs first
    timeout: float | None = None  # seconds from arrival, capped by the server's (server/state.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the provider's abuse monitoring; none here: a no-op
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks (tenants)
    # structured output, as each family of clients spells it (server/openai_api/constraints.py): at most one
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None
    grammar: Any = None
    json_schema: Any = None

    @field_validator("priority")
    @classmethod
    def _priority(cls, value: int, info: ValidationInfo) -> int:
        cap = limits_of(info.context).max_priority
        if not -cap <= value <= cap:
            raise ValueError(f"must be in [{-cap}, {cap}], got {value}")
        return value

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, value: float | None, info: ValidationInfo) -> float | None:
        cap = limits_of(info.context).max_request_timeout
        if value is not None and not 0 < value <= cap:  # NaN fails this too
            raise ValueError(f"must be in (0, {cap:g}] seconds, got {value}")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, value: str | None, info: ValidationInfo) -> str | None:
        cap = limits_of(info.context).max_cache_salt_chars
        if value is not None and not 1 <= len(value) <= cap:
            raise ValueError(f"must be a non-empty string of at most {cap} characters")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The structured output asked for, and the field that asked (the param of its compile errors)."""
        return self._within_limits(structured_output_of(self))

    def _within_limits(self, found: tuple[StructuredOutput, str] | None) -> tuple[StructuredOutput, str] | None:
        """A 400 naming the field whose grammar text is over --max-structured-output-chars, before it is
        compiled (a forced tool call's grammar, built from every tool's schema: invalid_grammar on `tools`)."""
        cap = self._limits.max_structured_output_chars
        if found is None or len(found[0].spec) <= cap:
            return found
        structured, param = found
        message = f"the {structured.kind} must be at most {cap} characters, got {len(structured.spec)}"
        if param == "tools":
            raise BadRequest(f"tools: the forced call's grammar is too large ({message})", param="tools",
                             code="invalid_grammar")
        raise BadRequest(f"{param}: {message}", param=param)

    def structured_output_param(self) -> str | None:
        structured = self.structured_output()
        return structured and structured[1]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, renames: dict[str, str],
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """Raises BadRequest naming the field (as the client spelled it, via `renames`)."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they come whole, in the response
            raise BadRequest("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        cap = self._limits.max_logit_bias
        if len(self.logit_bias or ()) > cap:  # before converting every key
            raise BadRequest(f"logit_bias must have at most {cap} entries, got {len(self.logit_bias)}",
                             param="logit_bias")
        try:
            logit_bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise BadRequest("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
        optional = {  # left out when absent, so SamplingParams' defaults apply
            "temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        fields = {k: v for k, v in optional.items() if v is not None}
        fields.update(
            n=self.n, top_k=None if self.top_k in (-1, 0) else self.top_k, logit_bias=logit_bias or None,
            seed=self.seed, stop=tuple(self.stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, prompt_logprobs=self.engine_prompt_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output, structured_output=structured,
        )
        try:
            params = SamplingParams(max_tokens=max_tokens, **fields)
            self._limits.check_sampling(params)
            return params
        except InvalidRequest as exc:  # its message starts with the field's name: the client's spelling
            param = renames.get(exc.param, exc.param)
            message = exc.message.replace(exc.param, param, 1) if exc.param else exc.message
            raise BadRequest(message, param=param, code=exc.code) from None

    def engine_prompt_logprobs(self) -> int | None:
        """The top k of the prompt logprobs the engine computes (None: none): those asked for."""
        return self.prompt_logprobs

    def with_defaults(self, params: SamplingParams, defaults: SamplingDefaults) -> SamplingParams:
        """`params` with the server's default for each sampling field this body left out (absent or null; a
        top_k of -1 or 0 is given: it asks for no cut). An explicit field always wins."""
        missing = {name: value for name, value in defaults.as_fields().items() if getattr(self, name) is None}
        return dataclasses.replace(params, **missing) if missing else params


class CompletionRequest(_SamplingFields, RouterFields):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 with echo: score the prompt, generate nothing (lm-eval's loglikelihood)
    logprobs: int | None = None
    echo: bool = False  # the prompt's text (and with logprobs its tokens' logprobs) before the completion's
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any, info: ValidationInfo) -> list[str] | list[list[int]]:
        """Normalised to a list of prompts, each a string or a list of token ids."""
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        limit = limits_of(info.context).max_prompts_per_request
        is_batch = isinstance(value, list) and value and isinstance(value[0], (str, list))
        if is_batch and len(value) > limit:  # before looking at each prompt
            raise ValueError(f"must hold at most {limit} prompts, got {len(value)} (the server's "
                             "--max-prompts-per-request)")
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return value
        if is_ids(value) and value:
            return [value]
        if isinstance(value, list) and value and all(is_ids(p) for p in value):
            return value
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")

    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs reports the prompt tokens' logprobs too, and echo with max_tokens 0 only them."""
        if not self.echo or (self.logprobs is None and self.max_tokens != 0):
            return self.prompt_logprobs
        return max(self.prompt_logprobs or 0, self.logprobs or 0)

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(f"best_of must equal n ({self.n}) or be left out, got {self.best_of}", param="best_of")
        structured = self.structured_output()
        return self.sampling_params(self.max_tokens, self.logprobs, {}, structured and structured[0])


class ChatMessageParam(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | list[TextPart] | None (assistant only)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"part {i} is of type {kind!r}; only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i} needs a string 'text'")
                unknown = sorted(set(part) - {"type", "text"})
                if unknown and not (info.context or {}).get("allow_unknown_fields"):
                    raise PydanticCustomError("unknown_parameter", "part {i} has the unknown field '{name}'",
                                              {"i": i, "name": unknown[0]})
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("must be a string or a list of text parts")

    def as_template_message(self, native_tools: bool = False) -> dict:
        """The message as the chat template reads it. Tool calls and results go to a template that renders
        tools (`native_tools`) as Hugging Face's tool-use format has them (arguments as objects); to one
        that does not, as text in the format of tools.FALLBACK_PROMPT."""
        role = "system" if self.role == "developer" else self.role
        content = self.content or ""
        if self.role == "tool":
            if native_tools:
                return {"role": "tool", "content": content, "tool_call_id": self.tool_call_id}
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        if self.tool_calls:
            if native_tools:
                calls = [{"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                         for c in self.tool_calls]
                return {"role": role, "content": content, "tool_calls": calls}
            written = [f'<tool_call>{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}'
                       "</tool_call>" for c in self.tool_calls]
            return {"role": role, "content": "\n".join(([content] if content else []) + written)}
        message = {"role": role, "content": content}
        if self.name is not None:  # the participant's name, for the templates that render it
            message["name"] = self.name
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _at_most_max_messages(value: Any, info: ValidationInfo) -> Any:
    """Runs before the messages are validated one by one: 100,000 of them are refused without that work."""
    limit = limits_of(info.context).max_messages
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"must hold at most {limit} messages, got {len(value)} (the server's --max-messages)")
    return value


class _ChatBookkeepingFields(_Strict):
    """OpenAI chat fields about the provider's records, not the completion: honoured as far as they apply
    to a server that keeps no records and has one tier; the values that ask for more are refused."""

    store: bool | None = None  # OpenAI keeps the completion for its dashboards; we keep nothing (false only)
    metadata: dict[str, str] | None = None  # tags for stored completions: none are stored, a no-op
    service_tier: str | None = None  # one tier here: "auto" and "default" are it; others are refused
    safety_identifier: str | None = None  # as `user`: an id for abuse monitoring; none here, a no-op
    prompt_cache_key: str | None = None  # a routing hint for OpenAI's prompt cache; one cache here, a no-op
    modalities: list[str] | None = None  # text is the only output: ["text"], or refused

    @field_validator("store")
    @classmethod
    def _store(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("this server stores no completions; only false is supported")
        return value

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise ValueError(f"this server has one tier; only 'auto' and 'default' are supported, got {value!r}")
        return value

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise ValueError(f"only ['text'] is supported, got {value!r}")
        return value


class ChatCompletionRequest(_SamplingFields, _ChatBookkeepingFields, RouterFields, RouterChatFields):
    messages: list[ChatMessageParam]
    max_tokens: int | None = None  # None: up to the model's context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    functions: list[Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any, info: ValidationInfo) -> Any:
        return _at_most_max_messages(value, info)

    def to_sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise BadRequest("messages: must contain at least one message", param="messages")
        for i, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise BadRequest(f"messages[{i}].content: required for role {message.role!r}",
                                 param=f"messages[{i}].content")
            if message.tool_calls is not None and message.role != "assistant":
                raise BadRequest(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                 param=f"messages[{i}].tool_calls")
            if (message.role == "tool") != (message.tool_call_id is not None):
                raise BadRequest(f"messages[{i}].tool_call_id: required for role 'tool' and only there",
                                 param=f"messages[{i}].tool_call_id")
        if self.functions:
            raise BadRequest("functions (the deprecated form of tools) is not supported; send tools",
                             param="functions", code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        use_completion = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if use_completion else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        renames = {"logprobs": "top_logprobs"}
        if use_completion:
            renames["max_tokens"] = "max_completion_tokens"
        structured = self.structured_output()
        return self.sampling_params(max_tokens, logprobs, renames, structured and structured[0])

    def tool_plan(self) -> ToolPlan | None:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """A forced tool call's grammar, or the structured-output field's (not both)."""
        plan = self.tool_plan()
        forced = plan.structured_output() if plan is not None else None
        asked = structured_output_of(self)
        if forced is not None and asked is not None:
            raise BadRequest(f"{asked[1]}: a structured output cannot be combined with tool_choice "
                             f"{self.tool_choice if isinstance(self.tool_choice, str) else 'naming a function'}",
                             param=asked[1])
        return self._within_limits((forced, "tools") if forced is not None else asked)



class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any, info: ValidationInfo) -> Any:
        return _at_most_max_messages(value, info)



class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens(cls, value: Any, info: ValidationInfo) -> Any:
        cap = limits_of(info.context).max_detokenize_tokens
        if isinstance(value, list) and len(value) > cap:
            raise ValueError(f"List should have at most {cap} items after validation, not {len(value)}")
        return value


class ModelAdminRequest(_Strict):
    """POST /admin/models/load and /unload: the model by its served name."""

    model: str = Field(min_length=1)


class ModelSwapRequest(_Strict):
    """POST /admin/models/swap: serve the weights at `path` (a GGUF file or an HF folder on the
    server's disk, or an alias) under the name `model`."""

    model: str = Field(min_length=1)
    path: str = Field(min_length=1)
