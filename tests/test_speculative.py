"""Speculative decoding (prompt lookup): the proposer's search, the rejection sampler's distribution against
exact probabilities, greedy outputs token-identical with and without speculation on the default model
(alone and mixed with requests that cannot speculate), and exact block accounting afterwards."""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.spec_decode.rejection_sampler import verify
from tinyserve.engine.loop.request import Request
from tinyserve.engine.sampling.sampler import Sampler
from tinyserve.engine.spec_decode.speculative import ngram_proposal
from tinyserve.loader.model_loader import LoadedModel
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.types import FinishReason, SamplingParams


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3,
                          disable_by_batch_size=None)
# the model itself is passed to the engine (`draft=`); the name only satisfies the config
DRAFT = SpeculativeConfig(method="draft", draft_model="test-draft", num_speculative_tokens=4,
                          disable_by_batch_size=None)
COPY_TEXT = ("The committee approved the budget for the new library on Tuesday, and the mayor said the "
             "library would open next spring. ")


def test_ngram_proposal_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # suffix [2, 3] occurs at 1 and 5: the latest (5) is followed by 7, 5
    assert ngram_proposal(tokens, 1, 3, 2) == [7, 5]
    # the longest suffix wins: [5, 2, 3] never occurred, [2, 3] did
    assert ngram_proposal(tokens, 2, 3, 4) == [7, 5, 2, 3]
    assert ngram_proposal([4, 5, 6], 1, 3, 4) == []  # no earlier occurrence
    assert ngram_proposal([4, 4, 4], 1, 2, 3) == [4]  # overlapping occurrence; what follows it ends the sequence
    assert ngram_proposal(tokens, 1, 3, 0) == []


def test_ngram_proposal_matches_whole_tokens_only():
    # 256 and 1 share bytes across a token boundary as int32: b"\x00\x01\x00\x00" + b"\x01\x00\x00\x00"
    tokens = [256, 1, 8, 65536, 1]
    assert ngram_proposal(tokens, 1, 1, 1) == [8]  # [1] at index 1, never inside 65536 or 256


def _requests(params: SamplingParams, count: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], params) for i in range(count)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9)])
def test_verify_gives_each_position_the_targets_exact_distribution(params):
    """20,000 sequences each propose the same two tokens (a point mass: each row's second most likely). The
    first emitted token must follow p_1 and, when the first proposal was kept, the second p_2: a rule that
    accepts too often or draws the wrong residual cannot pass."""
    vocab, count = 6, 20_000
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(3, vocab, generator=gen) * 1.5  # p_1, p_2, p_3
    probs = _processed_probs(rows, params)
    proposal = probs[:2].argsort(dim=-1, descending=True)[:, 1].tolist()
    out = verify(Sampler(seed=0), rows.repeat(count, 1), _requests(params, count), [proposal] * count)
    firsts = torch.tensor([ids[0] for ids in out.token_ids])
    _assert_follows(torch.bincount(firsts, minlength=vocab), probs[0])
    seconds = torch.tensor([ids[1] for ids in out.token_ids if ids[0] == proposal[0]])
    assert len(seconds) > 1000
    _assert_follows(torch.bincount(seconds, minlength=vocab), probs[1])
    assert all(len(ids) == n + 1 for ids, n in zip(out.token_ids, out.num_accepted))


