"""Constrained decoding in the engine (engine/sampling/structured_output.py, the sampler's masks, LLMEngine's
matcher stage) on the default model: masks allow exactly the grammar's tokens, compiled grammars are
cached, n > 1 and preemption keep every sample in the language, a finished language stops the request
without waiting for EOS, and everything a constrained request held is released."""

import json
import time

import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.sampling import structured_output
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.sampling.structured_output import closed_objects
from tinyserve.types import FinishReason, InvalidRequest, SamplingParams, StructuredOutput

DATE = StructuredOutput("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
PERSON = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"]}))


def _engine(loaded, num_blocks=256, max_model_len=1024, **scheduler):
    config = EngineConfig(cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_model_len=max_model_len, **scheduler))
    return LLMEngine(config, loaded=loaded)


def _run(engine):
    """Step to the end: {(request id, sample index): (text, token ids, finish reason)}."""
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            text, ids, _ = results.get((out.request_id, out.index), ("", [], None))
            results[(out.request_id, out.index)] = (text + out.new_text, ids + out.new_token_ids, out.finish_reason)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return results


def test_mask_allows_exactly_the_grammars_next_tokens(smollm2_loaded):
    engine = _engine(smollm2_loaded)
    outputs = engine.structured_outputs
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    bitmask = outputs.fill_bitmask([outputs.matcher(choice)])
    vocab = smollm2_loaded.config.vocab_size
    allowed = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[0, :vocab]
    texts = sorted(smollm2_loaded.tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist())
    assert texts == ["n", "no", "y", "ye", "yes"]


def test_a_grammar_is_compiled_once_and_bad_ones_name_their_kind(smollm2_loaded):
    outputs = _engine(smollm2_loaded).structured_outputs
    outputs.compile(DATE)
    pristine = outputs._compiled.get(DATE)
    outputs.compile(StructuredOutput("regex", DATE.spec))  # equal spec: the cached entry
    assert outputs._compiled.get(DATE) is pristine and len(outputs._compiled) == 1
    with pytest.raises(InvalidRequest, match="the regex cannot be compiled") as caught:
        outputs.compile(StructuredOutput("regex", "(unclosed"))
    assert caught.value.param == "structured_output" and caught.value.code == "invalid_grammar"
    with pytest.raises(InvalidRequest, match="the JSON schema is not valid"):
        outputs.compile(StructuredOutput("json_schema", "[1, 2"))


@pytest.mark.parametrize("spec", [
    StructuredOutput("regex", "7\U000669C0"),  # llguidance's mask let a stray continuation byte through here
    StructuredOutput("regex", "[\U00040000-\U0004FFFF]x"),
    StructuredOutput("choice", json.dumps(["a", "\U000669C0"])),
    StructuredOutput("json_schema", json.dumps({"const": "\U000669C0"})),
    StructuredOutput("grammar", 'root ::= "\x04"'),
])
def test_a_character_the_vocabulary_cannot_write_is_refused_at_compile(smollm2_loaded, spec):
    """SmolLM2's vocabulary has no token holding the byte 0xF1 (nor 0x04): a spec needing one is a 400."""
    outputs = _engine(smollm2_loaded).structured_outputs
    with pytest.raises(InvalidRequest, match="this model's vocabulary cannot write") as caught:
        outputs.compile(spec)
    assert caught.value.param == "structured_output" and caught.value.code == "invalid_grammar"
    assert spec not in outputs._compiled
    outputs.compile(StructuredOutput("json_schema", json.dumps({"const": "\u0004 \u00e9\u4eba\U0001f642"})))


def test_objects_with_properties_admit_no_others_unless_they_say_so():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a property so named
        "open": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "any": {"type": "object"}},
        "$defs": {"d": {"anyOf": [{"type": "object", "properties": {"z": {}}}]}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # the name map itself is not a schema
    assert closed["properties"]["open"]["additionalProperties"] == {"type": "string"}
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["any"]  # any object stays any object
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_samples_stay_in_the_language_through_n_and_preemption(smollm2_loaded):
    """A pool of 12 blocks for two n=3 requests forces preemption (recompute); each of the 6 samples must
    end in a full match, STOP, and the grammar's matchers go with the requests."""
    engine = _engine(smollm2_loaded, num_blocks=12, max_model_len=192, max_num_batched_tokens=64)
    tokenizer = smollm2_loaded.tokenizer
    prompt = tokenizer.encode("The date of the first moon landing, then a person as JSON: " * 4)
    engine.add_request("date", prompt, SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=40,
                                                      structured_output=DATE))
    engine.add_request("person", prompt, SamplingParams(n=3, temperature=0.9, seed=2, max_tokens=60,
                                                        structured_output=PERSON))
    requests = [r for g in engine._groups.values() for r in g.samples]
    results = _run(engine)
    assert engine.scheduler.num_preemptions > 0
    for index in range(3):
        text, _, reason = results[("date", index)]
        assert reason is FinishReason.STOP and len(text) == 10 and text[4] == text[7] == "-", text
        text, _, reason = results[("person", index)]
        person = json.loads(text)
        assert reason is FinishReason.STOP and set(person) == {"name", "age"} and 0 <= person["age"] <= 99
    assert all(r.matcher is None and r.is_finished for r in requests)


