"""The structural walk before llguidance (engine/sampling/grammar_budget.py): specs shaped like the ones that
crashed the server or failed at a later token (issue 44) are refused by name, fast, at any depth, and
ordinary specs just under each limit pass."""

import json
import time

import pytest

from tinyserve.engine.sampling import grammar_budget
from tinyserve.engine.sampling.grammar_budget import check_budget, clip
from tinyserve.types import InvalidRequest, StructuredOutput


def ref_chain(depth: int) -> str:
    """`$defs` whose arrays' items each `$ref` the next (the 126 KB body of issue 44 at depth 2,000)."""
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def lark_chain(depth: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "x"\n'


@pytest.mark.parametrize("spec, limit", [
    (StructuredOutput("json_schema", ref_chain(2000)), "MAX_REF_HOPS"),
    (StructuredOutput("json_schema", '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000), "MAX_JSON_NESTING"),
    (StructuredOutput("grammar", lark_chain(3000)), "MAX_RULES"),
    (StructuredOutput("grammar", lark_chain(500)), "MAX_NESTING_DEPTH"),
    (StructuredOutput("grammar", "root ::= r0\n" + "".join(f"r{i} ::= \"a\" r{i + 1}\n" for i in range(600))
                      + 'r600 ::= "x"\n'), "MAX_NESTING_DEPTH"),
    (StructuredOutput("grammar", f"start: %json {ref_chain(2000)}\n"), "MAX_REF_HOPS"),
    (StructuredOutput("grammar", "start: /(a{1000}){1000}/\n"), "MAX_REGEX_EXPANSION"),
    (StructuredOutput("regex", "(" * 100_000 + "a" + ")" * 100_000), "MAX_NESTING_DEPTH"),
    (StructuredOutput("regex", "(a{1000}){1000}"), "MAX_REGEX_EXPANSION"),
    (StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "(a{1000}){1000}"})),
     "MAX_REGEX_EXPANSION"),
    (StructuredOutput("choice", json.dumps([f"w{i}" for i in range(10_000)])), "MAX_ALTERNATIVES"),
    (StructuredOutput("json_schema", json.dumps({"anyOf": [{"const": i} for i in range(1001)]})), "MAX_ALTERNATIVES"),
    (StructuredOutput("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(1001))), "MAX_ALTERNATIVES"),
])
def test_specs_over_a_budget_are_refused_by_name_and_fast(spec, limit):
    start = time.perf_counter()
    with pytest.raises(InvalidRequest) as caught:
        check_budget(spec)
    assert time.perf_counter() - start < 1.0
    assert caught.value.code == "invalid_grammar" and caught.value.param == "structured_output"
    assert f"({limit})" in caught.value.message and len(caught.value.message) < 300


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", ref_chain(grammar_budget.MAX_REF_HOPS - 2)),
    StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"next": {"$ref": "#"}}})),  # a loop
    StructuredOutput("grammar", lark_chain(grammar_budget.MAX_NESTING_DEPTH - 3)),
    StructuredOutput("grammar", 'root ::= item+\nitem ::= [a-z"] | "(" root ")"\n'),  # a loop through a class
    StructuredOutput("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}(T[0-9]{2}:[0-9]{2}){0,1}\p{L}{1,3}"),
    StructuredOutput("regex", "(a{100}){200}"),
    StructuredOutput("choice", json.dumps([f"w{i}" for i in range(grammar_budget.MAX_ALTERNATIVES)])),
])
def test_specs_within_the_budget_pass(spec):
    check_budget(spec)


def test_depths_count_refs_as_levels_and_loops_once():
    assert grammar_budget.check_schema(json.loads(ref_chain(10))) == (22, 11)
    assert grammar_budget.check_schema({"$defs": {"a": {"items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"}) == (3, 1)
    assert grammar_budget.check_grammar(lark_chain(10)) == 12
    assert grammar_budget.check_regex("((a)(b))") == 2


def test_clip_keeps_at_most_256_characters_of_what_the_client_sent():
    assert clip("a" * 256) == "a" * 256
    assert clip("a" * 24_000).startswith("a" * 256 + "... (23744 more")
    assert len(clip("a" * 24_000)) < 300