def _processed_probs(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution per row, by the plain (non-speculative) path's own processing."""
    from tinyserve.engine.sampling.sampler import process_logits

    return process_logits(rows, _requests(params, rows.shape[0])).softmax(dim=-1)


def _assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Tokens of probability 0 never emitted; the rest pass a chi-square test at p = 0.01, categories with
    fewer than 5 expected pooled into one."""
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"a token of probability 0 was emitted: {counts.tolist()}"
    expected = probs[kept].double() / probs[kept].sum() * counts.sum()
    observed = counts[kept].double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < _chi2_critical_p01(len(expected) - 1), f"chi2={statistic:.1f}, counts={counts.tolist()}"


def _chi2_critical_p01(dof: int) -> float:
    """The chi-square quantile at 0.99 by Wilson-Hilferty (within 1% of the tables from 3 degrees up)."""
    z = 2.3263  # the standard normal's 0.99 quantile
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_verify_greedy_accepts_while_the_argmax_agrees():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 3.0]])
    greedy = SamplingParams(temperature=0.0)
    out = verify(Sampler(), logits, _requests(greedy, 1), [[1, 2]])
    assert out.token_ids == [[1, 0]] and out.num_accepted == [1]  # 1 kept; row 2's argmax 0 replaces 2
    out = verify(Sampler(), logits[[0, 1]], _requests(greedy, 1), [[1]])
    assert out.token_ids == [[1, 0]] and out.num_accepted == [1]  # all kept: the next row's argmax follows


def _engine(loaded: LoadedModel, speculative: SpeculativeConfig | None = None, num_blocks: int = 256,
            draft: LoadedModel | None = None, **scheduler) -> LLMEngine:
    if draft is not None:
        speculative = DRAFT
    config = EngineConfig(cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 512,
                                                       "max_model_len": 1024, **scheduler}),
                          speculative=speculative or SpeculativeConfig())
    return LLMEngine(config, loaded=loaded, draft=draft)


def _noisy_copy(loaded: LoadedModel, scale: float, seed: int = 0) -> LoadedModel:
    """A draft model: the target's weights plus gaussian noise of `scale` times each tensor's std, so that its
    guesses agree with the target often, not always (rejections and roll-backs happen)."""
    model = copy.deepcopy(loaded.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * param.float().std() * scale)
    return replace(loaded, model=model)


def _run(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> dict[int, tuple[list[int], str, object]]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    results: dict[int, tuple[list[int], str, object]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, text, _ = results.get(int(out.request_id), ([], "", None))
            results[int(out.request_id)] = (ids + out.new_token_ids, text + out.new_text, out.finish_reason)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "leaked KV blocks"
    bm.check_invariants()
    return results


def _copy_prompts(tokenizer) -> list[str]:
    return [f"Repeat this exactly: {COPY_TEXT * 2}\nRepeated: {COPY_TEXT[:40]}",
            f"{COPY_TEXT}{COPY_TEXT}{COPY_TEXT[:60]}",
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
            "one two three four five six seven one two three four five six seven one two"]


def test_greedy_outputs_are_token_identical_with_and_without_speculation(smollm2_loaded):
    prompts = _copy_prompts(smollm2_loaded.tokenizer)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain_engine, engine = _engine(smollm2_loaded), _engine(smollm2_loaded, NGRAM)
    plain = _run(plain_engine, prompts, [greedy] * len(prompts))
    speculated = _run(engine, prompts, [greedy] * len(prompts))
    assert {i: r[0] for i, r in speculated.items()} == {i: r[0] for i, r in plain.items()}
    assert all(len(r[0]) == 64 for r in speculated.values())
    stats = engine.proposer.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert engine.num_steps < plain_engine.num_steps  # accepted runs took fewer steps

    # mixed in a batch with requests that cannot speculate (a repetition penalty) or are sampled
    others = [SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=24, ignore_eos=True)]
    mixed_params = [greedy] * len(prompts) + others
    mixed = _run(_engine(smollm2_loaded, NGRAM), prompts + prompts[:2], mixed_params)
    alone = _run(_engine(smollm2_loaded), prompts[:2], others)
    assert [mixed[i][0] for i in range(len(prompts))] == [plain[i][0] for i in range(len(prompts))]
    assert mixed[len(prompts)][0] == alone[0][0]  # never proposes, so its greedy tokens are the plain ones


@pytest.mark.reliability  # ~100 s: the draft is as large as the target here (the tiny-model tests below run by default)
def test_draft_model_greedy_outputs_are_token_identical_and_both_pools_end_free(smollm2_loaded):
    """A draft that agrees with the target often but not always (its weights plus noise): outputs equal plain
    decoding's, alone and mixed with requests that cannot speculate; rejected guesses were rolled back."""
    prompts = _copy_prompts(smollm2_loaded.tokenizer)[1:3] + ["The capital of France is"]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # the 64 tokens
    others = [SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=24, ignore_eos=True)]
    mixed_prompts, mixed_params = prompts + prompts[:2], [greedy] * len(prompts) + others
    plain = _run(_engine(smollm2_loaded), mixed_prompts, mixed_params)  # the engine is batch-invariant
    draft = _noisy_copy(smollm2_loaded, scale=0.15)
    for engine, count in ((_engine(smollm2_loaded, draft=draft), len(prompts)),
                          (_engine(smollm2_loaded, draft=draft), len(mixed_prompts))):
        speculated = _run(engine, mixed_prompts[:count], mixed_params[:count])
        greedy_ids = range(min(count, len(prompts) + 1))  # not the sampled one: same distribution, other draws
        assert [speculated[i][0] for i in greedy_ids] == [plain[i][0] for i in greedy_ids]
        stats = engine.proposer.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # some guesses kept, some rolled back
        assert engine.proposer.num_free_blocks == engine.block_manager.num_blocks  # the draft's pool is free too


@pytest.mark.parametrize("fields", [{"method": "draft"}, {"draft_model": "m"}, {"method": "ngram", "draft_model": "m"},
                                    {"method": "draft", "draft_model": "m", "draft_quantization": "int3"}])
def test_draft_settings_come_together_or_not_at_all(fields):
    with pytest.raises(ValueError, match="draft"):
        SpeculativeConfig(**fields)


