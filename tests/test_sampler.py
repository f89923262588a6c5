"""Sampler tests: distributions by chi-square, processors against transformers' and OpenAI's formulas,
seeded reproducibility across batches, logprobs, min_tokens. All draws are seeded, so runs are identical."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tinyserve.engine.loop.request import Request
from tinyserve.engine.sampling.sampler import Sampler, _never_a_cut_token, process_logits, prompt_token_logprobs
from tinyserve.request_limits import RequestLimits
from tinyserve.types import SamplingParams

LIMITS = RequestLimits()
MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS = LIMITS.max_logit_bias, LIMITS.max_stop_string_chars
MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS = LIMITS.max_stop_strings, LIMITS.max_stop_token_ids

# chi-square critical values at p = 0.001, by degrees of freedom (standard tables)
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
                      8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123}

# 12-token logits with no ties; the cuts below fall well inside gaps between probabilities
SMALL_LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0])
NUM_DRAWS = 30_000


def make_request(params: SamplingParams, prompt=(1, 2, 3), output=(), request_id="r", **kwargs) -> Request:
    return Request(request_id, list(prompt), params, output_token_ids=list(output), **kwargs)


def draw_counts(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[vocab] counts of NUM_DRAWS draws: one batch of identical rows, in two calls."""
    sampler, counts = Sampler(seed=0), torch.zeros(logits_row.numel(), dtype=torch.int64)
    for _ in range(2):
        requests = [make_request(params, request_id=str(i)) for i in range(NUM_DRAWS // 2)]
        ids = sampler(logits_row.repeat(len(requests), 1), requests).next_token_ids
        counts += torch.bincount(torch.tensor(ids), minlength=logits_row.numel())
    return counts


def assert_draws_follow(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Excluded tokens (probability 0) never drawn; the rest pass a chi-square test at p = 0.001."""
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"excluded tokens drawn: {counts.tolist()}"
    expected = probs[kept].double() / probs[kept].sum() * counts.sum()
    assert expected.min() >= 5, "too few draws for a chi-square test"
    statistic = float(((counts[kept] - expected) ** 2 / expected).sum())
    critical = CHI2_CRITICAL_P001[int(kept.sum()) - 1]
    assert statistic < critical, f"chi2={statistic:.1f}, counts={counts.tolist()}"


def reference_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p (written as a plain loop)."""
    kept, mass = torch.zeros_like(probs), 0.0
    for i in probs.argsort(descending=True).tolist():
        if mass >= top_p:
            break
        kept[i], mass = probs[i], mass + float(probs[i])
    return kept


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0),
                                          ("top_k", 0), ("min_p", 1.5), ("repetition_penalty", 0.0),
                                          ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                          ("logprobs", -1), ("logprobs", 21), ("seed", -1)])
def test_invalid_params_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):  # logprobs 21: past the default limits' cap of 20
        LIMITS.check_sampling(SamplingParams(**{field: value}))


def test_temperature_draws_follow_softmax():
    counts = draw_counts(SMALL_LOGITS, SamplingParams(temperature=0.7))
    assert_draws_follow(counts, torch.softmax(SMALL_LOGITS / 0.7, dim=0))


def test_seeded_rows_draw_from_the_same_distribution():
    params = [SamplingParams(temperature=1.2, seed=seed) for seed in range(6000)]
    requests = [make_request(p, request_id=str(p.seed)) for p in params]
    ids = Sampler()(SMALL_LOGITS.repeat(len(requests), 1), requests).next_token_ids
    counts = torch.bincount(torch.tensor(ids), minlength=SMALL_LOGITS.numel())
    assert_draws_follow(counts, torch.softmax(SMALL_LOGITS / 1.2, dim=0))


def test_top_k_draws_follow_renormalized_top_k():
    probs = torch.softmax(SMALL_LOGITS, dim=0)
    probs[4:] = 0  # logits are sorted descending
    assert_draws_follow(draw_counts(SMALL_LOGITS, SamplingParams(top_k=4)), probs)


