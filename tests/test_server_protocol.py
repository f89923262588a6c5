"""The server's pure parts, without a model: request parsing and SamplingParams mapping, error bodies,
logprob formats, Prometheus metrics from plain outputs, and the bucket helper."""

import pytest
from pydantic import ValidationError

from tinyserve.server.errors import BadRequest, bad_request_from_validation
from tinyserve.server.openai_api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from tinyserve.server.observability.metrics import ServerMetrics, _token_buckets
from tinyserve.server.openai_api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, refuse_unknown_fields, unknown_fields)
from tinyserve.request_limits import RequestLimits
from tinyserve.types import FinishReason, RequestMetrics, RequestOutput, TokenLogprob, Usage

MAX_CACHE_SALT_CHARS, MAX_PRIORITY = RequestLimits.max_cache_salt_chars, RequestLimits.max_priority
MAX_REQUEST_TIMEOUT_S = RequestLimits.max_request_timeout


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_completion_prompt_forms_are_normalised():
    assert CompletionRequest.model_validate({"prompt": "a"}).prompt == ["a"]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompt == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]
    for bad in (5, [], [1, "a"], [[1], "a"], [True]):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": bad})


def test_sampling_params_mapping():
    params = CompletionRequest.model_validate({
        "prompt": "x", "max_tokens": 7, "temperature": 0, "top_k": -1, "stop": "\n", "logprobs": 2, "seed": 3,
        "logit_bias": {"42": -100}, "ignore_eos": True, "min_tokens": 2, "n": 2, "repetition_penalty": 1.1,
    }).to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (7, 0.0, None, ("\n",))
    assert (params.logprobs, params.seed, params.logit_bias, params.n) == (2, 3, {42: -100.0}, 2)
    assert params.ignore_eos and params.min_tokens == 2 and params.repetition_penalty == 1.1
    defaults = CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params()
    assert defaults.max_tokens == 16 and defaults.temperature == 1.0 and defaults.logprobs is None


def test_chat_mapping_and_renamed_params():
    assert _chat().to_sampling_params().max_tokens is None  # up to the context, as OpenAI
    assert _chat(max_tokens=5, max_completion_tokens=9).to_sampling_params().max_tokens == 9
    assert _chat(logprobs=True).to_sampling_params().logprobs == 0
    assert _chat(logprobs=True, top_logprobs=4).to_sampling_params().logprobs == 4
    with pytest.raises(BadRequest) as exc:
        _chat(logprobs=True, top_logprobs=21).to_sampling_params()
    assert exc.value.param == "top_logprobs" and exc.value.message.startswith("top_logprobs must be in [0, 20]")
    with pytest.raises(BadRequest) as exc:
        _chat(max_completion_tokens=0).to_sampling_params()
    assert exc.value.param == "max_completion_tokens"


def test_chat_messages_content_parts_and_roles():
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]})
    assert [m.as_template_message() for m in request.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


def test_validation_errors_name_the_field():
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}, {"role": "bot"}]})
    error = bad_request_from_validation(exc.value)
    assert error.param == "messages[1].role" and error.status == 400
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate_json(b'{"prompt": "x", "temperature": "0.5"}')
    assert bad_request_from_validation(exc.value).param == "temperature"  # strict: no string numbers
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate_json(b"{")
    assert bad_request_from_validation(exc.value).code == "invalid_json"
    assert BadRequest("m", "p").body() == {"error": {"message": "m", "type": "invalid_request_error",
                                                     "param": "p", "code": "invalid_value"}}


def _error(model, body: dict, context: dict | None = None) -> BadRequest:
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body, context=context)
    return bad_request_from_validation(exc.value)