def test_draft_model_must_share_the_targets_tokenizer(smollm2_loaded, tiny_loaded):
    with pytest.raises(ValueError, match="does not share the tokenizer"):
        _engine(smollm2_loaded, draft=tiny_loaded)


def test_stop_conditions_hold_at_token_granularity_inside_an_accepted_run(smollm2_loaded):
    """A copy-heavy prompt accepts long runs: max_tokens, a stop string and a stop token id must still end
    the output exactly where plain decoding ends it."""
    prompt = _copy_prompts(smollm2_loaded.tokenizer)[1]
    base = _run(_engine(smollm2_loaded), [prompt], [SamplingParams(temperature=0.0, max_tokens=40)])[0]
    text, ids = base[1], base[0]
    stop_string = text[len(text) // 2 : len(text) // 2 + 5]
    cases = [SamplingParams(temperature=0.0, max_tokens=13),
             SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_string]),
             SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids[17]]),
             SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)]
    for params in cases:
        plain = _run(_engine(smollm2_loaded), [prompt], [params])[0]
        speculated = _run(_engine(smollm2_loaded, NGRAM), [prompt], [params])[0]
        assert speculated == plain, params


def test_logprobs_come_one_per_token_from_the_raw_logits(smollm2_loaded):
    prompt = _copy_prompts(smollm2_loaded.tokenizer)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True)
    logprobs = {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        engine = _engine(smollm2_loaded, spec)
        engine.add_request("0", prompt, params)
        entries = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.logprobs is None or len(out.logprobs) == len(out.new_token_ids)
                entries += out.logprobs or []
        logprobs[name] = entries
    assert [e.token_id for e in logprobs["ngram"]] == [e.token_id for e in logprobs["plain"]]
    for a, b in zip(logprobs["ngram"], logprobs["plain"]):
        assert abs(a.logprob - b.logprob) < 1e-3 and [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.fixture(scope="module")
def tiny_loaded(word_tokenizer) -> LoadedModel:
    config = ModelConfig(architecture="llama", vocab_size=48, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                         max_position_embeddings=512, norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return LoadedModel(model.eval().requires_grad_(False), config, word_tokenizer(48), Path("tiny-spec-llama"))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_blocks_and_prefix_cache_stay_exact_after_200_mixed_requests(tiny_loaded, method):
    """200 requests (greedy and sampled, some that cannot propose, shared prefixes, n > 1): every block is
    free with zero ref counts afterwards, and the same requests with the prefix cache hot give the same
    greedy tokens with speculation on and off."""
    draft = _noisy_copy(tiny_loaded, scale=0.3) if method == "draft" else None
    spec = NGRAM if method == "ngram" else None
    rng = random.Random(3)
    prefix = [rng.randrange(48) for _ in range(40)]
    prompts = [prefix[: rng.randint(17, 40)] + [rng.randrange(8) for _ in range(rng.randint(1, 30))]
               for _ in range(200)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True) if i % 3 == 0
              else SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 40), n=1 + i % 2, ignore_eos=True)
              if i % 3 == 1 else SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2,
                                                ignore_eos=True)
              for i in range(200)]
    engine = _engine(tiny_loaded, spec, draft=draft, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=512)
    _run(engine, prompts, params)
    assert all(engine.block_manager.ref_count(b) == 0 for b in range(engine.block_manager.num_blocks))
    assert engine.proposer.stats.num_accepted_tokens > 0
    if draft is not None:
        assert engine.proposer.num_free_blocks == engine.block_manager.num_blocks
    greedy = [i for i in range(200) if i % 3 == 0]
    results = {}
    for name, on in (("off", False), ("on", True)):
        engine = _engine(tiny_loaded, spec if on else None, draft=draft if on else None, max_num_seqs=32,
                         max_num_batched_tokens=256, max_model_len=512)
        for _ in range(2):  # the second pass reads the prefix cache the first one filled
            results[name] = _run(engine, [prompts[i] for i in greedy], [params[i] for i in greedy])
        assert engine.block_manager.prefix_stats.num_hit_tokens > 0
    assert {i: r[0] for i, r in results["on"].items()} == {i: r[0] for i, r in results["off"].items()}