def test_a_complete_language_stops_without_eos_and_constrained_rows_share_a_batch(smollm2_loaded):
    engine = _engine(smollm2_loaded)
    prompt = smollm2_loaded.tokenizer.encode("Today's date:")
    eos = smollm2_loaded.config.eos_token_ids
    engine.add_request("c", prompt, SamplingParams(temperature=0.0, max_tokens=30, structured_output=DATE))
    engine.add_request("u", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    results = _run(engine)
    text, ids, reason = results[("c", 0)]
    assert reason is FinishReason.STOP and len(text) == 10 and not set(ids) & set(eos)
    alone = _engine(smollm2_loaded)
    alone.add_request("u", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert _run(alone)[("u", 0)][1] == results[("u", 0)][1]


def _ref_chain(depth: int) -> str:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def test_a_spec_deep_enough_to_overflow_the_compile_stack_is_refused_before_llguidance(smollm2_loaded):
    """Issue 44: a 2,000-deep $ref chain overflowed the compiling thread's stack (SIGSEGV); depth 1,000 did not."""
    outputs = _engine(smollm2_loaded).structured_outputs
    spec = StructuredOutput("json_schema", _ref_chain(2000))
    start = time.perf_counter()
    with pytest.raises(InvalidRequest, match=r"\(MAX_REF_HOPS\)") as caught:
        outputs.compile(spec)
    assert time.perf_counter() - start < 1.0 and caught.value.code == "invalid_grammar"
    assert spec not in outputs._compiled
    outputs.compile(StructuredOutput("json_schema", _ref_chain(50)))  # a chain within the budget compiles


def test_a_grammar_whose_first_mask_fails_is_refused_at_compile_every_time(smollm2_loaded, monkeypatch):
    """Issue 44: `(a{1000}){1000}` compiled, its first mask exhausted the shared lexer, and the request was a
    500 while the same one sent again was a 200. With the budget out of the way, the compile's probes of
    the first mask refuse it, the same way twice, and the message leaves out the grammar."""
    monkeypatch.setattr(structured_output, "check_budget", lambda spec: None)
    outputs = _engine(smollm2_loaded).structured_outputs
    spec = StructuredOutput("regex", "(a{1000}){1000}")
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="the regex cannot be compiled: lexer error") as caught:
            outputs.compile(spec)
        assert caught.value.code == "invalid_grammar" and len(caught.value.message) < 300
        assert spec not in outputs._compiled


def test_cache_entries_cost_the_heap_their_compile_kept(smollm2_loaded):
    outputs = _engine(smollm2_loaded).structured_outputs
    large = StructuredOutput("regex", "(a{100}){200}")  # within the budget; its lexer holds megabytes
    outputs.compile(DATE)
    outputs.compile(large)
    assert outputs._compiled.cost(DATE) < outputs._compiled.cost(large)
    assert outputs._compiled.cost(large) > (2 << 20)
    assert outputs._compiled.total_bytes == outputs._compiled.cost(DATE) + outputs._compiled.cost(large)


@pytest.mark.parametrize("spec", [
    StructuredOutput("choice", json.dumps(["yes", "<|endoftext|>"])),
    StructuredOutput("regex", r"a<\|im_end\|>"),
    StructuredOutput("grammar", 'root ::= "<|im_start|>"'),
    StructuredOutput("json_schema", json.dumps({"const": "\u003c|endoftext|>"})),
])
def test_a_spec_that_spells_a_special_token_is_refused_at_compile(smollm2_loaded, spec):
    """llguidance's mask allowed only the special token where the grammar spells its text, then refused
    that token when consumed: the request failed mid-output, a 500 (found by the fuzz of issue 44)."""
    outputs = _engine(smollm2_loaded).structured_outputs
    with pytest.raises(InvalidRequest, match="spells the special token '<|") as caught:
        outputs.compile(spec)
    assert caught.value.code == "invalid_grammar" and spec not in outputs._compiled