def test_size_caps_come_from_the_validation_context():
    limits = {"limits": RequestLimits(max_prompts_per_request=2, max_messages=3)}
    error = _error(CompletionRequest, {"prompt": ["a", "b", "c"]}, limits)
    assert error.param == "prompt" and error.message == ("prompt: must hold at most 2 prompts, got 3 (the server's "
                                                         "--max-prompts-per-request)")
    assert _error(CompletionRequest, {"prompt": [[1], [2], [3]]}, limits).param == "prompt"
    assert CompletionRequest.model_validate({"prompt": list(range(100))}, context=limits).prompt == [list(range(100))]
    assert len(CompletionRequest.model_validate({"prompt": ["a"] * 64}).prompt) == 64  # no context: the defaults
    assert _error(CompletionRequest, {"prompt": ["a"] * 65}).param == "prompt"
    wizards = {"messages": [{"role": "wizard"}] * 10}  # the count is checked before any message is
    for model in (ChatCompletionRequest, TokenizeRequest):
        error = _error(model, wizards, limits)
        assert error.param == "messages" and error.message.startswith("messages: must hold at most 3 messages, got 10")
    assert _error(ChatCompletionRequest, wizards).param == "messages[0].role"
    assert _error(DetokenizeRequest, {"tokens": [0] * 1_000_001}).param == "tokens"


def test_priority_timeout_and_cache_salt_bounds():
    for priority in (MAX_PRIORITY, -MAX_PRIORITY, 0):
        assert CompletionRequest.model_validate({"prompt": "x", "priority": priority}).priority == priority
    for priority in (MAX_PRIORITY + 1, -MAX_PRIORITY - 1, -(10**18)):
        error = _error(CompletionRequest, {"prompt": "x", "priority": priority})
        assert error.param == "priority" and error.message.startswith("priority: must be in [-1000, 1000]")
    for timeout in (0.001, 2.5, MAX_REQUEST_TIMEOUT_S):
        assert _chat(timeout=timeout).timeout == timeout
    for timeout in (0, -1, MAX_REQUEST_TIMEOUT_S * 2, float("nan"), float("inf"), "soon"):
        assert _error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "timeout": timeout}
                      ).param == "timeout"
    assert _chat(cache_salt="t" * MAX_CACHE_SALT_CHARS).cache_salt == "t" * MAX_CACHE_SALT_CHARS
    for salt in ("", "t" * (MAX_CACHE_SALT_CHARS + 1), 7):
        assert _error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "cache_salt": salt}
                      ).param == "cache_salt"


def test_engine_caps_are_named_by_their_field():
    huge_bias = {f"k{i}": 1.0 for i in range(1025)}  # counted before a single key is converted
    cases = [({"logit_bias": huge_bias}, "logit_bias", "at most 1024"), ({"stop": ["s"] * 17}, "stop", "at most 16"),
             ({"stop": ["s" * 257]}, "stop", "256"), ({"stop_token_ids": list(range(65))}, "stop_token_ids", "64"),
             ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0")]
    for fields, param, fragment in cases:
        with pytest.raises(BadRequest) as exc:
            CompletionRequest.model_validate({"prompt": "x", **fields}).to_sampling_params()
        assert exc.value.param == param and exc.value.message.startswith(param) and fragment in exc.value.message


def test_unknown_fields_are_named_where_they_are():
    body = CompletionRequest.model_validate({"prompt": "x", "foo": 1, "stream_options": {"include_usage": True, "x": 2}})
    assert sorted(unknown_fields(body)) == ["foo", "stream_options.x"]
    chat = _chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b", "y": 3}])
    assert unknown_fields(chat) == ["messages[1].y"]
    with pytest.raises(BadRequest) as exc:
        refuse_unknown_fields(chat, {"allow_unknown_fields": False})
    assert (exc.value.param, exc.value.code) == ("messages[1].y", "unknown_parameter")
    refuse_unknown_fields(chat, {"allow_unknown_fields": True})
    assert unknown_fields(_chat(user="u", store=False, metadata={"a": "b"})) == []


def test_echo_and_prompt_logprobs_mapping():
    def params(**fields):
        return CompletionRequest.model_validate({"prompt": "x", **fields}).to_sampling_params()

    assert params(prompt_logprobs=2).prompt_logprobs == 2 and params().prompt_logprobs is None
    assert params(echo=True).prompt_logprobs is None  # the prompt's text only: nothing to score
    assert params(echo=True, logprobs=3).prompt_logprobs == 3
    assert params(echo=True, logprobs=1, prompt_logprobs=4).prompt_logprobs == 4
    scoring = params(echo=True, max_tokens=0)
    assert (scoring.max_tokens, scoring.prompt_logprobs) == (0, 0)
    with pytest.raises(BadRequest) as exc:
        params(max_tokens=0)
    assert exc.value.param == "max_tokens"
    assert _chat(include_stop_str_in_output=True).to_sampling_params().include_stop_str_in_output
    assert _chat(max_tokens=0, prompt_logprobs=1).to_sampling_params().max_tokens == 0
    named = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "name": "ann"}]})
    assert named.messages[0].as_template_message() == {"role": "user", "content": "x", "name": "ann"}