def test_top_k_then_top_p_then_min_p_draws_follow_the_cuts_in_order():
    """top-k 6 renormalised, then top-p 0.8 of that, then min-p 0.4 of what is left (the candidate path)."""
    probs = torch.softmax(SMALL_LOGITS, dim=0)
    probs[6:] = 0  # logits are sorted descending
    probs = reference_top_p(probs / probs.sum(), 0.8)
    assert int((probs > 0).sum()) == 4
    probs[probs < 0.4 * probs.max()] = 0
    assert int((probs > 0).sum()) == 3
    params = SamplingParams(top_k=6, top_p=0.8, min_p=0.4)
    assert_draws_follow(draw_counts(SMALL_LOGITS, params), probs)


def test_top_k_keeps_exactly_k_tokens_whatever_the_batch():
    """Tied logits at the k-th: a row keeps exactly its k, even beside a row with a larger k."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]] * 2)
    requests = [make_request(SamplingParams(top_k=2), request_id="a"),
                make_request(SamplingParams(top_k=5), request_id="b")]
    kept = torch.isfinite(process_logits(logits, requests)).sum(dim=-1).tolist()
    assert kept == [2, 5]
    assert torch.isfinite(process_logits(logits[:1], requests[:1])).sum().item() == 2


def test_top_p_draws_follow_nucleus():
    probs = reference_top_p(torch.softmax(SMALL_LOGITS, dim=0), 0.6)
    assert int((probs > 0).sum()) == 3
    assert_draws_follow(draw_counts(SMALL_LOGITS, SamplingParams(top_p=0.6)), probs)


def test_min_p_draws_follow_thresholded_softmax():
    probs = torch.softmax(SMALL_LOGITS, dim=0)
    probs[probs < 0.2 * probs.max()] = 0
    assert int((probs > 0).sum()) == 5
    assert_draws_follow(draw_counts(SMALL_LOGITS, SamplingParams(min_p=0.2)), probs)


def test_greedy_is_argmax_for_any_float_dtype():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    requests = [make_request(SamplingParams(temperature=0.0), request_id=str(i)) for i in range(6)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler()(logits.to(dtype), requests)
        assert out.next_token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 6


def test_greedy_rows_in_a_sampling_batch_take_the_processed_argmax():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    params = [greedy, SamplingParams(top_p=0.9)] * 2
    requests = [make_request(p, output=[7, 8], request_id=str(i)) for i, p in enumerate(params)]
    ids = Sampler()(logits, requests).next_token_ids
    expected = process_logits(logits, requests).argmax(dim=-1).tolist()
    assert [ids[0], ids[2]] == [expected[0], expected[2]]


def test_caller_logits_are_not_modified():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = SamplingParams(top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3, logit_bias={3: 5.0})
    Sampler()(logits, [make_request(params, output=[4], request_id=str(i)) for i in range(3)])
    assert torch.equal(logits, before)


def transformers_reference(logits_row: torch.Tensor, request: Request) -> torch.Tensor:
    """One row through transformers' processors in generate()'s order; bias and OpenAI penalties by hand."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    p = request.sampling_params
    scores = logits_row.clone()[None]  # [1, vocab]
    for token_id, bias in (p.logit_bias or {}).items():
        scores[0, token_id] += bias
    input_ids = torch.tensor([request.all_token_ids])
    blocked = sorted(set(request.eos_token_ids) | set(p.stop_token_ids))
    processors = [
        lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty),
        OpenAIPenalties(request),
        lp.MinNewTokensLengthLogitsProcessor(request.num_prompt_tokens, p.min_tokens, blocked),
        lp.TemperatureLogitsWarper(p.temperature),
        lp.TopKLogitsWarper(p.top_k) if p.top_k else None,
        lp.TopPLogitsWarper(p.top_p) if p.top_p < 1 else None,
        lp.MinPLogitsWarper(p.min_p) if p.min_p > 0 else None,
    ]
    for processor in filter(None, processors):
        scores = processor(input_ids, scores)
    return scores[0]


