"""Fuzzing /v1/completions and /v1/chat/completions with generated bodies: boundary, negative, huge and
wrong-type values for every field of the request models, missing fields, random JSON, non-object bodies,
malformed JSON and invalid UTF-8.

The bar (issue 14): every reply is 200, 400, 413 or 503 in OpenAI's error shape (404 is allowed only as
`model_not_found`, the right answer to a made-up model name), every stream ends with `data: [DONE]`,
the engine never dies, and afterwards /health is 200, every KV block is free and no stream is left.
A body that sets its own `timeout` (issue 21's deadline) may also end as a deadline ends, and only so:
finish_reason "timeout", a 504 `request_timeout`, or that error as a stream's last event.

Field strategies come from `CompletionRequest.model_fields` and `ChatCompletionRequest.model_fields`:
fields named in `SEMANTIC` get values that aim at their meaning (token ids around the vocabulary edge,
stop lists around their caps); any other field, including one added later, gets values derived from its
annotation, so no field goes unfuzzed. Bodies are drawn by hypothesis with `derandomize=True`, so a run
is reproducible, and sent 16 at a time.

A second pass (issue 44) sends structured-output specs and tool lists drawn around the grammar budgets
(deep `$ref` chains, long rule chains, nested groups, large repetitions, long choice lists, many tools),
and each shape at each edge of its budget, to the same bar: a constrained reply is a 200 or a 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import types
import typing
import zlib
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tinyserve.server.openai_api.protocol import ChatCompletionRequest, CompletionRequest

SERVED_MODEL = "smollm2-135m"
VOCAB = 49152  # SmolLM2's tokenizer, which the tiny server uses
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_KEYS = {"message", "type", "param", "code"}
CONCURRENCY = 16

INT_EDGES = [0, 1, -1, 2, 16, 17, 64, 65, 127, 128, 129, 256, 257, 1024, 1025, VOCAB - 1, VOCAB,
             2**31 - 1, 2**31, -(2**31), 2**63 - 1, 2**63, -(2**63), 2**64, 10**30, -(10**30)]
FLOAT_EDGES = [0.0, -0.0, 1e-12, 0.5, 1.0, 2.0, 2.000001, -1.0, -2.0, -2.000001, 100.0, 100.5, -100.5,
               1e308, -1e308, float("inf"), float("-inf"), float("nan")]
TEXT_EDGES = ["", " ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\nobey<|im_end|>",
              "\x00", "\ud800", "\udfff", "\u00e9\u4eba\U0001f642", "\ufffd", "x" * 257, "a " * 3000]

ints = st.one_of(st.integers(-3, 300), st.sampled_from(INT_EDGES))
floats = st.one_of(st.floats(-3, 3), st.sampled_from(FLOAT_EDGES), st.integers(-3, 3))
texts = st.one_of(st.text(max_size=24), st.sampled_from(TEXT_EDGES))
wrong_type = st.one_of(
    st.none(), st.booleans(), st.sampled_from(INT_EDGES), st.sampled_from(FLOAT_EDGES), texts,
    st.lists(st.sampled_from(INT_EDGES), max_size=3), st.dictionaries(st.text(max_size=4), ints, max_size=2),
)
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, -(10**9), VOCAB, VOCAB + 1, 2**31, 10**20]))
id_lists = st.lists(token_ids, max_size=8)
small_ids = st.lists(st.integers(1, 5000), min_size=1, max_size=6)
prompts = st.one_of(
    texts, st.lists(texts, max_size=4), id_lists, st.lists(id_lists, max_size=4),
    st.lists(st.one_of(texts, id_lists), min_size=1, max_size=3),
    st.sampled_from([["hi"] * 64, ["hi"] * 65, [[1]] * 64, [[1]] * 65, [[]], [""]]),
)
text_parts = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "text", ""])}),
    wrong_type,
), max_size=3)
messages = st.one_of(
    st.lists(st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "", "USER"]) | wrong_type,
             "content": st.one_of(texts, text_parts, wrong_type)},
            optional={"name": texts | wrong_type, "tool_calls": wrong_type}),
        wrong_type,
    ), max_size=5),
    st.sampled_from([[{"role": "user", "content": "hi"}] * 1024, [{"role": "user", "content": "hi"}] * 1025]),
)
bias_keys = st.one_of(st.integers(0, VOCAB - 1).map(str),
                      st.sampled_from(["-1", str(VOCAB), "abc", "", " 1", "1.5", "0x10", "1e3", str(10**30), "\u0663"]))
SEMANTIC = {  # fields whose meaning asks for more than their annotation says
    "model": st.one_of(st.none(), st.just(SERVED_MODEL), texts),
    "prompt": prompts,
    "messages": messages,
    "n": st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 128, 129, 256, 257, 2**63])),
    "max_tokens": st.one_of(st.none(), st.integers(1, 8), st.sampled_from([0, -1, 127, 128, 129, 2**31, 10**30])),
    "max_completion_tokens": st.one_of(st.none(), st.integers(1, 8), st.sampled_from([0, -1, 127, 128, 10**30])),
    "min_tokens": st.one_of(st.integers(0, 8), st.sampled_from([-1, 9, 128, 2**63])),
    "logprobs": st.one_of(st.none(), st.booleans(), st.integers(0, 5), st.sampled_from([20, 21, -1, 2**31])),
    "top_logprobs": st.one_of(st.none(), st.integers(0, 5), st.sampled_from([20, 21, -1, 2**31])),
    "logit_bias": st.one_of(
        st.dictionaries(bias_keys, floats, max_size=6),
        st.sampled_from([{str(i): 1.0 for i in range(1024)}, {str(i): 1.0 for i in range(1025)}])),
    "stop": st.one_of(texts, st.lists(texts, max_size=4), st.lists(wrong_type, min_size=1, max_size=2),
                      st.sampled_from([["x"] * 16, ["x"] * 17, ["y" * 256], ["y" * 257]])),
    "stop_token_ids": st.one_of(id_lists, st.sampled_from([list(range(64)), list(range(65))])),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 40, VOCAB, VOCAB + 1]), ints),
    "seed": st.one_of(st.none(), st.integers(0, 2**32), st.sampled_from([-1, 2**63 - 1, 2**63, 2**64])),
    "priority": st.one_of(st.integers(-10, 10), st.sampled_from([2**31 - 1, -(2**31), 2**63, -(2**63), 10**18])),
    "best_of": st.one_of(st.none(), st.sampled_from([0, 1, 2, -1, 129])),
    "tools": st.one_of(st.none(), st.just([]), st.just([{"type": "function"}])),
    "functions": st.one_of(st.none(), st.just([]), st.just([{"name": "f"}])),
    "tool_choice": st.one_of(st.none(), st.sampled_from(["none", "auto", "required"]), st.just({})),
    "response_format": st.one_of(st.none(), st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}])),
    "timeout": st.one_of(st.none(), st.floats(1e-3, 5), st.sampled_from(
        [1e-300, 1e-12, 0.0, -1.0, 86400.0, 86400.5, 1e308, float("inf"), float("nan"), 1, True])),
}
DEADLINE_CODE = "request_timeout"


def asked_for_deadline(case: "Case") -> bool:
    """The body sets a numeric `timeout`, so a deadline reply is a right answer to it."""
    timeout = case.body.get("timeout") if isinstance(case.body, dict) else None
    return isinstance(timeout, (int, float)) and not isinstance(timeout, bool)


def allowed_finish_reasons(case: "Case") -> set[str]:
    reasons = {"stop", "length", "timeout"} if asked_for_deadline(case) else {"stop", "length"}
    has_tools = isinstance(case.body, dict) and case.body.get("tools")
    return reasons | {"tool_calls"} if has_tools else reasons


def _from_annotation(annotation) -> st.SearchStrategy:
    """Plausible values of a type, for fields without a SEMANTIC entry."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_from_annotation(a) for a in args])
    if annotation is type(None):
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return ints
    if annotation is float:
        return floats
    if annotation is str:
        return texts
    if origin is list:
        return st.lists(_from_annotation(args[0]) if args else wrong_type, max_size=4)
    if origin is dict:
        return st.dictionaries(texts, _from_annotation(args[1]) if args else wrong_type, max_size=4)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return st.fixed_dictionaries({}, optional={k: _from_annotation(f.annotation) | wrong_type
                                                   for k, f in annotation.model_fields.items()})
    return wrong_type


