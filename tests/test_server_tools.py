"""Tool calls on the default model over HTTP (its template renders no tools: the fallback prompt), with the
official `openai` client and raw httpx: forced calls validate against their schemas, streamed and not; a
follow-up turn carries the call and its result to the model; the parser and the stream splitter on exact
texts; bad tool fields are 400s naming them."""

import json
import time

import httpx
import jsonschema
import openai
import pytest

from tinyserve.server.openai_api.tools import ToolCallStream, ToolDefinition, ToolPlan, parse_tool_calls

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(spied_server):
    return spied_server[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _check_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_returns_calls_that_validate(client, seed):
    response = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, tools=[WEATHER, TIME],
                                              tool_choice="required", temperature=0.8, seed=seed, max_tokens=200)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    assert choice.message.content is None


def test_required_streamed_gives_the_same_calls_as_deltas(client):
    stream = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, tools=[WEATHER, TIME],
                                            tool_choice="required", temperature=0.0, max_tokens=200, stream=True)
    deltas, reasons, content = [], [], ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        deltas += delta.tool_calls or []
        content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and content == ""
    assert [d.index for d in deltas] == list(range(len(deltas)))
    _check_calls(deltas)
    whole = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=0.0, max_tokens=200)
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == \
        [(d.function.name, d.function.arguments) for d in deltas]


def test_a_named_function_is_the_one_called_once(client):
    response = client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, tools=[WEATHER, TIME], temperature=0.8, seed=4, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = response.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_calls(calls, names=("get_time",))


def test_parallel_tool_calls_false_gives_one_call(client):
    response = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, tools=[WEATHER, TIME],
                                              tool_choice="required", parallel_tool_calls=False, temperature=0.8,
                                              seed=7, max_tokens=300)
    assert len(response.choices[0].message.tool_calls) == 1


def test_a_follow_up_turn_carries_the_call_and_its_result(spied_server, client):
    srv, spy = spied_server
    first = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, tools=[WEATHER],
                                           tool_choice="required", temperature=0.0, max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    follow_up = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    spy.prompts.clear()
    second = client.chat.completions.create(model="smollm2-135m", messages=follow_up, tools=[WEATHER],
                                            temperature=0.0, max_tokens=40)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert isinstance(second.choices[0].message.content, str) and second.choices[0].message.content
    [prompt_ids] = spy.prompts.values()
    prompt = srv.state.engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert f'<tool_call>{{"name": "get_weather", "arguments": {call.function.arguments}}}</tool_call>' in prompt
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in prompt
    assert '"name": "get_weather"' in prompt.split("<|im_start|>user")[0]  # the tools, in the system block


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_fields_are_400s_naming_them(server, fields, param):
    body = {"messages": QUESTION, "max_tokens": 5, **fields}
    response = httpx.post(server.base_url + CHAT, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


# the parser and the stream splitter, on exact texts

PLAN = ToolPlan([ToolDefinition.model_validate(WEATHER)], "auto", None, True)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'


def test_parse_keeps_the_text_outside_calls_and_blocks_that_are_not_calls():
    content, calls = parse_tool_calls(f"Let me check.\n{CALL}\n", {"get_weather"})
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "celsius"}
    unknown = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert parse_tool_calls(unknown, {"get_weather"}) == (unknown, [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, {"get_weather"}) == (broken, [])
    as_text = '<tool_call>{"name": "get_weather", "parameters": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    assert json.loads(parse_tool_calls(as_text, {"get_weather"})[1][0].arguments) == {"city": "Rome"}
    assert parse_tool_calls("just text", {"get_weather"}) == ("just text", [])


def test_stream_splitter_holds_a_call_until_it_closes():
    stream = ToolCallStream(PLAN)
    pieces = ["Sure", ". <tool", "_call>{\"name\": \"get_weather\", ", '"arguments": {"city": "Oslo", ',
              '"unit": "celsius"}}</tool_call>', " done <to"]
    out = [stream.feed(p) for p in pieces]
    assert [text for text, _ in out] == ["Sure", ". ", "", "", "", " done "]
    assert [len(calls) for _, calls in out] == [0, 0, 0, 0, 1, 0]
    assert stream.finish() == "<to" and stream.num_calls == 1


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects(word_tokenizer):
    """Hugging Face's tool-use format: `tools` as a template variable, an assistant's calls with their
    arguments as objects, a tool message with its call id (what Qwen's and Hermes' templates read)."""
    from tinyserve.loader.tokenizer import Tokenizer
    from tinyserve.server.openai_api.protocol import ChatMessageParam

    template = ("{% if tools %}T:{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}C:{{ c.function.name }}={{ c.function.arguments.city }} "
                "{% endfor %}{% if m.tool_call_id %}R:{{ m.tool_call_id }}{% endif %} {% endfor %}")
    base = word_tokenizer(8)
    tokenizer = Tokenizer(base._backend, chat_template=template)
    assert tokenizer.template_renders_tools
    messages = [ChatMessageParam.model_validate(m).as_template_message(native_tools=True) for m in [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"}]]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=PLAN.template_kwargs()["tools"])
    assert prompt == "T:get_weather user:hi assistant:C:get_weather=Oslo  tool:21R:c1 "


# issue 44: a forced call's grammar within the grammar budgets

def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _ref_chain(depth: int) -> dict:
    """A $ref chain `depth` long, its pointers into the parameters schema as clients write them (the old server's
    compile overflowed its stack on it)."""
    at = "#/$defs"
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"{at}/d{i + 1}"}} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return {"type": "object", "properties": {"x": {"$ref": f"{at}/d0"}}, "$defs": defs}


@pytest.mark.parametrize("tools, limit", [
    ([_tool("deep", _ref_chain(2000))], "MAX_REF_HOPS"),  # overflowed the compile's stack: SIGSEGV
    ([_tool(f"f{i}", {"type": "object", "properties": {"x": {"type": "integer"}}}) for i in range(3000)],
     "characters"),  # a 500: the grammar's size cap raised past the handler
])
def test_a_forced_call_over_the_grammar_budget_is_a_quick_400_and_the_server_lives(server, tools, limit):
    _assert_alive(server)  # and warm: the first chat request of a server pays one-time costs
    start = time.perf_counter()
    body = {"messages": QUESTION, "max_tokens": 5, "tools": tools, "tool_choice": "required"}
    response = httpx.post(server.base_url + CHAT, json=body, timeout=60)
    assert time.perf_counter() - start < 1.0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_grammar", "tools") and limit in error["message"], error
    _assert_alive(server)


PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TRIP = {"type": "object", "properties": {"origin": {"$ref": "#/$defs/place"}, "destination": {"$ref": "#/$defs/place"}},
        "required": ["origin", "destination"], "$defs": {"place": PLACE}}


def test_a_forced_call_s_parameters_resolve_their_own_defs(client):
    """`#/$defs/...` points into the parameters schema (pydantic and the OpenAI SDK write such schemas); the call's
    grammar holds the parameters under `arguments`, so its refs are rebased there (before, they did not resolve)."""
    response = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Plan a trip from Paris to Rome."}],
        tools=[_tool("plan_trip", TRIP)], tool_choice="required", temperature=0.0, max_tokens=120)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "plan_trip"
    jsonschema.validate(json.loads(call.function.arguments), TRIP)


def _assert_alive(server) -> None:
    response = httpx.post(server.base_url + CHAT, json={"messages": QUESTION, "max_tokens": 3}, timeout=60)
    assert response.status_code == 200, response.text
