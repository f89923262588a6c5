"""The engine's side of the vLLM fields: prompt_logprobs (each prompt position's logprob against the
reference forward's log_softmax, across chunked prefill, past a prefix-cache hit, through a preemption,
once per sample), max_tokens 0 (score the prompt only), include_stop_str_in_output. Every block free at the
end of each run."""

import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.types import FinishReason, InvalidRequest, SamplingParams

TOLERANCE = 1e-4  # float32: chunked paged prefill against one dense forward
TEXT = ("The river ran clear and cold through the valley, and the people who lived along its banks fished, "
        "farmed and traded with the towns downstream.")


def _engine(loaded, *, budget=512, num_blocks=256, prefix_caching=True):
    config = EngineConfig(cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                    max_model_len=min(1024, num_blocks * 16)))
    return LLMEngine(config, loaded=loaded)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """{(request id, sample): {"ids", "text", "reason", "prompt_logprobs" (list of lists: one per output
    that carried them), "num_cached"}}, all requests queued at once; asserts every block is free after."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = results.setdefault((out.request_id, out.index),
                                   {"ids": [], "text": "", "reason": None, "prompt_logprobs": []})
            r["ids"] += out.new_token_ids
            r["text"] += out.new_text
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"].append(out.prompt_logprobs)
            if out.finished:
                r["reason"], r["num_cached"] = out.finish_reason, out.usage.cached_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    return results


def _check_against_reference(model, prompt_ids: list[int], scored, k: int) -> float:
    """Each prompt token 1.. against log_softmax of the reference logits at the position before it: its
    logprob, its rank, and the top k ids (exactly) and values. Returns the largest |difference|."""
    reference = torch.log_softmax(forward_sequence(model, prompt_ids).double(), dim=-1)  # [len, vocab]
    assert [lp.token_id for lp in scored] == prompt_ids[1:]
    worst = 0.0
    for position, lp in enumerate(scored):
        row = reference[position]
        worst = max(worst, abs(lp.logprob - row[lp.token_id].item()))
        value = row[lp.token_id]  # its rank by definition, up to tokens within TOLERANCE of it
        assert 1 + int((row > value + TOLERANCE).sum()) <= lp.rank <= 1 + int((row > value - TOLERANCE).sum())
        top = row.topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist(), position
        assert max((abs(v - e) for (_, v), e in zip(lp.top, top.values.tolist())), default=0.0) <= TOLERANCE
    assert worst <= TOLERANCE, worst
    return worst


def test_prompt_logprobs_match_the_reference_across_chunks(smollm2_loaded):
    prompt = smollm2_loaded.tokenizer.encode(TEXT)
    assert len(prompt) > 3 * 8  # four prefill chunks of 8 tokens at least
    engine = _engine(smollm2_loaded, budget=8)
    result = _run(engine, {"a": (prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4))})
    [scored] = result[("a", 0)]["prompt_logprobs"]  # once, on the first output
    assert len(scored) == len(prompt) - 1 and len(result[("a", 0)]["ids"]) == 3
    print(f"max |prompt logprob - reference| over {len(scored)} tokens: "
          f"{_check_against_reference(smollm2_loaded.model, prompt, scored, 4):.2e}")


def test_prompt_logprobs_skip_the_prefix_cache(smollm2_loaded):
    """A cached prefix has no logits: a request asking for prompt logprobs computes its whole prompt (no
    cached tokens), while a plain request with the same prompt hits the cache."""
    prompt = smollm2_loaded.tokenizer.encode(TEXT)
    engine = _engine(smollm2_loaded)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    assert _run(engine, {"warm": (prompt, greedy)})[("warm", 0)]["num_cached"] == 0
    assert _run(engine, {"plain": (prompt, greedy)})[("plain", 0)]["num_cached"] == (len(prompt) - 1) // 16 * 16
    scored = _run(engine, {"scored": (prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))})
    assert scored[("scored", 0)]["num_cached"] == 0
    [logprobs] = scored[("scored", 0)]["prompt_logprobs"]
    _check_against_reference(smollm2_loaded.model, prompt, logprobs, 0)


def test_every_sample_gets_the_prompt_logprobs_once(smollm2_loaded):
    prompt = smollm2_loaded.tokenizer.encode(TEXT)
    engine = _engine(smollm2_loaded, budget=32)
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, prompt_logprobs=2, ignore_eos=True)
    result = _run(engine, {"n": (prompt, params)})
    per_sample = [result[("n", i)]["prompt_logprobs"] for i in range(3)]
    assert all(len(sent) == 1 for sent in per_sample), [len(s) for s in per_sample]
    assert per_sample[0][0] == per_sample[1][0] == per_sample[2][0]
    _check_against_reference(smollm2_loaded.model, prompt, per_sample[0][0], 2)


def test_preemption_mid_prefill_recomputes_without_scoring_twice(smollm2_loaded):
    """A pool of exactly both prompts' blocks: the decoding request's second block preempts the newer one
    midway through its chunked prefill (recompute). Its prompt is computed again from 0; the positions
    already scored are not scored again, and the list is still right."""
    short = smollm2_loaded.tokenizer.encode("Count to ten:")
    prompt = smollm2_loaded.tokenizer.encode(TEXT * 4)
    num_blocks = -(-len(short) // 16) + -(-len(prompt) // 16)
    # 8 tokens a step: the decoding request needs its second block before the other's prefill is through
    engine = _engine(smollm2_loaded, budget=8, num_blocks=num_blocks, prefix_caching=False)
    preempted = []
    preempt = engine.scheduler._preempt

    def recording_preempt(request, output):
        preempted.append((request.request_id, len(request.prompt_logprobs or [])))
        preempt(request, output)

    engine.scheduler._preempt = recording_preempt
    result = _run(engine, {
        "decoding": (short, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)),
        "scored": (prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1))})
    assert preempted and all(rid == "scored" and 0 < n < len(prompt) - 1 for rid, n in preempted), preempted
    [scored] = result[("scored", 0)]["prompt_logprobs"]
    _check_against_reference(smollm2_loaded.model, prompt, scored, 1)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(smollm2_loaded):
    prompt = smollm2_loaded.tokenizer.encode(TEXT)
    engine = _engine(smollm2_loaded, budget=16)
    result = _run(engine, {"score": (prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))})[("score", 0)]
    assert (result["ids"], result["text"], result["reason"]) == ([], "", FinishReason.LENGTH)
    [scored] = result["prompt_logprobs"]
    _check_against_reference(smollm2_loaded.model, prompt, scored, 1)
    with pytest.raises(InvalidRequest, match=r"max_tokens must be >= 1 \(or 0 with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequest, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        engine.validate(prompt, SamplingParams(prompt_logprobs=21))  # the engine's limits (RequestLimits)


def test_include_stop_str_in_output(smollm2_loaded):
    prompt = smollm2_loaded.tokenizer.encode("The capital of France is")
    engine = _engine(smollm2_loaded)
    free = _run(engine, {"free": (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))})
    text = free[("free", 0)]["text"]
    stop = text.split()[2]  # a word a few tokens in
    cut = text.index(stop)
    for include, expected in ((False, text[:cut]), (True, text[: cut + len(stop)])):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,),
                                include_stop_str_in_output=include)
        result = _run(engine, {"stop": (prompt, params)})[("stop", 0)]
        assert (result["text"], result["reason"]) == (expected, FinishReason.STOP)