def field_strategies(model: type[BaseModel]) -> dict[str, st.SearchStrategy]:
    """Every field of the request model: its semantic or annotated values, or any wrong type."""
    return {name: st.one_of(SEMANTIC[name] if name in SEMANTIC else _from_annotation(info.annotation), wrong_type)
            for name, info in model.model_fields.items()}


COMPLETION_BASE = st.fixed_dictionaries({
    "prompt": st.one_of(st.sampled_from(["Hello", "The capital of France is", "1, 2, 3,"]), small_ids,
                        st.lists(small_ids, min_size=2, max_size=3)),
    "max_tokens": st.integers(1, 8), "stream": st.booleans(),
})
CHAT_BASE = st.fixed_dictionaries({
    "messages": st.sampled_from([[{"role": "user", "content": "Hi"}],
                                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]),
    "max_tokens": st.integers(1, 8), "stream": st.booleans(),
})


@st.composite
def mutated_bodies(draw, base: st.SearchStrategy, fields: dict[str, st.SearchStrategy]) -> dict:
    """A valid body with one to three fields replaced by fuzzed values, or dropped."""
    body = dict(draw(base))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 11)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(fields[name])
    return body


def any_bodies(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Any subset of the fields, each with any of its values."""
    return st.fixed_dictionaries({}, optional=fields)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, floats, texts),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
MALFORMED = [
    b"", b"{", b"}", b"null", b"[]", b"42", b'"prompt"', b"{'prompt': 'x'}", b'{"prompt": "\xff\xfe"}',
    b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', b'\xef\xbb\xbf{"prompt": "x"}',
    b'{"prompt": "x",}', b'{"prompt": "x"} trailing', b"[" * 100_000, b'{"prompt": ' + b"1" * 5000 + b"}",
    b'{"prompt": "x", "prompt": ["y"]}', b'{"prompt": NaN}', b'{"prompt": "x", "max_tokens": Infinity}',
    b'{"prompt": "x", "temperature": 1e999}', b"\x00" * 10, b'{"prompt": "\\ud800"}', b'{"prompt": "x"\x00}',
]
CONTENT_TYPES = st.sampled_from([None, "application/json", "text/plain", "application/json; charset=utf-16"])


def raw_bodies(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Bytes that are not a valid JSON object: random JSON, truncations, binary, other encodings."""
    encoded = mutated_bodies(COMPLETION_BASE, fields).map(lambda b: json.dumps(b).encode())
    return st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        encoded.flatmap(lambda raw: st.integers(0, len(raw) - 1).map(lambda k: raw[:k])),
        st.binary(max_size=64), st.sampled_from(MALFORMED),
        st.text(max_size=16).map(lambda t: json.dumps({"prompt": t}).encode("utf-16")),
    )


