"""Every request cap in one place (tinyserve/request_limits.py): each field has its `serve` flag with the
field's default, the flags reach the server's config, and the engine checks a request against its own."""

import dataclasses

import pytest

from tinyserve.cli import build_parser, server_config_from_args
from tinyserve.request_limits import RequestLimits
from tinyserve.types import InvalidRequest, SamplingParams, StructuredOutput


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_every_limit_has_a_flag_whose_default_is_the_field_s():
    args = _serve_args()
    fields = dataclasses.fields(RequestLimits)
    assert len(fields) >= 14
    for f in fields:
        assert hasattr(args, f.name), f"--{f.name.replace('_', '-')} is missing"
        assert getattr(args, f.name) == f.default, f.name
    assert server_config_from_args(args).limits == RequestLimits()


def test_each_flag_reaches_the_server_config():
    values = {f.name: (2.5 if f.type == "float" else 3) for f in dataclasses.fields(RequestLimits)}
    values["max_body_bytes"] = 2048
    argv = [item for name, value in values.items() for item in ("--" + name.replace("_", "-"), str(value))]
    assert dataclasses.asdict(server_config_from_args(_serve_args(*argv)).limits) == values


@pytest.mark.parametrize("field, params, message", [
    ("max_stop_strings", SamplingParams(stop=("a", "b", "c")), "stop must have at most 2 strings, got 3"),
    ("max_stop_string_chars", SamplingParams(stop=("abc",)), "stop strings must be at most 2 characters long"),
    ("max_stop_token_ids", SamplingParams(stop_token_ids=(1, 2, 3)), "stop_token_ids must have at most 2 ids, got 3"),
    ("max_logit_bias", SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}), "logit_bias must have at most 2 entries"),
    ("max_logprobs", SamplingParams(logprobs=3), "logprobs must be in [0, 2], got 3"),
    ("max_logprobs", SamplingParams(prompt_logprobs=3), "prompt_logprobs must be in [0, 2], got 3"),
    ("max_structured_output_chars", SamplingParams(structured_output=StructuredOutput("regex", "abc")),
     "the regex must be at most 2 characters, got 3"),
])
def test_check_sampling_refuses_one_past_each_cap_and_admits_the_cap(field, params, message):
    with pytest.raises(InvalidRequest) as exc:
        RequestLimits(**{field: 2}).check_sampling(params)
    assert exc.value.message.startswith(message)
    RequestLimits(**{field: 3}).check_sampling(params)  # at the cap: admitted


def test_limits_are_validated():
    for field, bad in (("max_body_bytes", 1023), ("max_stop_strings", 0), ("max_logprobs", -1), ("max_n", 0),
                       ("max_request_timeout", float("nan")), ("max_messages", None)):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            RequestLimits(**{field: bad})
    assert RequestLimits(max_logprobs=0, max_n=None).max_logprobs == 0