class OpenAIPenalties:
    """OpenAI's documented formula, token by token over the output tokens."""

    def __init__(self, request: Request) -> None:
        self.request = request

    def __call__(self, input_ids, scores):
        p, scores = self.request.sampling_params, scores.clone()
        for token_id, count in Counter(self.request.output_token_ids).items():
            scores[0, token_id] -= count * p.frequency_penalty + p.presence_penalty
        return scores


def test_processors_match_transformers_and_openai_formula():
    gen = torch.Generator().manual_seed(3)
    vocab = 500
    param_sets = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, temperature=0.5),
        SamplingParams(presence_penalty=0.8, frequency_penalty=-0.4),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.2),
        SamplingParams(temperature=1.3, top_k=40),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(top_k=60, top_p=0.9, min_p=0.02, repetition_penalty=1.1, logit_bias={5: 3.0, 9: -4.0}),
        SamplingParams(min_tokens=16, stop_token_ids=(11,), max_tokens=32),
        SamplingParams(min_tokens=1, temperature=0.6, top_p=0.5, frequency_penalty=0.3),
    ]
    requests = [
        make_request(p, prompt=torch.randint(0, vocab, (30,), generator=gen).tolist(),
                     output=torch.randint(0, vocab, (12,), generator=gen).tolist(), request_id=str(i),
                     eos_token_ids=frozenset({2, 4}))
        for i, p in enumerate(param_sets)
    ]
    requests[-1].output_token_ids.clear()  # under min_tokens with no output yet
    logits = torch.randn(len(requests), vocab, generator=gen) * 3
    ours = process_logits(logits, requests)
    for i, request in enumerate(requests):
        expected = transformers_reference(logits[i], request)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(expected)), f"row {i}: different cut"
        finite = torch.isfinite(expected)
        torch.testing.assert_close(ours[i][finite], expected[finite], rtol=1e-5, atol=1e-5)
    assert torch.isinf(ours[8, [2, 4, 11]]).all() and torch.isinf(ours[9, [2, 4]]).all()


def test_logit_bias_is_added_and_steers_greedy():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(4)).repeat(2, 1)
    first, second = logits[0].topk(2).indices.tolist()
    requests = [make_request(SamplingParams(temperature=0.0, logit_bias={17: 100.0})),
                make_request(SamplingParams(temperature=0.0, logit_bias={first: -100.0}), request_id="b")]
    assert Sampler()(logits, requests).next_token_ids == [17, second]
    expected = logits.clone()
    expected[0, 17] += 100.0
    expected[1, first] -= 100.0
    torch.testing.assert_close(process_logits(logits, requests), expected)


def test_logit_bias_excludes_tokens_from_sampling():
    params = SamplingParams(logit_bias={0: -100.0, 1: -100.0})
    counts = draw_counts(SMALL_LOGITS, params)
    probs = torch.softmax(SMALL_LOGITS, dim=0)
    probs[:2] = 0
    assert_draws_follow(counts, probs)


def test_a_draw_landing_on_a_zero_probability_step_takes_the_argmax():
    """A parallel scan (CUDA) can leave a cut token's CDF a rounding step below its predecessor's: a
    target there must not pick it. Row 0 drew its cut token 1 (CDF dips 0.5 -> 0.4999), row 1 a real one."""
    cdf = torch.tensor([[0.5, 0.4999, 1.0], [0.2, 0.7, 1.0]])
    logits = torch.tensor([[1.0, float("-inf"), 1.0], [0.0, 1.0, 0.5]])
    ids = _never_a_cut_token(cdf, torch.tensor([[1], [1]]), logits)
    assert ids.squeeze(1).tolist() == [0, 1]
    assert _never_a_cut_token(cdf, torch.tensor([[0], [2]]), logits).squeeze(1).tolist() == [0, 2]