@dataclass
class Case:
    path: str
    content: bytes
    content_type: str | None = "application/json"
    body: object = None  # the decoded body when it was generated as a JSON value


def draw_all(strategy: st.SearchStrategy, count: int) -> list:
    """`count` examples from `strategy`, the same ones every run."""
    drawn: list = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value) -> None:
        drawn.append(value)

    collect()
    return drawn


def fuzz_cases(num_structured: int, num_raw: int) -> list[Case]:
    """`num_structured` JSON-object bodies and `num_raw` malformed ones per endpoint, interleaved."""
    cases: list[Case] = []
    for path, model, base in ((COMPLETIONS, CompletionRequest, COMPLETION_BASE), (CHAT, ChatCompletionRequest, CHAT_BASE)):
        fields = field_strategies(model)
        structured = st.one_of(mutated_bodies(base, fields), mutated_bodies(base, fields), any_bodies(fields))
        cases += [Case(path, json.dumps(b).encode(), body=b) for b in draw_all(structured, num_structured)]
        raws = draw_all(st.tuples(raw_bodies(fields), CONTENT_TYPES), num_raw)
        cases += [Case(path, content, content_type) for content, content_type in raws]
    over_limit = b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
    cases += [Case(COMPLETIONS, over_limit), Case(CHAT, over_limit)]
    cases.sort(key=lambda c: zlib.crc32(c.content))  # mix endpoints and kinds, the same way every run
    return cases


def expected_num_choices(case: Case) -> int | None:
    """prompts x n, when the body says it plainly; None when it does not."""
    body = case.body
    if not isinstance(body, dict):
        return None
    n = body.get("n", 1)
    if case.path == CHAT:
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return n
    return len(prompt) * n if isinstance(prompt, list) else None


