"""Structured output over HTTP on the default model: JSON schemas, json_object, regexes, choices and
grammars in every spelling clients use, sampled at temperature 0.8; the official client's `.parse()`;
constrained and unconstrained requests in one batch; compile errors as 400s naming the field."""

import asyncio
import json
import re
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}}, "required": ["age"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
     "required": ["price"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 2, "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 16},
                                                    "last": {"type": "string", "maxLength": 16}},
                   "required": ["first", "last"], "additionalProperties": False}},
     "required": ["person"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 20}},
     "required": ["ok"]},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                                       {"type": "string", "pattern": "^[A-Z]{3}$"}]}},
     "required": ["id"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
     "required": ["email"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 10}, "maxItems": 5}},
     "required": ["scores"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 40_000_000}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "maximum": 50}},
     "required": ["status", "count"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 8},
                                                               "v": {"type": "integer", "maximum": 100}},
                                "required": ["k", "v"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}, "qty": {"type": "integer", "minimum": 1,
                                                                               "maximum": 9}},
     "required": ["size"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"ref": {"type": "string", "format": "uuid"}}, "required": ["ref"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                "minItems": 1, "maxItems": 3},
                                      "total": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["items", "total"], "additionalProperties": False},
]


def _chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 200, "temperature": 0.8, **fields}


