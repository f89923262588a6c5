"""Isolation between requests in LLMEngine, on a small random Llama with the default tokenizer.

Failures: faults are injected on one engine instance, and the requests they do not touch must come out
exactly as in a run without them, with every KV block and sampler generator freed and one final ERROR
output per failed sample. Pausing (a slow reader) holds back only the paused request; cache_salt keeps
one tenant's prefix-cache hits from another."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS, LLMEngine
from tinyserve.loader.gguf.checkpoint import open_gguf
from tinyserve.loader.model_loader import LoadedModel, resolve_model_path
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.types import FinishReason, SamplingParams

PROMPTS = {"a": "The river ran clear", "b": "def parse(line):", "c": "Records from 1642 show", "d": "Hello"}
GREEDY = {"temperature": 0.0, "ignore_eos": True}  # as params_for("a") and ("c"), so baseline tokens apply


@pytest.fixture(scope="module")
def tiny_loaded() -> LoadedModel:
    tokenizer = Tokenizer.from_gguf(open_gguf(resolve_model_path("smollm2-135m")))
    config = ModelConfig(architecture="llama", vocab_size=tokenizer.vocab_size, hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                         max_position_embeddings=256, norm_eps=1e-5, tie_word_embeddings=True,
                         eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return LoadedModel(model.eval().requires_grad_(False), config, tokenizer, Path("tiny-random-llama"))


def make_engine(loaded: LoadedModel, max_num_seqs: int = 8) -> LLMEngine:
    config = EngineConfig(cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256))
    return LLMEngine(config, loaded=loaded)


def params_for(request_id: str) -> SamplingParams:
    # greedy and seeded rows, so that a fault could show up in either, and a seeded generator to free
    if request_id in ("a", "c"):
        return SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    return SamplingParams(n=2, max_tokens=10, ignore_eos=True, temperature=0.9, seed=len(request_id) + 7)


def run(engine: LLMEngine, request_ids, before_step=None) -> dict:
    """Add the requests, step to the end. {(id, index): [outputs]}; before_step(engine, step) may add more."""
    for request_id in request_ids:
        engine.add_request(request_id, PROMPTS[request_id], params_for(request_id))
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        if before_step is not None:
            before_step(engine, step)
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
        step += 1
    return outputs


def tokens(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def assert_clean(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "leaked KV blocks"
    assert not engine.has_unfinished_requests()
    assert engine._groups == {}, "a finished request is still owned by the engine"


def assert_one_final(outputs: list, reason: FinishReason) -> None:
    finals = [out for out in outputs if out.finished]
    assert len(finals) == 1 and outputs[-1] is finals[0], "exactly one final output, and it is the last"
    assert finals[0].finish_reason is reason
    if reason is FinishReason.ERROR:
        assert finals[0].error == "generation failed"


@pytest.fixture(scope="module")
def baseline(tiny_loaded) -> dict:
    """Every request's tokens in a run without faults (each sample's tokens do not depend on its batch)."""
    outputs = run(make_engine(tiny_loaded), PROMPTS)
    return {key: tokens(outs) for key, outs in outputs.items()}


class FailingSampler:
    """Delegates to the engine's sampler, raising on one call (0-based); records each call's request ids."""

    def __init__(self, sampler, failing_call: int):
        self.sampler, self.failing_call, self.calls = sampler, failing_call, []

    def __call__(self, logits, requests, token_masks=None):
        self.calls.append({(r.request_id, r.index) for r in requests})
        if len(self.calls) - 1 == self.failing_call:
            raise RuntimeError("injected sampler fault")
        return self.sampler(logits, requests, token_masks)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def test_sampler_failure_fails_only_the_requests_of_that_step(tiny_loaded, baseline, caplog):
    engine = make_engine(tiny_loaded, max_num_seqs=3)
    engine.runner.sampler = sampler = FailingSampler(engine.runner.sampler, failing_call=2)

    def arrivals(engine, step):
        if step in (1, 5):  # c waits (3 running) through the faulty step 2; d comes after it
            request_id = "c" if step == 1 else "d"
            engine.add_request(request_id, PROMPTS[request_id], params_for(request_id))

    with caplog.at_level(logging.ERROR):
        outputs = run(engine, ["a", "b"], before_step=arrivals)
    assert sampler.calls[2] == {("a", 0), ("b", 0), ("b", 1)}
    for key, num_tokens_before in [(("a", 0), 2), (("b", 0), 2), (("b", 1), 1)]:
        assert_one_final(outputs[key], FinishReason.ERROR)
        assert tokens(outputs[key]) == baseline[key][:num_tokens_before]
    for key in [("c", 0), ("d", 0), ("d", 1)]:
        assert_one_final(outputs[key], FinishReason.LENGTH)
        assert tokens(outputs[key]) == baseline[key]
    logged = [r for r in caplog.records if r.exc_info and "injected sampler fault" in str(r.exc_info[1])]
    assert len(logged) == 1 and all(f"Request({request_id!r}, prompt 0, sample {index}" in logged[0].getMessage()
                                    for request_id, index in sampler.calls[2])
    assert engine.stats().num_failed_requests == 3
    assert_clean(engine)


def test_detokenizer_failure_fails_only_its_request(tiny_loaded, baseline, caplog):
    engine = make_engine(tiny_loaded)

    def break_b0(engine, step):
        if step == 3:
            detok = engine._groups["b"].samples[0].detokenizer
            detok.step = lambda new_token_ids: 1 / 0

    with caplog.at_level(logging.ERROR):
        outputs = run(engine, ["a", "b", "c"], before_step=break_b0)
    assert_one_final(outputs[("b", 0)], FinishReason.ERROR)
    assert tokens(outputs[("b", 0)]) == baseline[("b", 0)][:3]
    for key in [("a", 0), ("b", 1), ("c", 0)]:
        assert_one_final(outputs[key], FinishReason.LENGTH)
        assert tokens(outputs[key]) == baseline[key]
    logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], ZeroDivisionError)]
    assert len(logged) == 1 and "Request('b', prompt 0, sample 0" in logged[0].getMessage()
    assert_clean(engine)


def test_consecutive_batch_failures_kill_the_engine_and_a_success_resets_the_count(tiny_loaded):
    engine = make_engine(tiny_loaded)
    execute, plan = engine.runner.execute, iter([True, True, False, True, True, True])

    def faulty_execute(scheduled):
        if next(plan):
            raise RuntimeError("injected forward fault")
        return execute(scheduled)

    engine.runner.execute = faulty_execute
    finals = []
    for step in range(MAX_CONSECUTIVE_FAILED_STEPS * 2 - 1):  # fail, fail, succeed, fail, fail
        engine.add_request(f"r{step}", PROMPTS["a"], SamplingParams(max_tokens=4, temperature=0.0))
        finals += [out for out in engine.step() if out.finished]
    # r2 got its first token at step 2, then failed with r3 at step 3
    assert [out.request_id for out in finals] == ["r0", "r1", "r2", "r3", "r4"]
    assert all(out.finish_reason is FinishReason.ERROR and out.error == "generation failed" for out in finals)
    engine.add_request("last", PROMPTS["a"], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(RuntimeError, match="in a row"):
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_finding_1_body_is_refused_and_harmless_if_it_gets_in(tiny_loaded, baseline):
    engine = make_engine(tiny_loaded)
    with pytest.raises(ValueError, match=r"^stop_token_ids "):
        engine.add_request("x", "x", SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[-1000000000]))
    vocab = tiny_loaded.config.vocab_size
    with pytest.raises(ValueError, match=rf"^stop_token_ids must be token ids in \[0, {vocab}\)"):
        engine.add_request("x", "x", SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[vocab]))
    # past validation (a bug upstream): the id can never be sampled, so masking it changes nothing
    bad = SamplingParams(max_tokens=10, min_tokens=5, ignore_eos=True, temperature=0.0)
    object.__setattr__(bad, "stop_token_ids", (-1000000000, vocab + 5))
    object.__setattr__(bad, "stop_token_id_set", frozenset(bad.stop_token_ids))
    engine.validate = lambda prompt_ids, params: None
    engine.add_request("bad", PROMPTS["a"], bad)
    outputs = run(engine, ["c"])
    assert tokens(outputs[("bad", 0)]) == baseline[("a", 0)]
    assert tokens(outputs[("c", 0)]) == baseline[("c", 0)]
    assert_one_final(outputs[("bad", 0)], FinishReason.LENGTH)
    assert_clean(engine)


def outputs_of(engine: LLMEngine, outputs: dict, steps: int | None = None) -> None:
    """Step (`steps` times, or to the end), gathering outputs into {(id, index): [outputs]}."""
    step = 0
    while engine.has_unfinished_requests() and (steps is None or step < steps):
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
        step += 1


def test_paused_running_request_gets_no_tokens_frees_its_blocks_and_resumes_exactly(tiny_loaded, baseline):
    engine = make_engine(tiny_loaded)
    for request_id in "abc":
        engine.add_request(request_id, PROMPTS[request_id], params_for(request_id))
    outputs = {}
    outputs_of(engine, outputs, steps=3)
    engine.set_paused("b", True)  # both samples, seeded: their generators must stay in step
    before = {key: len(tokens(outs)) for key, outs in outputs.items()}
    outputs_of(engine, outputs, steps=4)
    assert all(len(tokens(outputs[("b", i)])) == before[("b", i)] for i in range(2)), "a paused sample got tokens"
    assert len(tokens(outputs[("a", 0)])) == before[("a", 0)] + 4
    assert [r.block_tables for r in engine._groups["b"].samples] == [[], []]  # preempted: seat and blocks freed
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_paused) == (2, 0, 2)
    engine.set_paused("b", False)
    engine.set_paused("unknown", True)  # no-op
    outputs_of(engine, outputs)
    for key in [("a", 0), ("b", 0), ("b", 1), ("c", 0)]:
        assert_one_final(outputs[key], FinishReason.LENGTH)
        assert tokens(outputs[key]) == baseline[key]
    assert_clean(engine)


def test_paused_waiting_request_does_not_block_the_one_behind_it(tiny_loaded, baseline):
    engine = make_engine(tiny_loaded, max_num_seqs=1)
    engine.add_request("a", PROMPTS["a"], params_for("a"))
    engine.set_paused("a", True)
    engine.add_request("c", PROMPTS["c"], params_for("c"))
    outputs = {}
    for _ in range(50):
        outputs_of(engine, outputs, steps=1)
        if ("c", 0) in outputs and outputs[("c", 0)][-1].finished:
            break
    assert tokens(outputs.get(("c", 0), [])) == baseline[("c", 0)], "c waited behind the paused request"
    assert ("a", 0) not in outputs and engine.stats().num_paused == 1 and engine.step() == []
    engine.set_paused("a", False)
    outputs_of(engine, outputs)
    assert tokens(outputs[("a", 0)]) == baseline[("a", 0)] and tokens(outputs[("c", 0)]) == baseline[("c", 0)]
    assert_clean(engine)


def test_cache_salt_keeps_prefix_cache_hits_within_a_tenant(tiny_loaded):
    engine = make_engine(tiny_loaded)
    prompt = tiny_loaded.tokenizer.encode(" ".join(PROMPTS.values()) * 4)
    assert len(prompt) > 64
    full_blocks = (len(prompt) - 1) // 16 * 16

    def cached_tokens(request_id: str, salt: str | None, n: int = 1) -> list[int]:
        engine.add_request(request_id, prompt, SamplingParams(n=n, max_tokens=1, temperature=0.0), cache_salt=salt)
        if n > 1:
            assert {r.cache_salt for r in engine._groups[request_id].samples} == {salt}
        finals = []
        while engine.has_unfinished_requests():
            finals += [out for out in engine.step() if out.finished]
        return [out.usage.cached_tokens for out in sorted(finals, key=lambda out: out.index)]

    assert cached_tokens("first", "tenant-1") == [0]
    assert cached_tokens("other", "tenant-2") == [0]
    assert cached_tokens("shared", None) == [0]
    assert cached_tokens("same", "tenant-1") == [full_blocks]
    assert cached_tokens("shared-again", None) == [full_blocks]
    assert cached_tokens("siblings", "tenant-2", n=2) == [full_blocks, full_blocks]
    assert_clean(engine)


def assert_released(request) -> None:
    """What LLMEngine._end_request promises: nothing of the request's is held any more."""
    assert request.is_finished and request.finish_reason is not None and request.finished_time is not None
    assert request.block_tables == [] and request.block_hashes == []
    assert request.generator is None and request.detokenizer is None