def test_logprobs_match_raw_log_softmax_and_top_k_order():
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(logprobs=5, logit_bias={0: 50.0}), SamplingParams(),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(top_p=0.5, logprobs=20)]
    requests = [make_request(p, request_id=str(i)) for i, p in enumerate(params)]
    out = Sampler()(logits, requests)
    raw = torch.log_softmax(logits, dim=-1)  # before bias and every other processor
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        entry, k = out.logprobs[i], params[i].logprobs
        assert entry.token_id == out.next_token_ids[i]
        assert math.isclose(entry.logprob, float(raw[i, entry.token_id]), abs_tol=1e-6)
        values, indices = raw[i].topk(k)
        assert [t for t, _ in entry.top] == indices.tolist()
        assert all(math.isclose(lp, float(v), abs_tol=1e-6) for (_, lp), v in zip(entry.top, values))
    assert out.logprobs[2].top == () and out.next_token_ids[2] == int(logits[2].argmax())
    assert out.next_token_ids[0] == 0  # bias +50 wins the draw, yet the logprob stays the raw one


def test_prompt_token_logprobs_give_each_rows_token_its_rank_and_the_top_k():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(9))
    token_ids = [7, 0, 299, int(logits[3].argmax()), 42]
    scored = prompt_token_logprobs(logits, token_ids, 3)
    probs = torch.softmax(logits.double(), dim=-1)
    for row, (entry, token_id) in enumerate(zip(scored, token_ids)):
        assert entry.token_id == token_id
        assert math.isclose(entry.logprob, math.log(float(probs[row, token_id])), abs_tol=1e-5)
        assert entry.rank == 1 + sum(float(p) > float(probs[row, token_id]) for p in probs[row])  # by definition
        assert [t for t, _ in entry.top] == sorted(range(300), key=lambda t: -float(probs[row, t]))[:3]
    assert scored[3].rank == 1 and scored[3].top[0] == (token_ids[3], scored[3].logprob)
    assert [e.top for e in prompt_token_logprobs(logits[:2].bfloat16(), token_ids[:2], 0)] == [(), ()]


def run_steps(sampler: Sampler, target: Request, others: list[Request], row: int, num_steps: int = 8):
    """Samples target for num_steps, at the given row among others; its logits depend only on the step."""
    for step in range(num_steps):
        batch = others[:row] + [target] + others[row:]
        noise_gen = torch.Generator().manual_seed(100 + len(batch) + step)
        logits = torch.randn(len(batch), 1000, generator=noise_gen)
        logits[row] = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        out = sampler(logits, batch)
        for request, token_id in zip(batch, out.next_token_ids):
            request.output_token_ids.append(token_id)
    return target.output_token_ids


@pytest.mark.parametrize("cuts", [{}, {"top_k": 40, "top_p": 0.95, "min_p": 0.05}, {"top_p": 0.9}])
def test_seeded_request_is_reproducible_whatever_the_batch(cuts):
    def target(seed=42):
        return make_request(SamplingParams(temperature=1.0, seed=seed, **cuts), request_id="target")

    alone = run_steps(Sampler(seed=0), target(), [], row=0)
    other_params = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.0),
                    SamplingParams(top_p=0.8, top_k=30, repetition_penalty=1.2)]
    others = [make_request(p, request_id=f"other{i}") for i, p in enumerate(other_params)]
    in_batch = run_steps(Sampler(seed=123), target(), others, row=2)
    last_row = run_steps(Sampler(seed=5), target(), others[:3], row=3)
    assert alone == in_batch == last_row
    assert run_steps(Sampler(seed=0), target(seed=43), [], row=0) != alone


