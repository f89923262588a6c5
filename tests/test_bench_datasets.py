"""Dataset generators: lengths within range and exact after re-encoding, seeds reproducible, prefixes shared."""

import json

import numpy as np
import pytest

from tinyserve.bench import BenchError
from tinyserve.bench.config import DatasetConfig, OfflineBenchConfig
from tinyserve.bench.datasets import PromptBuilder, build_requests, length_range, load_tokenizer
from tinyserve.bench.offline import offline_workload


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def builder(tokenizer):
    return PromptBuilder(tokenizer)


def test_length_range():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(3, 0.9) == (1, 6)


def test_word_pool_round_trips_exactly(builder, tokenizer):
    assert builder.is_exact
    rng = np.random.default_rng(0)
    for n in (1, 7, 300):
        assert len(tokenizer.encode(builder.text(rng, n), add_special_tokens=False)) == n


def test_random_lengths_within_range_and_counted_by_reencoding(tokenizer):
    config = DatasetConfig(num_prompts=64, input_len=100, output_len=40, range_ratio=0.5, seed=3)
    requests = build_requests(config, tokenizer)
    assert len(requests) == 64
    for r in requests:
        assert 50 <= r.prompt_len <= 150
        assert 20 <= r.output_len <= 60
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
    assert len({r.prompt_len for r in requests}) > 10  # lengths really vary
    fixed = build_requests(DatasetConfig(num_prompts=8, input_len=33, output_len=5), tokenizer)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(33, 5)}


def test_seeds_reproducible(tokenizer):
    config = DatasetConfig(num_prompts=16, input_len=50, range_ratio=0.3, seed=7)
    assert build_requests(config, tokenizer) == build_requests(config, tokenizer)
    other = DatasetConfig(num_prompts=16, input_len=50, range_ratio=0.3, seed=8)
    assert [r.prompt for r in build_requests(other, tokenizer)] != [r.prompt for r in build_requests(config, tokenizer)]


def test_random_shared_prefix_is_shared(tokenizer):
    config = DatasetConfig(num_prompts=10, input_len=20, prefix_len=64, seed=1)
    requests = build_requests(config, tokenizer)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    assert len({tuple(i[:64]) for i in ids}) == 1  # the same 64 token ids open every prompt
    assert len({tuple(i[64:]) for i in ids}) == 10
    assert all(r.prompt_len == 84 for r in requests)


def test_prefix_repetition_groups(tokenizer):
    config = DatasetConfig(name="prefix-repetition", num_prompts=20, num_prefixes=4, prefix_len=48,
                           input_len=16, output_len=8, seed=2)
    requests = build_requests(config, tokenizer)
    assert len(requests) == 20 and all(r.prompt_len == 64 and r.output_len == 8 for r in requests)
    prefixes = [tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:48]) for r in requests]
    groups = {p: prefixes.count(p) for p in set(prefixes)}
    assert sorted(groups.values()) == [5, 5, 5, 5]  # 4 distinct prefixes, 5 suffixes each
    assert len({r.prompt for r in requests}) == 20


def test_sharegpt_first_exchange_filters_and_fixed_output(tokenizer, tmp_path):
    long_question = "Please explain how paged attention works in detail. " * 3
    data = [
        {"conversations": [{"from": "human", "value": long_question},
                           {"from": "gpt", "value": "It stores keys and values in fixed-size blocks of memory."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend!"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn here at all, only a reply"}]},
        {"messages": [{"role": "user", "content": "What is the capital of France, please?"},
                      {"role": "assistant", "content": "The capital of France is Paris, of course."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = build_requests(DatasetConfig(name="sharegpt", path=str(path), num_prompts=10), tokenizer)
    prompts = sorted(r.prompt for r in requests)
    assert prompts == sorted([long_question, "What is the capital of France, please?"])  # "Hi" is too short
    reply = {r.prompt: r.output_len for r in requests}
    assert reply[long_question] == len(tokenizer.encode("It stores keys and values in fixed-size blocks of memory.",
                                                        add_special_tokens=False))
    fixed = build_requests(DatasetConfig(name="sharegpt", path=str(path), num_prompts=1, output_len=9), tokenizer)
    assert len(fixed) == 1 and fixed[0].output_len == 9
    with pytest.raises(BenchError, match="cannot read"):
        build_requests(DatasetConfig(name="sharegpt", path=str(tmp_path / "missing.json")), tokenizer)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="range_ratio"):
        DatasetConfig(range_ratio=1.0)
    with pytest.raises(ValueError, match="num_prefixes"):
        DatasetConfig(name="prefix-repetition", prefix_len=8, num_prompts=2, num_prefixes=3)
    with pytest.raises(ValueError, match="dataset-path"):
        DatasetConfig(name="sharegpt")
    with pytest.raises(ValueError, match="input_len_range"):
        OfflineBenchConfig(input_len_range=(10, 5))


def test_offline_workload_lengths_and_seed():
    config = OfflineBenchConfig(num_prompts=50, input_len_range=(64, 512), output_len_range=(32, 256), seed=0)
    workload = offline_workload(config)
    assert workload == offline_workload(config)
    assert all(64 <= len(ids) <= 512 and 32 <= n <= 256 and max(ids) < 10_000 for ids, n in workload)
    assert workload != offline_workload(OfflineBenchConfig(num_prompts=50, seed=1))


def test_copy_prompts_hold_a_shipped_passage_and_ask_for_it_back(tokenizer):
    from tinyserve.bench.datasets import COPY_PASSAGES

    passages = [p.strip() for p in COPY_PASSAGES.read_text().split("\n\n") if p.strip()]
    assert len(passages) >= 5
    requests = build_requests(DatasetConfig(name="copy", num_prompts=12, seed=1), tokenizer)
    assert len(requests) == 12
    for r in requests:
        passage = next(p for p in passages if p in r.prompt)  # each prompt embeds one passage whole
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert r.output_len == len(tokenizer.encode(passage, add_special_tokens=False)) + 8  # the passage, copied
    assert build_requests(DatasetConfig(name="copy", num_prompts=12, seed=1), tokenizer) == requests
    assert build_requests(DatasetConfig(name="copy", num_prompts=3, output_len=5), tokenizer)[0].output_len == 5