def test_every_way_to_end_releases_everything_the_request_held(tiny_loaded, baseline):
    """EOS/stop id, length, stop string, abort (waiting and running), a failed detokenizer, and several
    prompts under one id: each sample is released once, through the one exit, with its final output."""
    engine = make_engine(tiny_loaded, max_num_seqs=3)
    first = baseline[("a", 0)][0]
    stop_text = tiny_loaded.tokenizer.decode(baseline[("c", 0)][1:3])
    seeded = SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=11)
    engine.add_request("stop_id", PROMPTS["a"], SamplingParams(max_tokens=10, stop_token_ids=[first], **GREEDY))
    engine.add_request("length", PROMPTS["b"], seeded)
    engine.add_request("stop_str", PROMPTS["c"], SamplingParams(max_tokens=10, stop=stop_text, **GREEDY))
    engine.add_request("waiting", PROMPTS["d"], seeded)  # max_num_seqs=3: not admitted yet
    engine.add_request("multi", PROMPTS["a"], seeded, prompt_index=0)
    engine.add_request("multi", PROMPTS["b"], seeded, prompt_index=1)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("multi", PROMPTS["c"], seeded, prompt_index=1)
    samples = {rid: list(group.samples) for rid, group in engine._groups.items()}
    assert [(r.prompt_index, r.index) for r in samples["multi"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    finals = engine.abort("waiting")
    assert [(f.request_id, f.index, f.finish_reason) for f in finals] == [("waiting", i, FinishReason.ABORT)
                                                                          for i in range(2)]
    outputs = {}
    for step in range(1000):
        if step == 1:
            samples["length"][1].detokenizer.step = lambda new_token_ids: 1 / 0
        for out in engine.step():
            outputs.setdefault((out.request_id, out.prompt_index, out.index), []).append(out)
        if not engine.has_unfinished_requests():
            break
    reasons = {key: outs[-1].finish_reason for key, outs in outputs.items() if outs[-1].finished}
    assert reasons[("stop_id", 0, 0)] is FinishReason.STOP
    assert reasons[("stop_str", 0, 0)] is FinishReason.STOP
    assert reasons[("length", 0, 0)] is FinishReason.LENGTH and reasons[("length", 0, 1)] is FinishReason.ERROR
    assert {reasons[("multi", p, i)] for p in (0, 1) for i in (0, 1)} == {FinishReason.LENGTH}
    for request in (r for group in samples.values() for r in group):
        assert_released(request)
    assert_clean(engine)
