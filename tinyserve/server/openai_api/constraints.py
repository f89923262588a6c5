"""The structured-output fields of a request, as each family of clients spells them, -> one StructuredOutput.

- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}};
- vLLM: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"}, and its older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with `guided_decoding_backend`);
- llama.cpp: `grammar` (GBNF) and `json_schema`.

A request gives at most one of them (two are a 400 naming the second). Their text is compiled by the
engine (engine/sampling/structured_output.py); a compile error is a 400 naming the field the client used.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyserve.server.errors import BadRequest
from tinyserve.types import StructuredOutput

ANY_JSON_OBJECT = '{"type": "object"}'
# the backends a vLLM client may name: ours is llguidance (vLLM calls it "guidance")
BACKEND_NAMES = ("auto", "guidance", "llguidance")


class _Closed(BaseModel):
    """A nested object whose every key we honour: any other key is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Closed):
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # either way the output follows the schema: masks leave no other choice


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Closed):
    """vLLM's StructuredOutputsParams, the keys this server implements (exactly one of the five).
    `disable_any_whitespace` may only be true: the JSON is always written without free whitespace."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "grammar", "json_schema")


def structured_output_of(body: Any) -> tuple[StructuredOutput, str] | None:
    """The request's one structured output and the field it came from; None when it asks for none."""
    given = [(name, getattr(body, name)) for name in FIELDS if getattr(body, name, None) is not None]
    given = [(name, value) for name, value in given
             if not (isinstance(value, ResponseFormat) and value.type == "text")]
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend not in BACKEND_NAMES:
        raise BadRequest(f"guided_decoding_backend must be one of {', '.join(BACKEND_NAMES)} (this server "
                         f"decodes with llguidance), got {backend!r}", param="guided_decoding_backend")
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest(f"{given[1][0]}: give one structured-output field, not {given[0][0]} and "
                         f"{given[1][0]} together", param=given[1][0])
    name, value = given[0]
    spec = _spec(name, value)
    if name == "structured_outputs":  # errors name the key inside it
        name = f"structured_outputs.{_structured_outputs_key(value).rstrip('_')}"
    return spec, name


def _spec(name: str, value: Any) -> StructuredOutput:
    if name == "response_format":
        if value.type == "json_object":
            return StructuredOutput("json_schema", ANY_JSON_OBJECT)
        if value.json_schema is None:
            raise BadRequest("response_format.json_schema is required when type is 'json_schema'",
                             param="response_format")
        return StructuredOutput("json_schema", json.dumps(value.json_schema.schema_))
    if name == "structured_outputs":
        return _structured_outputs_spec(value)
    if name in ("guided_json", "json_schema"):
        return _json_schema_spec(value, name)
    if name == "guided_choice":
        return _choice_spec(value, name)
    kind = "regex" if name == "guided_regex" else "grammar"  # guided_grammar, grammar
    return _text_spec(kind, value, name)


def _structured_outputs_key(value: StructuredOutputsField) -> str:
    """Which of the five it gives (a 400 unless exactly one)."""
    given = [key for key in ("json_", "regex", "choice", "grammar", "json_object") if getattr(value, key) is not None]
    if value.json_object is False:
        given.remove("json_object")
    if len(given) != 1:
        names = ", ".join(k.rstrip("_") for k in given) or "none"
        raise BadRequest(f"structured_outputs: give exactly one of json, regex, choice, grammar and "
                         f"json_object, got {names}", param="structured_outputs")
    return given[0]


def _structured_outputs_spec(value: StructuredOutputsField) -> StructuredOutput:
    if value.disable_any_whitespace is False:
        raise BadRequest("structured_outputs.disable_any_whitespace: only true is supported (JSON is written "
                         "without free whitespace)", param="structured_outputs.disable_any_whitespace")
    key = _structured_outputs_key(value)
    param = f"structured_outputs.{key.rstrip('_')}"
    if key == "json_":
        return _json_schema_spec(value.json_, param)
    if key == "json_object":
        return StructuredOutput("json_schema", ANY_JSON_OBJECT)
    if key == "choice":
        return _choice_spec(value.choice, param)
    return _text_spec(key, getattr(value, key), param)


def _json_schema_spec(value: Any, param: str) -> StructuredOutput:
    try:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise BadRequest(f"{param}: a JSON schema must be a JSON object (or its JSON text)",
                                 param=param) from None
        if not isinstance(value, (dict, bool)):
            raise BadRequest(f"{param}: a JSON schema must be a JSON object", param=param)
        text = json.dumps(value)
    except RecursionError:  # JSON text nested past the parser's depth (gRPC's guided_json, or a string field)
        raise BadRequest(f"{param}: the JSON schema is nested too deeply", param=param,
                         code="invalid_grammar") from None
    return _text_spec("json_schema", text, param)


def _choice_spec(value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise BadRequest(f"{param}: must be a non-empty list of non-empty strings", param=param)
    return _text_spec("choice", json.dumps(value), param)


def _text_spec(kind: str, value: Any, param: str) -> StructuredOutput:
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{param}: must be a non-empty string", param=param)
    return StructuredOutput(kind, value)  # its size: RequestLimits, checked by the body (protocol._within_limits)
