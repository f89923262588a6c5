"""The fields the routers in front of replicas (vllm-router, sglang-router: docs/REPLICAS.md) add to every
request they forward, with the values they send. Each is honoured as far as it applies here: a value that
asks for something this server does not do is refused with a 400 naming the field, as in protocol.py.

Without these declared, a replica behind a router needed --allow-unknown-fields, which would also let a
client's misspelled field through unnoticed.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator


def _only_false(name: str, instead: str):
    def check(cls, value: bool) -> bool:
        if value:
            raise ValueError(f"only false is supported: {instead}")
        return value

    return field_validator(name)(classmethod(check))


class RouterFields(BaseModel):
    """Both endpoints (SGLang's names)."""

    model_config = ConfigDict(strict=True, extra="allow")  # protocol._Strict's: unknown fields are named there

    no_stop_trim: bool = False  # SGLang: keep the matched stop string in the text
    return_hidden_states: bool = False  # SGLang: the final hidden states in the response

    _no_stop_trim = _only_false("no_stop_trim", "send include_stop_str_in_output: true to keep the stop string")
    _hidden = _only_false("return_hidden_states", "this server returns no hidden states")


class RouterChatFields(BaseModel):
    """Chat only: continuing the last assistant message (vLLM's), and reasoning output (SGLang's, vLLM's).
    The reasoning fields are no-ops at either value: they act through a reasoning parser, which this server
    does not have (nor do vLLM and SGLang without --reasoning-parser), so a model's thinking stays in
    `content` as it wrote it."""

    model_config = ConfigDict(strict=True, extra="allow")

    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    _continue = _only_false("continue_final_message",
                            "the reply always starts a new assistant message (add_generation_prompt)")