def test_a_dropped_generator_restarts_a_seeded_stream():
    """The generator lives on the request (LLMEngine._end_request drops it): a new one starts from the seed."""
    sampler, logits = Sampler(), torch.zeros(1, 1000)
    request = make_request(SamplingParams(seed=9))
    first = [sampler(logits, [request]).next_token_ids[0] for _ in range(2)]
    assert request.generator is not None
    request.generator = None
    assert sampler(logits, [request]).next_token_ids[0] == first[0] != first[1]


def test_seeded_siblings_differ():
    params = SamplingParams(n=2, seed=3)
    siblings = [make_request(params, request_id=f"r-{i}", index=i) for i in range(2)]
    logits = torch.zeros(2, 1000)
    sampler = Sampler()
    draws = [sampler(logits, siblings).next_token_ids for _ in range(4)]
    assert [d[0] for d in draws] != [d[1] for d in draws]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, 50)
    logits[:, 3] = 10.0  # EOS
    logits[:, 5] = 9.0  # stop token id
    logits[:, 8] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(5,))
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(5,), ignore_eos=True)
    requests = [make_request(params, request_id="a", eos_token_ids=frozenset({3})),
                make_request(ignore, request_id="b", eos_token_ids=frozenset({3})),
                make_request(params, output=[1, 1], request_id="c", eos_token_ids=frozenset({3}))]
    assert Sampler()(logits, requests).next_token_ids == [8, 3, 3]


def test_min_tokens_excludes_eos_from_sampling():
    logits = SMALL_LOGITS.repeat(4000, 1)
    params = SamplingParams(min_tokens=3, stop_token_ids=(1,))
    requests = [make_request(params, request_id=str(i), eos_token_ids=frozenset({0})) for i in range(4000)]
    ids = Sampler()(logits, requests).next_token_ids
    assert 0 not in ids and 1 not in ids and len(set(ids)) > 5


@pytest.mark.parametrize("kwargs, field", [
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
])
def test_caps_and_ranges_name_the_field_first(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        LIMITS.check_sampling(SamplingParams(**kwargs))


def test_caps_admit_their_limits():
    params = SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                            stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                            logit_bias={str(i): -1 for i in range(MAX_LOGIT_BIAS)})
    assert params.stop_token_id_set == frozenset(range(MAX_STOP_TOKEN_IDS))
    assert params.logit_bias_ids == tuple(range(MAX_LOGIT_BIAS)) and set(params.logit_bias_values) == {-1.0}
    LIMITS.check_sampling(params)


def test_stop_ids_outside_the_vocab_mask_nothing():
    """Validation refuses them; one that got past it (a bug upstream) must not fail the batch."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=(7,))
    object.__setattr__(params, "stop_token_id_set", frozenset({7, -1_000_000_000, 50, 10**12}))
    requests = [make_request(params, request_id="a"), make_request(SamplingParams(temperature=0.0), request_id="b")]
    expected = logits.clone()
    expected[0, 7] = float("-inf")
    torch.testing.assert_close(process_logits(logits, requests), expected)
    assert Sampler()(logits, requests).next_token_ids == expected.argmax(dim=-1).tolist()


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=2.3e-294, seed=1),
                                    SamplingParams(temperature=1e-300, seed=1)], ids=["penalty", "temperature"])
def test_a_divisor_below_float32_s_range_keeps_masked_tokens_out(params):
    """A penalty or temperature that rounds to 0 in float32 made a masked (-inf) seen logit NaN, and the row drew
    it (the gRPC fuzz: a token its grammar forbids); a divided logit past float32's range must not be +inf."""
    logits = torch.tensor([[3.0, -2.0, float("-inf"), 1.0, float("-inf")]])
    request = make_request(params, prompt=(0, 1, 2, 3))  # seen: the allowed tokens and a masked one
    processed = process_logits(logits, [request])
    assert not processed.isnan().any() and not (processed == float("inf")).any()
    assert processed[0, 2] == float("-inf") and processed[0, 4] == float("-inf")
    assert all(Sampler(seed=s)(logits, [request]).next_token_ids[0] in (0, 1, 3) for s in range(20))