class _FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return {1: "Hel", 2: "lo", 3: " wörld"}[ids[0]]

    def token_bytes(self, token_id):
        return self.decode([token_id]).encode()


def test_logprob_formats():
    texts = TokenTexts(_FakeTokenizer())
    lps = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.0))), TokenLogprob(3, float("-inf"), ())]
    legacy = completion_logprobs(texts, lps, text_offset=4).dump()
    assert legacy == {"tokens": ["Hel", " wörld"], "token_logprobs": [-0.5, -9999.0],
                      "top_logprobs": [{"Hel": -0.5, "lo": -1.0}, {}], "text_offset": [4, 7]}
    chat = chat_logprobs(texts, lps).dump()["content"]
    assert chat[0]["top_logprobs"][1] == {"token": "lo", "logprob": -1.0, "bytes": [108, 111]}
    assert bytes(chat[1]["bytes"]).decode() == " wörld"


def test_metrics_from_outputs():
    metrics = ServerMetrics("m", 2048, lambda: None)
    timing = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=12.0)
    metrics.on_step([RequestOutput("r", 0, "a", [5])], now=11.0)
    metrics.on_step([RequestOutput("r", 0, "b", [6], FinishReason.LENGTH, Usage(3, 2), metrics=timing)], now=11.25)
    value = metrics.registry.get_sample_value
    assert value("tinyserve:generation_tokens_total", {"model_name": "m"}) == 2
    assert value("tinyserve:prompt_tokens_total", {"model_name": "m"}) == 3
    labels = {"model_name": "m", "api": "http"}  # an untracked request came in by HTTP
    assert value("tinyserve:request_success_total", {**labels, "finished_reason": "length"}) == 1
    assert value("tinyserve:inter_token_latency_seconds_sum", labels) == 0.25
    assert value("tinyserve:time_to_first_token_seconds_sum", labels) == 1.0
    assert value("tinyserve:request_queue_time_seconds_sum", labels) == 0.5
    assert value("tinyserve:e2e_request_latency_seconds_sum", labels) == 2.0
    assert b"num_requests_running" not in metrics.render()  # no engine stats yet (loading)


def test_metrics_count_a_tracked_request_under_its_api_until_its_last_sample():
    metrics = ServerMetrics("m", 2048, lambda: None)
    metrics.track_api("g", 2, "grpc")
    timing = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=12.0)
    metrics.on_step([RequestOutput("g", 0, "a", [5], FinishReason.LENGTH, Usage(3, 1), metrics=timing),
                     RequestOutput("h", 0, "a", [5], FinishReason.STOP, Usage(3, 1), metrics=timing)], now=12.0)
    assert metrics._api_of == {"g": ["grpc", 1]}  # one sample still to finish
    metrics.on_step([RequestOutput("g", 1, "b", [6], FinishReason.ABORT, Usage(3, 1), metrics=timing)], now=12.5)
    assert metrics._api_of == {}
    value = metrics.registry.get_sample_value
    grpc, http = {"model_name": "m", "api": "grpc"}, {"model_name": "m", "api": "http"}
    assert value("tinyserve:request_success_total", {**grpc, "finished_reason": "length"}) == 1
    assert value("tinyserve:request_success_total", {**grpc, "finished_reason": "abort"}) == 1
    assert value("tinyserve:request_success_total", {**http, "finished_reason": "stop"}) == 1
    assert value("tinyserve:time_to_first_token_seconds_count", grpc) == 2
    assert value("tinyserve:time_to_first_token_seconds_count", http) == 1


def test_token_buckets():
    assert _token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
