"""Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on chat completions.

The model sees the tools through its chat template when the template renders them (it mentions `tools`);
otherwise through FALLBACK_PROMPT, a system block in the Hermes style that Qwen's and Hermes' templates
also use. Either way a call is written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and
that is what `parse_tool_calls` (whole text) and `ToolCallStream` (deltas) turn into OpenAI `tool_calls`.
- `auto`: the model decides; its text is parsed.
- `required` / a named function: the output is constrained by a grammar (engine/sampling/structured_output.py) to
  one call (or, with parallel_tool_calls, one or more) whose arguments validate against the function's
  parameter schema, so even a small model answers with a parseable call.
- `none`: the tools are neither shown nor parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyserve.engine.sampling.structured_output import closed_objects, each_subschema
from tinyserve.server.errors import BadRequest
from tinyserve.types import StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
FALLBACK_PROMPT = (
    "You can call these functions, each given by its name, description and JSON schema of parameters:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one line per call and nothing else:\n"
    '<tool_call>{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}</tool_call>'
)
# the layout of a call's JSON, as engine/sampling/structured_output.py writes JSON
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDefinition(_Closed):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always follow the schema; auto calls are parsed as written


class ToolDefinition(_Closed):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Closed):
    name: str


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Closed):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Closed):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields mean for its prompt, its grammar and its output."""

    tools: list[ToolDefinition]
    choice: str  # "auto" | "required" | "named"
    forced_name: str | None
    parallel: bool

    @classmethod
    def of(cls, tools: list[ToolDefinition] | None, tool_choice: Any, parallel: bool) -> ToolPlan | None:
        """None when the tools play no part (none given, or tool_choice "none")."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise BadRequest("tool_choice needs tools", param="tool_choice")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise BadRequest("tools: function names must be unique", param="tools")
        if tool_choice == "none":
            return None
        if tool_choice in (None, "auto", "required"):
            return cls(tools, tool_choice or "auto", None, parallel)
        if isinstance(tool_choice, NamedToolChoice):
            if tool_choice.function.name not in names:
                raise BadRequest(f"tool_choice names {tool_choice.function.name!r}, which is not among the tools",
                                 param="tool_choice")
            return cls(tools, "named", tool_choice.function.name, False)
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}", param="tool_choice")

    @property
    def is_forced(self) -> bool:
        return self.choice != "auto"

    def structured_output(self) -> StructuredOutput | None:
        """For required / named: a Lark grammar of calls, each call's JSON checked by its schema."""
        if not self.is_forced:
            return None
        tools = [t for t in self.tools if self.forced_name in (None, t.function.name)]
        rules = [f"call_{i}: %json {json.dumps(_call_schema(t.function))}" for i, t in enumerate(tools)]
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        repeat = ' ("\\n" call)*' if self.parallel else ""
        grammar = "\n".join([f"start: call{repeat}", f"call: {json.dumps(CALL_OPEN)} ({calls}) {json.dumps(CALL_CLOSE)}",
                             *rules])
        return StructuredOutput("grammar", grammar)  # its size: protocol's _within_limits

    def template_kwargs(self) -> dict:
        return {"tools": [t.model_dump(exclude_none=True) for t in self.tools]}

    def with_fallback_prompt(self, messages: list[dict]) -> list[dict]:
        """For a template that does not render tools: the tools and how to call them, as a system block
        (appended to the conversation's system message, or one of its own)."""
        listed = "\n".join(json.dumps(t.function.model_dump(exclude_none=True, exclude={"strict"}))
                           for t in self.tools)
        text = FALLBACK_PROMPT.format(tools=listed)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        content, calls = parse_tool_calls(text, {t.function.name for t in self.tools})
        return content, calls if self.parallel else calls[:1]


def _call_schema(function: FunctionDefinition) -> dict:
    parameters = closed_objects(function.parameters or {"type": "object", "properties": {}})
    parameters = _refs_under(parameters, _ARGUMENTS_POINTER)
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _JSON_LAYOUT}


_ARGUMENTS_POINTER = "#/properties/arguments"  # where the parameters schema sits in a call's schema


def _refs_under(schema: Any, pointer: str) -> Any:
    """The schema with each local `$ref` ("#", "#/$defs/x": pointers into the parameters schema, as clients write
    them) pointing below `pointer`, where the call's schema holds it. Other refs stay as they are."""
    def rebased(out: dict) -> dict:
        ref = out.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = pointer + ref[1:]
        return out

    return each_subschema(schema, rebased)


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """(the text outside the calls, or None when nothing is left; the calls). A block that is not a JSON
    object naming one of the tools stays in the text, as the model wrote it."""
    calls, kept, end = [], [], 0
    for match in _CALL.finditer(text):
        call = _parse_call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        calls.append(call)
    kept.append(text[end:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


def _parse_call(body: str, names: set[str]) -> ParsedCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Streaming: content passes through until a call may be starting; from there the text is held until
    the call closes (then it is emitted whole, as one delta) or the output ends (then it is content)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._held = ""
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content to send now, calls completed by this text). Whitespace alone is held too: between and
        after calls it is layout, not content."""
        content, calls = self._split(text)
        if not content.strip():
            self._held = content + self._held
            return "", calls
        return content, calls

    def _split(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._held += text
        content, calls = "", []
        while True:
            start = self._held.find(CALL_OPEN)
            if start < 0:
                keep = _partial_open_length(self._held)  # "<tool" may be the start of a call
                content += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                return content, calls
            end = self._held.find(CALL_CLOSE, start)
            if end < 0:
                content += self._held[:start]
                self._held = self._held[start:]
                return content, calls
            content += self._held[:start]
            block = self._held[start : end + len(CALL_CLOSE)]
            _, found = parse_tool_calls(block, {t.function.name for t in self.plan.tools})
            if not found:
                content += block  # not a call of ours: the model's text
            elif self.plan.parallel or self.num_calls == 0:  # else a second call where one was asked: dropped
                calls += found
                self.num_calls += len(found)
            self._held = self._held[end + len(CALL_CLOSE):]

    def finish(self) -> str:
        """What is still held, as content (an unfinished call, or a prefix of one; not bare whitespace)."""
        held, self._held = self._held, ""
        return held if held.strip() else ""


def _partial_open_length(text: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of CALL_OPEN."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