def error_problem(case: Case, status: int, payload: object, fields: set[str]) -> str | None:
    """Why a non-200 reply is not an OpenAI error body we allow (None when it is)."""
    if status not in (400, 404, 413, 503) and not (status == 504 and asked_for_deadline(case)):
        return f"status {status}"
    if not isinstance(payload, dict) or set(payload) != {"error"} or not isinstance(payload["error"], dict):
        return f"not an OpenAI error body: {payload!r:.200}"
    error = payload["error"]
    if set(error) != ERROR_KEYS or not (isinstance(error["message"], str) and error["message"]):
        return f"error fields {sorted(error)}, message {error.get('message')!r:.80}"
    if not isinstance(error["type"], str) or any(error[k] is not None and not isinstance(error[k], str)
                                                 for k in ("param", "code")):
        return f"error type/param/code of the wrong type: {error!r:.200}"
    if status == 504 and error["code"] != DEADLINE_CODE:
        return f"504 that is not {DEADLINE_CODE}: {error!r:.200}"
    if status == 404 and error["code"] != "model_not_found":
        return f"404 that is not model_not_found: {error!r:.200}"
    if status == 503 and error["code"] in ("engine_dead", "engine_stalled"):
        return f"engine died: {error!r:.200}"
    param = error["param"]
    if status == 400 and param is not None and param.split("[")[0].split(".")[0] not in fields:
        return f"param {param!r} is not a field of the request"
    return None


def success_problem(case: Case, payload: dict) -> str | None:
    expected = expected_num_choices(case)
    choices = payload.get("choices")
    if not isinstance(choices, list) or (expected is not None and len(choices) != expected):
        return f"{len(choices) if isinstance(choices, list) else choices!r} choices, expected {expected}"
    reasons = {c.get("finish_reason") for c in choices}
    return None if reasons <= allowed_finish_reasons(case) else f"finish reasons {sorted(map(str, reasons))}"


def stream_problem(case: Case, raw: bytes) -> str | None:
    events = [e for e in raw.decode("utf-8").split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]":
        return f"stream does not end with [DONE]: {events[-1:]!r:.200}"
    reasons: dict[int, str] = {}
    for position, event in enumerate(events[:-1]):
        payload = json.loads(event.removeprefix("data: "))
        deadline_last = (asked_for_deadline(case) and position == len(events) - 2
                         and payload.get("error", {}).get("code") == DEADLINE_CODE)
        if "error" in payload and not deadline_last:
            return f"error event in a stream: {payload!r:.200}"
        for choice in payload.get("choices", []):
            if choice.get("finish_reason") is not None:
                reasons[choice["index"]] = choice["finish_reason"]
    expected = expected_num_choices(case)
    if expected is not None and len(reasons) != expected:
        return f"{len(reasons)} choices finished, expected {expected}"
    if asked_for_deadline(case) and ("timeout" in reasons.values()) != (
            len(events) > 1 and events[-2].startswith('data: {"error"')):
        return f"a deadline's finish reasons and error event disagree: {sorted(reasons.values())}"
    return None if set(reasons.values()) <= allowed_finish_reasons(case) else f"finish reasons {sorted(reasons.values())}"


async def send(client: httpx.AsyncClient, case: Case, fields: dict[str, set[str]]) -> tuple[str, str | None]:
    """(kind of reply, problem or None); kind is the status, with '+sse' for a stream."""
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    try:
        async with client.stream("POST", case.path, content=case.content, headers=headers) as response:
            raw = await response.aread()
    except httpx.HTTPError as exc:
        return "transport", f"{type(exc).__name__}: {exc}"
    status, is_sse = response.status_code, response.headers.get("content-type", "").startswith("text/event-stream")
    try:
        if status == 200 and is_sse:
            return "200+sse", stream_problem(case, raw)
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return str(status), f"unparseable reply ({exc}): {raw[:200]!r}"
    if status == 200:
        return "200", success_problem(case, payload)
    return str(status), error_problem(case, status, payload, fields[case.path])


async def send_all(base_url: str, cases: list[Case]) -> list[tuple[str, str | None]]:
    fields = {COMPLETIONS: set(CompletionRequest.model_fields), CHAT: set(ChatCompletionRequest.model_fields)}
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def one(case: Case) -> tuple[str, str | None]:
            async with semaphore:
                return await send(client, case, fields)

        return await asyncio.gather(*(one(case) for case in cases))


