"""Fuzzing the gRPC API (server/grpc_api/grpc_service.py) with generated GenerateRequest messages, unary and streamed,
and with bytes that are no GenerateRequest at all.

The bar (issue 44, as test_fuzz.py's for HTTP): every call ends OK or with the status HTTP's answer maps to
(INVALID_ARGUMENT for a 400, NOT_FOUND only for a made-up model, RESOURCE_EXHAUSTED / UNAVAILABLE for
admission), never INTERNAL or UNKNOWN; a stream that ends OK carries a finish reason for every choice; the
engine never dies, and afterwards every KV block is free and nothing is in flight.

Field values come from the message's descriptor: every field of GenerateRequest, including one added later,
gets values of its type around the edges of its meaning (token ids around the vocabulary, int32's ends,
NaN and infinities), and the structured-output fields get hostile grammars (deep schemas, long choice
lists, blown-up regexes). Messages are drawn by hypothesis with `derandomize=True`, sent 16 at a time.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

from tinyserve.server.grpc_api.proto import tinyserve_pb2 as pb

from .conftest import tiny_server
from .test_fuzz import FLOAT_EDGES, TEXT_EDGES, VOCAB, draw_all, wait_idle

CONCURRENCY = 16
INT32_EDGES = [0, 1, -1, 2, 16, 64, 65, 127, 128, 129, 1024, VOCAB - 1, VOCAB, 2**31 - 1, -(2**31)]
INT64_EDGES = INT32_EDGES + [2**63 - 1, -(2**63), 10**18]
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def _deep_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def _ref_chain(depth: int) -> str:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


texts = st.one_of(st.text(max_size=24), st.sampled_from([t for t in TEXT_EDGES if "\ud800" not in t and "\udfff" not in t]))
SEMANTIC = {
    "model": st.one_of(st.none(), st.sampled_from(["smollm2-135m", "nope", ""])),
    "text": st.one_of(st.sampled_from(["Hello", "The capital of France is"]), texts),
    "max_tokens": st.one_of(st.integers(-2, 12), st.sampled_from(INT32_EDGES)),
    "n": st.one_of(st.integers(-1, 4), st.sampled_from(INT32_EDGES)),
    "guided_json": st.one_of(st.sampled_from(['{"type": "object"}', '{"type": "string", "maxLength": 5}', "{",
                                              "[]", _deep_schema(40), _deep_schema(3000), _ref_chain(30),
                                              _ref_chain(2000)]), texts),
    "guided_regex": st.one_of(st.sampled_from(["[a-c]{1,4}", "(", "(a{1000}){1000}", "(a{1000}){1000}X",
                                               "x" * 5000, "(" * 300 + ")" * 300]), texts),
    "guided_choice": st.one_of(st.lists(texts, max_size=4), st.just(["a"] * 10_000),
                               st.just([str(i) for i in range(3000)])),
    "guided_grammar": st.one_of(st.sampled_from(['root ::= "yes" | "no"', "start: \"a\"", "root ::=",
                                                 "\n".join(f"r{i}: r{i + 1}" for i in range(3000)) + "\nr3000: \"x\""]),
                                texts),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_INT32:
        return st.one_of(st.integers(-3, 300), st.sampled_from(INT32_EDGES))
    if t == FieldDescriptor.TYPE_INT64:
        return st.one_of(st.integers(-3, 300), st.sampled_from(INT64_EDGES))
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.floats(-3, 3), st.sampled_from(FLOAT_EDGES))
    if t == FieldDescriptor.TYPE_STRING:
        return texts
    if t == FieldDescriptor.TYPE_MESSAGE and field.message_type.name == "TokenIds":
        ids = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-1, VOCAB, 2**31 - 1, -(2**31)]))
        return st.lists(ids, max_size=8).map(lambda v: pb.TokenIds(ids=v))
    raise AssertionError(f"no strategy for {field.full_name} (type {t}): add one")


def field_strategies() -> dict[str, st.SearchStrategy]:
    """Every field of GenerateRequest: its semantic values, or values of its type."""
    strategies = {}
    for field in pb.GenerateRequest.DESCRIPTOR.fields:
        if field.name in SEMANTIC:
            strategies[field.name] = SEMANTIC[field.name]
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = (_scalar(f) for f in field.message_type.fields)
            strategies[field.name] = st.dictionaries(key, value, max_size=4)
        elif field.is_repeated:
            strategies[field.name] = st.lists(_scalar(field), max_size=4)
        else:
            strategies[field.name] = _scalar(field)
    return strategies


def _message(fields: dict) -> pb.GenerateRequest:
    message = pb.GenerateRequest()
    for name, value in fields.items():
        if value is None:
            continue
        target = getattr(message, name)
        if isinstance(value, dict):
            target.update(value)
        elif isinstance(value, list):
            target.extend(value)
        elif isinstance(value, pb.TokenIds):
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


@st.composite
def requests(draw, fields: dict[str, st.SearchStrategy]) -> tuple[pb.GenerateRequest, bool]:
    """A valid request with one to three fields set to fuzzed values, and whether to stream it."""
    body = {"text": "Hello", "max_tokens": draw(st.integers(1, 6))}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        body[name] = draw(fields[name])
        if name == "token_ids":
            body.pop("text", None)
    return _message(body), draw(st.booleans())


async def _call(channel: grpc.aio.Channel, message: pb.GenerateRequest | bytes, stream: bool) -> str | None:
    """None when the call ended as the bar allows, else what went wrong."""
    if isinstance(message, bytes):  # no GenerateRequest: the bytes go out as they are
        call = channel.unary_unary("/tinyserve.v1.TinyServe/Generate", request_serializer=None,
                                   response_deserializer=pb.GenerateResponse.FromString)(message, timeout=60)
        stream = False
    elif stream:
        call = channel.unary_stream("/tinyserve.v1.TinyServe/GenerateStream",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateStreamResponse.FromString)(message, timeout=60)
    else:
        call = channel.unary_unary("/tinyserve.v1.TinyServe/Generate",
                                   request_serializer=pb.GenerateRequest.SerializeToString,
                                   response_deserializer=pb.GenerateResponse.FromString)(message, timeout=60)
    finished: dict[int, str] = {}
    try:
        if stream:
            async for chunk in call:
                if chunk.HasField("choice") and chunk.choice.finish_reason:
                    finished[chunk.choice.index] = chunk.choice.finish_reason
        else:
            reply = await call
            finished = {c.index: c.finish_reason for c in reply.choices}
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code not in ALLOWED:
            return f"{code.name}: {exc.details()[:200]}"
        if code == grpc.StatusCode.NOT_FOUND and "does not exist" not in exc.details():
            return f"NOT_FOUND for something else than a model: {exc.details()[:200]}"
        return None
    if not finished or any(reason not in ("stop", "length") for reason in finished.values()):
        return f"OK without a stop/length finish for each choice: {finished}"
    return None


async def _send_all(target: str, cases: list) -> list[str | None]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        async def one(case) -> str | None:
            async with semaphore:
                return await _call(channel, *case)

        return await asyncio.gather(*(one(case) for case in cases))


RAW = [b"", b"\x00", b"\xff" * 16, b"\x12\x05Hello", b"\x12\x05Hel", b"\x20\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
       b"\x1a\x03\x08\x80\x80", b"\x12" + b"\xff" * 10, b"\x0a\x02\xc3\x28\x12\x01x"]


def run_fuzz(default_tokenizer, count: int) -> None:
    cases = draw_all(requests(field_strategies()), count) + [(raw, False) for raw in RAW]
    with tiny_server(default_tokenizer, grpc_port=0) as server:
        problems = asyncio.run(_send_all(server.background.grpc_target, cases))
        found = [(case, p) for case, p in zip(cases, problems) if p]
        print(f"grpc fuzz: {len(cases)} calls; problems {len(found)}: {Counter(p.split(':')[0] for _, p in found)}")
        wait_idle(server)
        assert not found, "\n".join(f"{str(c[0])[:300]!r}: {p}" for c, p in found[:12])
        assert server.state.engine.is_alive, "the engine died"
        assert server.state.engine.num_in_flight == 0, "requests still in flight after the fuzz"
        assert server.num_free_blocks == server.num_blocks, "KV blocks leaked"


def test_every_field_has_a_strategy():
    """A field added to GenerateRequest is fuzzed from its type even without a SEMANTIC entry."""
    assert set(field_strategies()) == {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields}


def test_grpc_fuzz_smoke(default_tokenizer):
    run_fuzz(default_tokenizer, count=150)


@pytest.mark.reliability
def test_grpc_fuzz_2000_calls(default_tokenizer):
    run_fuzz(default_tokenizer, count=2000)