async def _post_all(base_url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


@pytest.fixture(scope="module")
def server(spied_server):
    return spied_server[0]


def test_twenty_json_schemas_at_temperature_08_all_validate(server):
    bodies = [_chat(f"Answer in JSON: example {i}.", seed=i, response_format={
        "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        for i, schema in enumerate(SCHEMAS)]
    responses = asyncio.run(_post_all(server.base_url, CHAT, bodies))
    for schema, response in zip(SCHEMAS, responses, strict=True):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_every_output_parses_on_chat_and_completions(server):
    """Any JSON object. Nothing bounds its strings but the model, so the prompts ask for JSON and name
    the keys, as OpenAI's JSON mode asks its users to, and sampling is llama.cpp's defaults (temperature
    0.8, top-k 40, top-p 0.95, min-p 0.05). On open prompts this 135M model runs into its max_tokens in
    about half the samples (docs/PERFORMANCE.md, "Structured output")."""
    cuts = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "max_tokens": 300,
            "response_format": {"type": "json_object"}}
    asks = [("a cat", '"name" and "age"'), ("a dog", '"name" and "breed"'), ("Paris", '"city" and "country"'),
            ("a book", '"title" and "author"')]
    chat = [_chat(f"Reply with a JSON object with the keys {keys} for {topic}.", seed=s, **cuts)
            for topic, keys in asks for s in range(2)]
    completions = [{"prompt": f"A JSON object with the keys {keys} for {topic}: ", "seed": s, **cuts}
                   for topic, keys in asks for s in range(2)]
    for path, bodies in ((CHAT, chat), (COMPLETIONS, completions)):
        for response in asyncio.run(_post_all(server.base_url, path, bodies)):
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            text = choice["message"]["content"] if path == CHAT else choice["text"]
            assert choice["finish_reason"] == "stop", choice
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("spelling", [
    lambda r: {"structured_outputs": {"regex": r}},
    lambda r: {"guided_regex": r},
])
def test_regex_every_output_matches(server, spelling):
    regex = r"[0-9]{4}-[0-9]{2}-[0-9]{2}|\(\d{3}\) \d{3}-\d{4}"
    bodies = [_chat("When were you born, or what is your phone number?", seed=s, **spelling(regex)) for s in range(6)]
    for response in asyncio.run(_post_all(server.base_url, CHAT, bodies)):
        assert response.status_code == 200, response.text
        assert re.fullmatch(regex, response.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("spelling", ["structured_outputs", "guided_choice"])
def test_choice_every_output_is_one_of_them(server, spelling):
    choices = ["Paris", "London", "New York City", "São Paulo"]
    field = {"structured_outputs": {"choice": choices}} if spelling == "structured_outputs" else {"guided_choice": choices}
    bodies = [_chat("Name a big city.", seed=s, **field) for s in range(8)]
    for response in asyncio.run(_post_all(server.base_url, CHAT, bodies)):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] in choices


@pytest.mark.parametrize("field", ["grammar", "guided_grammar", "structured_outputs"])
def test_gbnf_and_lark_grammars(server, field):
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    lark = 'start: "The answer is " ("yes" | "no") "."'
    for grammar in (gbnf, lark):
        value = {"grammar": grammar} if field == "structured_outputs" else grammar
        response = httpx.post(server.base_url + CHAT, json=_chat("Is the sky blue?", seed=1, **{field: value}),
                              timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] in ("The answer is yes.", "The answer is no.")


def test_llama_cpp_json_schema_field_on_completions(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}
    response = httpx.post(server.base_url + COMPLETIONS, json={"prompt": "Pick a number:", "max_tokens": 30,
                                                               "json_schema": schema, "seed": 3}, timeout=120)
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), schema)


def test_length_inside_a_constrained_output_says_length(server):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    response = httpx.post(server.base_url + CHAT, json=_chat("Tell a long story.", max_tokens=5, seed=0,
                                                             guided_json=schema), timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith('{"story": "')


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population: int = pydantic.Field(ge=0, le=40_000_000)
    is_capital: bool


def test_openai_client_parse_returns_the_pydantic_object(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = client.beta.chat.completions.parse(
        model="smollm2-135m", messages=[{"role": "user", "content": "Describe Paris as a city record."}],
        response_format=City, temperature=0.8, seed=5, max_tokens=200)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City)
    assert city.name and city.country


def test_unconstrained_requests_beside_constrained_ones_keep_their_greedy_tokens(spied_server):
    srv, spy = spied_server
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def plain(i):
        return {**_chat(prompts[i], temperature=0.0, max_tokens=24), "ignore_eos": True}

    alone = [httpx.post(srv.base_url + CHAT, json=plain(i), timeout=120).json() for i in range(8)]
    constrained = [_chat(f"JSON about {i}.", seed=i, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMAS[i]}}) for i in range(8)]
    spy.batches.clear()
    spy.gate.clear()  # all 16 queued before the first step, so they share batches
    try:
        task = _post_all(srv.base_url, CHAT, [plain(i) for i in range(8)] + constrained)
        loop = asyncio.new_event_loop()
        future = loop.create_task(task)
        loop.run_until_complete(asyncio.sleep(1.0))
        spy.gate.set()
        together = loop.run_until_complete(future)
        loop.close()
    finally:
        spy.gate.set()
    assert max(len(b) for b in spy.batches) >= 12, "the requests did not share a batch"
    for i in range(8):
        assert together[i].json()["choices"][0]["message"]["content"] == alone[i]["choices"][0]["message"]["content"]
    finished = 0
    for i, response in enumerate(together[8:]):
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "length":  # a sampled number can run its digits into max_tokens
            continue
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[i])
        finished += 1
    assert finished >= 6, f"only {finished} of 8 constrained outputs finished"


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),  # a keyword llguidance lacks
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": False}},
     "structured_outputs.disable_any_whitespace"),
    ({"response_format": {"type": "regex"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_regex": "7\U000669C0"}, "guided_regex"),  # a character no token of SmolLM2 can write
])
def test_bad_structured_output_is_a_400_naming_the_field(server, fields, param):
    response = httpx.post(server.base_url + CHAT, json=_chat("hi", **fields), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


# issue 44: grammar budgets, first-mask failures and what the errors echo

def _ref_chain(depth: int) -> dict:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _lark_chain(depth: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "x"\n'


def _assert_alive(server) -> None:
    response = httpx.post(server.base_url + CHAT, json=_chat("Say hi", max_tokens=3), timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("fields, param, limit", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": _ref_chain(2000)}}},
     "response_format", "MAX_REF_HOPS"),
    ({"structured_outputs": {"grammar": _lark_chain(3000)}}, "structured_outputs.grammar", "MAX_RULES"),
    ({"structured_outputs": {"grammar": _lark_chain(1000)}}, "structured_outputs.grammar", "MAX_NESTING_DEPTH"),
])
def test_a_grammar_deep_enough_to_crash_the_compile_is_a_quick_400_and_the_server_lives(server, fields, param, limit):
    """Issue 44: these overflowed the compiling thread's stack and the SIGSEGV took the server down."""
    _assert_alive(server)  # and warm: the first chat request of a server pays one-time costs
    start = time.perf_counter()
    response = httpx.post(server.base_url + CHAT, json=_chat("hi", **fields), timeout=60)
    assert time.perf_counter() - start < 1.0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("invalid_grammar", param, "invalid_request_error")
    assert f"({limit})" in error["message"]
    _assert_alive(server)


@pytest.mark.parametrize("field, param", [("guided_json", "guided_json"),
                                           ("json_schema", "json_schema")])
def test_a_schema_given_as_json_text_nested_past_the_parser_is_a_400(server, field, param):
    """Found by the gRPC fuzz: a schema sent as a string (gRPC's guided_json is text) nested 3,000 deep made
    json.loads raise RecursionError, a 500."""
    deep = '{"type": "array", "items": ' * 3000 + '{"type": "integer"}' + "}" * 3000
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: deep},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_grammar", param) and "nested too deeply" in error["message"]
    _assert_alive(server)


@pytest.mark.parametrize("fields, limit", [
    ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "MAX_REGEX_EXPANSION"),
    ({"structured_outputs": {"choice": [f"w{i}" for i in range(10_000)]}}, "MAX_ALTERNATIVES"),
])
def test_grammars_that_failed_at_a_later_token_are_400s_every_time(server, fields, limit):
    """Issue 44: a 500 engine_error, and the same request sent again a 200."""
    for _ in range(2):
        response = httpx.post(server.base_url + CHAT, json=_chat("hi", max_tokens=4, **fields), timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_grammar" and f"({limit})" in error["message"], error
    _assert_alive(server)


def test_a_bad_long_regex_is_echoed_at_most_256_characters(server):
    """Issue 44 (Low): the 400 for a bad 24 KB regex carried all of it."""
    regex = "(" + "a" * 24_000  # unclosed
    response = httpx.post(server.base_url + CHAT, json=_chat("hi", guided_regex=regex), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_grammar" and error["param"] == "guided_regex"
    assert "a" * 257 not in error["message"] and len(response.content) < 1024, len(response.content)