def test_a_short_draft_pool_costs_proposals_never_tokens(tiny_loaded):
    """A pool that cannot hold every sequence (the target preempts, the draft gives blocks back or drafts
    nothing): greedy outputs equal plain decoding's, and both pools end free."""
    rng = random.Random(8)
    prompts = [[rng.randrange(48) for _ in range(rng.randint(20, 60))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * len(prompts)
    plain = _run(_engine(tiny_loaded, num_blocks=24, max_model_len=256), prompts, params)
    engine = _engine(tiny_loaded, num_blocks=24, draft=_noisy_copy(tiny_loaded, scale=0.3), max_model_len=256)
    assert {i: r[0] for i, r in _run(engine, prompts, params).items()} == {i: r[0] for i, r in plain.items()}
    assert engine.scheduler.num_preemptions > 0 and engine.proposer.stats.num_drafts > 0
    assert engine.proposer.num_free_blocks == engine.block_manager.num_blocks


def test_a_failing_draft_model_costs_proposals_never_requests(tiny_loaded, monkeypatch):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2
    plain = _run(_engine(tiny_loaded, max_model_len=256), prompts, params)
    engine = _engine(tiny_loaded, draft=_noisy_copy(tiny_loaded, scale=0.3), max_model_len=256)
    forward = engine.proposer._forward
    calls = []

    def fails_every_third_call(feeds):
        calls.append(len(feeds))
        if len(calls) % 3 == 2:
            raise RuntimeError("draft fault")
        return forward(feeds)

    monkeypatch.setattr(engine.proposer, "_forward", fails_every_third_call)
    out = _run(engine, prompts, params)
    assert {i: r[0] for i, r in out.items()} == {i: r[0] for i, r in plain.items()}
    assert all(r[2] is FinishReason.LENGTH for r in out.values())
    assert len(calls) > 3 and engine.proposer.stats.num_drafts > 0
    assert engine.proposer.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_engine_draws_match_the_targets_probabilities_with_speculation(tiny_loaded, method):
    """Sampled at temperature 1 through the engine: the second output token (the first comes from the
    prefill, which never proposes), conditioned on the most frequent first token, against the target's
    exact softmax for that context. The prompt holds every token once, so any first token finds an n-gram
    (its own earlier occurrence) and every second token is drawn through verification."""
    prompt = random.Random(5).sample(range(48), 48)
    count = 20_000
    draft = _noisy_copy(tiny_loaded, scale=0.3) if method == "draft" else None
    engine = _engine(tiny_loaded, NGRAM, num_blocks=1024, draft=draft, max_num_seqs=128, max_num_batched_tokens=2048,
                     max_model_len=512)  # blocks for all 128: a proposal never waits for one
    results = _run(engine, [prompt] * count, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)] * count)
    firsts = Counter(ids[0] for ids, _, _ in results.values())
    first = max(firsts, key=firsts.get)
    seconds = torch.tensor([ids[1] for ids, _, _ in results.values() if ids[0] == first])
    assert len(seconds) >= 1000, firsts
    assert engine.proposer.stats.num_drafts == count  # every second token was verified
    probs = _reference_logits(tiny_loaded, torch.tensor(prompt + [first])).softmax(dim=-1)
    _assert_follows(torch.bincount(seconds, minlength=48), probs)


def _reference_logits(loaded: LoadedModel, token_ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits from a plain engine step (no speculation) over the whole context."""
    engine = _engine(loaded, max_model_len=512)
    engine.add_request("ref", token_ids.tolist(), SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
    rows = []
    original = engine.runner.sampler

    class Recorder:
        def __call__(self, logits, requests, token_masks=None):
            rows.append(logits[0].float().clone())
            return original(logits, requests, token_masks)

        def __getattr__(self, name):
            return getattr(original, name)

    engine.runner.sampler = Recorder()
    while engine.has_unfinished_requests():
        engine.step()
    return rows[0]


def test_metrics_and_bench_report_the_acceptance():
    """/metrics exposes vLLM's counters (per position too); the bench client reads them back."""
    from tinyserve.bench.serve import _spec_decode_over_run
    from tinyserve.engine.observability.stats import EngineStats, LoopStats, SpecDecodeStats
    from tinyserve.server.observability.metrics import ServerMetrics

    spec = SpecDecodeStats(num_speculative_tokens=3)
    spec.count(3, 2)
    spec.count(2, 0)
    stats = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.1, num_free_blocks=9, num_blocks=10,
                        num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, num_steps=2, spec_decode=spec)
    loop = LoopStats(num_steps=2, step_seconds=0.1, overhead_seconds=0.0, max_gap_seconds=0.0)
    text = ServerMetrics("m", 128, lambda: stats, lambda: loop).render().decode()
    assert 'tinyserve:spec_decode_num_drafts_total{model_name="m"} 2.0' in text
    assert 'tinyserve:spec_decode_num_draft_tokens_total{model_name="m"} 5.0' in text
    assert 'tinyserve:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0' in text
    assert 'tinyserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert spec.acceptance_rate == 0.4 and spec.mean_accepted_length == 2.0
    run = _spec_decode_over_run({"num_drafts": 1.0, "num_draft_tokens": 3.0, "num_accepted_tokens": 2.0},
                                {"num_drafts": 5.0, "num_draft_tokens": 19.0, "num_accepted_tokens": 10.0})
    assert run["acceptance_rate"] == 0.5 and run["mean_accepted_length"] == 3.0