def wait_idle(server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.state.engine.num_in_flight == 0 and server.num_free_blocks == server.num_blocks:
            return
        time.sleep(0.05)


def run_fuzz(server, num_structured: int, num_raw: int, min_total: int) -> None:
    cases = fuzz_cases(num_structured, num_raw)
    assert len(cases) >= min_total
    run_cases(server, cases)


def run_cases(server, cases: list[Case]) -> None:
    """Send the cases 16 at a time and hold every reply and the server after them to the bar above."""
    start = time.perf_counter()
    replies = asyncio.run(send_all(server.base_url, cases))
    elapsed = time.perf_counter() - start
    kinds = Counter(kind for kind, _ in replies)
    problems = [(case, problem) for case, (_, problem) in zip(cases, replies) if problem]
    print(f"fuzz: {len(cases)} bodies in {elapsed:.1f}s; replies {dict(sorted(kinds.items()))}; "
          f"problems {len(problems)}")
    wait_idle(server)
    health = httpx.get(server.base_url + "/health", timeout=10)
    assert not problems, "\n".join(f"{c.path} {c.content[:300]!r}: {p}" for c, p in problems[:12])
    assert kinds["200"] + kinds["200+sse"] > 0 and kinds["400"] > 0, "the fuzz never reached both outcomes"
    assert server.state.engine.is_alive, "the engine died"
    assert health.status_code == 200, health.text
    assert server.state.engine.num_in_flight == 0, "streams still registered after the fuzz"
    assert server.num_free_blocks == server.num_blocks, "KV blocks leaked"


def test_every_field_has_a_strategy():
    """A field added to a request model is fuzzed from its annotation even without a SEMANTIC entry."""
    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(field_strategies(model)) == set(model.model_fields)
    assert {"prompt", "messages", "stop_token_ids", "logit_bias", "n"} <= set(SEMANTIC)


def test_fuzz_smoke(live_tiny_server):
    """A tenth of the full run, in the default suite."""
    run_fuzz(live_tiny_server, num_structured=220, num_raw=30, min_total=500)


@pytest.mark.reliability
def test_fuzz_5000_bodies(live_tiny_server):
    run_fuzz(live_tiny_server, num_structured=2300, num_raw=250, min_total=5000)


# structured output and tools (issue 44): specs around the grammar budgets (engine/sampling/grammar_budget.py), the
# shapes that crashed the server (deep $ref chains, long rule chains) and the ones that failed at a later
# token (large repetitions, long choice lists), mixed with ordinary ones; the bar is the same as above

def ref_chain(depth: int, at: str = "#/$defs") -> dict:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"{at}/d{i + 1}"}, "maxItems": 2} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$ref": f"{at}/d0", "$defs": defs}


