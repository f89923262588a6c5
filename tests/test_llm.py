"""The offline API: LLM.generate / LLM.chat return text, token ids, finish reason, usage and logprobs."""

import math

import pytest

from tinyserve.engine.greedy_reference import greedy_generate
from tinyserve import LLM
from tinyserve.types import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", kv_cache_memory=0.5)


def test_generate_matches_reference_greedy(llm):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    results = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        ids = llm.tokenizer.encode(prompt)
        assert result.prompt_token_ids == ids
        assert result.token_ids == greedy_generate(llm.engine.runner.model, ids, 16)
        assert result.text == llm.tokenizer.decode(result.token_ids)
        assert result.finish_reason is FinishReason.LENGTH
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 16)


def test_chat_applies_template_and_stops_at_end_of_turn(llm):
    [result] = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=64, temperature=0.0))
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert result.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert result.finish_reason is FinishReason.STOP
    assert result.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert result.text and "<|im_end|>" not in result.text


def test_logprobs_are_normalized_and_top_ranked(llm):
    [result] = llm.generate("Hello, my name is", SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))
    assert len(result.logprobs) == len(result.token_ids)
    for token_id, lp in zip(result.token_ids, result.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == token_id  # greedy: the sampled token is the best one
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5


def test_n_samples_and_usage(llm):
    [result] = llm.generate("Tell me a story", SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=5, ignore_eos=True))
    assert [o.index for o in result.outputs] == [0, 1]
    assert result.usage.completion_tokens == 12
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
