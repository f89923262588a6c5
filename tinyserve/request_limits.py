"""Every cap on what one request may ask for, in one place: each field's default is here and nowhere else,
each has a `tinyserve serve` flag of its name (cli.py builds them from these fields, help text included).

Who checks what: the server counts a body's lists against these before it builds them (intake's
refuse_long_lists, protocol's validators), and the engine checks every request it takes against its
config's limits (LLMEngine.validate, `check_sampling`), so an offline caller gets the same caps. Why caps at
all: the engine thread does work in proportion to the stop strings, the stop ids and the logit_bias entries
on every token, and a grammar's text is compiled before the request runs; one body must not choose that.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tinyserve.types import InvalidRequest, SamplingParams


def _cap(default: int | float | None, help: str, minimum: int = 1):
    return field(default=default, metadata={"help": help, "minimum": minimum})


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = _cap(4 << 20, "larger request bodies get 413", minimum=1024)
    max_prompts_per_request: int = _cap(64, "prompts in one completion request; more get 400")
    max_messages: int = _cap(1024, "messages in one chat request; more get 400")
    max_n: int | None = _cap(None, "the largest n (samples of each prompt) one request may ask for; more is a 400 "
                                   "(default: half of --max-num-seqs, so that one request cannot take every seat)")
    max_logprobs: int = _cap(20, "the most top logprobs per token a request may ask for (logprobs, top_logprobs, "
                                 "prompt_logprobs)", minimum=0)
    max_stop_strings: int = _cap(16, "stop strings in one request")
    max_stop_string_chars: int = _cap(256, "characters in one stop string")
    max_stop_token_ids: int = _cap(64, "stop_token_ids in one request")
    max_logit_bias: int = _cap(1024, "logit_bias entries in one request")
    max_structured_output_chars: int = _cap(256 * 1024, "characters of a request's JSON schema, regex, choice "
                                                        "list or grammar")
    max_cache_salt_chars: int = _cap(256, "characters of a request's cache_salt")
    max_priority: int = _cap(1000, "client priorities lie in [-N, N]; the server's own probes run just below")
    max_request_timeout: float = _cap(24 * 3600.0, "the largest `timeout` (seconds) a request may set; "
                                                   "--request-timeout caps it further")
    max_detokenize_tokens: int = _cap(1_000_000, "token ids in one /detokenize request")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, minimum = getattr(self, f.name), f.metadata["minimum"]
            if value is None and f.name == "max_n":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
                raise ValueError(f"{f.name} must be a number >= {minimum}, got {value!r}")

    def check_sampling(self, params: SamplingParams) -> None:
        """The caps on a request's sampling fields: InvalidRequest (a 400) naming the field and the cap."""
        if len(params.stop) > self.max_stop_strings:
            raise InvalidRequest(f"stop must have at most {self.max_stop_strings} strings, got {len(params.stop)}",
                                 param="stop")
        if max(map(len, params.stop), default=0) > self.max_stop_string_chars:
            raise InvalidRequest(f"stop strings must be at most {self.max_stop_string_chars} characters long",
                                 param="stop")
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequest(f"stop_token_ids must have at most {self.max_stop_token_ids} ids, "
                                 f"got {len(params.stop_token_ids)}", param="stop_token_ids")
        if len(params.logit_bias_ids) > self.max_logit_bias:
            raise InvalidRequest(f"logit_bias must have at most {self.max_logit_bias} entries, "
                                 f"got {len(params.logit_bias_ids)}", param="logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequest(f"{name} must be in [0, {self.max_logprobs}], got {value}", param=name)
        structured = params.structured_output
        if structured is not None and len(structured.spec) > self.max_structured_output_chars:
            raise InvalidRequest(f"the {structured.kind} must be at most {self.max_structured_output_chars} "
                                 f"characters, got {len(structured.spec)}", param="structured_output")