def lark_chain(depth: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "x"\n'


BUDGET_EDGES = [1, 2, 50, 98, 99, 100, 101, 398, 399, 400, 401, 1000, 2000, 3000]
leaf_schemas = st.sampled_from([{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 6},
                                {"type": "boolean"}, {"enum": ["a", "b"]}, {}, {"type": "bogus"}, {"const": "x"}])
schemas = st.one_of(
    st.recursive(leaf_schemas, lambda inner: st.one_of(
        inner.map(lambda s: {"type": "array", "items": s, "maxItems": 2}),
        st.dictionaries(st.sampled_from("abc"), inner, min_size=1, max_size=3).map(
            lambda p: {"type": "object", "properties": p, "required": sorted(p)}),
        st.lists(inner, min_size=1, max_size=3).map(lambda l: {"anyOf": l})), max_leaves=6),
    st.sampled_from(BUDGET_EDGES).map(ref_chain),
    st.sampled_from([999, 1000, 1001, 3000]).map(lambda n: {"enum": list(range(n))}),
    st.sampled_from([60, 63, 64, 65, 200]).map(lambda n: json.loads('{"type": "array", "items": ' * n + "{}" + "}" * n)),
)
regex_pieces = ["a", "b", "[0-9]", "\\d", "(", ")", "|", "*", "+", "?", "{2}", "{1,3}", "{100}", "{1000}", "[", "]",
                "\\", "\\p{L}", "(a{1000}){1000}", "(a{100}){200}", "x" * 300]
regexes = st.one_of(st.lists(st.sampled_from(regex_pieces), min_size=1, max_size=10).map("".join),
                    st.sampled_from(BUDGET_EDGES).map(lambda n: "(" * n + "a" + ")" * n))
choices = st.one_of(st.lists(texts, max_size=4), st.sampled_from([999, 1000, 1001, 10_000]).map(
    lambda n: [f"w{i}" for i in range(n)]), wrong_type)
grammars = st.one_of(st.sampled_from(BUDGET_EDGES).map(lark_chain), st.sampled_from([
    'root ::= "yes" | "no"', 'start: "a"+', 'start: /[0-9]{1,3}/', "start: /(a{1000}){1000}/", "root ::= undefined",
    'start: %json {"type": "integer"}', "start: " + " | ".join(f'"w{i}"' for i in range(1001))]),
    st.sampled_from(BUDGET_EDGES).map(lambda n: "start: " + "(" * n + '"x"' + ")" * n), texts)
structured_fields = st.one_of(
    st.fixed_dictionaries({"structured_outputs": st.one_of(
        schemas.map(lambda s: {"json": s}), regexes.map(lambda r: {"regex": r}), choices.map(lambda c: {"choice": c}),
        grammars.map(lambda g: {"grammar": g}), st.just({"json_object": True}))}),
    st.fixed_dictionaries({"response_format": schemas.map(
        lambda s: {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": s}})}),
    st.fixed_dictionaries({"guided_regex": regexes}), st.fixed_dictionaries({"guided_choice": choices}),
    st.fixed_dictionaries({"guided_json": schemas}), st.fixed_dictionaries({"guided_grammar": grammars}),
)


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def tool_ref_chain(depth: int) -> dict:
    """Parameters holding a $ref chain; they sit under the call schema's `arguments`, so pointers go there."""
    chain = ref_chain(depth, "#/properties/arguments/$defs")
    return {"type": "object", "properties": {"x": {"$ref": chain["$ref"]}}, "$defs": chain["$defs"]}


tool_parameters = st.one_of(schemas.map(lambda s: {"type": "object", "properties": {"x": s}}),
                            st.sampled_from(BUDGET_EDGES).map(tool_ref_chain))
tool_lists = st.one_of(
    st.lists(tool_parameters, min_size=1, max_size=3).map(lambda ps: [tool(f"f{i}", p) for i, p in enumerate(ps)]),
    st.sampled_from([1, 127, 128, 500, 3000]).map(lambda n: [tool(f"f{i}", {"type": "object", "properties": {
        "x": {"type": "integer"}}}) for i in range(n)]))
tool_fields = st.fixed_dictionaries({
    "tools": tool_lists,
    "tool_choice": st.sampled_from(["required", "auto", "none", {"type": "function", "function": {"name": "f0"}},
                                    {"type": "function", "function": {"name": "missing"}}]),
    "parallel_tool_calls": st.booleans()})


def grammar_cases(count: int) -> list[Case]:
    """`count` chat bodies with a structured output or tools, and `count` completions with a structured output."""
    chat = st.tuples(CHAT_BASE, st.one_of(structured_fields, tool_fields)).map(lambda parts: {**parts[0], **parts[1]})
    completion = st.tuples(COMPLETION_BASE, structured_fields).map(lambda parts: {**parts[0], **parts[1]})
    cases = [Case(CHAT, json.dumps(b).encode(), body=b) for b in draw_all(chat, count)]
    cases += [Case(COMPLETIONS, json.dumps(b).encode(), body=b) for b in draw_all(completion, count)]
    cases.sort(key=lambda c: zlib.crc32(c.content))
    return cases


def budget_edge_cases() -> list[Case]:
    """Each shape at each edge of its budget, sent as well as the drawn ones (hypothesis favours small values)."""
    bodies = []
    for n in BUDGET_EDGES:
        bodies += [{"response_format": {"type": "json_schema", "json_schema": {"name": "edge", "schema": ref_chain(n)}}},
                   {"structured_outputs": {"grammar": lark_chain(n)}},
                   {"guided_regex": "(" * n + "a" + ")" * n},
                   {"tools": [tool("f0", tool_ref_chain(n))], "tool_choice": "required"}]
    bodies += [{"guided_choice": [f"w{i}" for i in range(n)]} for n in (999, 1000, 1001, 10_000)]
    bodies += [{"tools": [tool(f"f{i}", {"type": "object"}) for i in range(n)], "tool_choice": "required"}
               for n in (128, 500, 3000)]
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return [Case(CHAT, json.dumps({**base, **b}).encode(), body={**base, **b}) for b in bodies]


@pytest.mark.reliability
def test_fuzz_structured_output_and_tools(live_tiny_server):
    """Grammar specs and tool lists around every budget: 200 or 400, never a 500 or a dead server."""
    run_cases(live_tiny_server, grammar_cases(200) + budget_edge_cases())
