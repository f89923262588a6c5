"""The engine on the default model: batch invariance under queueing, chunked prefill and preemption;
prefix caching; n > 1; stop strings; abort; every block free after each test."""

import logging
import random
import threading

import pytest

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.types import FinishReason, SamplingParams

TEXT = (
    "In the beginning the river ran clear and cold through the valley, and the people who lived along its "
    "banks fished, farmed and traded with the towns downstream. def parse(line):\n    key, _, value = "
    "line.partition('=')\n    return key.strip(), value.strip()\n Over the centuries the town grew into a city; "
    "bridges were built, mills turned, and the river carried boats laden with grain, wool and timber. "
    "人们在河边建造房屋。 Records from 1642 show 3,400 residents; by 1890 there were 41,250. "
)


def _engine(loaded, *, num_blocks=256, max_num_seqs=64, budget=512, prefix_caching=True, max_model_len=1024):
    config = EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  max_model_len=max_model_len),
    )
    return LLMEngine(config, loaded=loaded)


def _run(engine, prompts, params_list):
    """Submit all at once, step to the end; returns {request index: (token ids, text, finish reason)}."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, text, _ = results.get((int(out.request_id), out.index), ([], "", None))
            results[(int(out.request_id), out.index)] = (ids + out.new_token_ids, text + out.new_text, out.finish_reason)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    return results


@pytest.fixture(scope="module")
def mixed_workload(smollm2_loaded):
    tokens = smollm2_loaded.tokenizer.encode(TEXT * 8)
    rng = random.Random(7)
    prompts, lengths = [], []
    for _ in range(32):
        n = rng.randint(5, 400)
        start = rng.randint(0, len(tokens) - n)
        prompts.append(tokens[start : start + n])
        lengths.append(rng.randint(1, 16))
    return prompts, lengths


# the seeded half (80 s on 2 cores) runs in CI's reliability pass, keeping the default run under 15 minutes
@pytest.mark.parametrize("sampling", ["greedy", pytest.param("seeded", marks=pytest.mark.reliability)])
def test_batch_invariance_under_queueing_chunking_and_preemption(smollm2_loaded, mixed_workload, sampling):
    prompts, lengths = mixed_workload
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) if sampling == "greedy"
        else SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=1000 + i)
        for i, n in enumerate(lengths)
    ]
    # 30 blocks x 16 = 480 tokens for 32 requests of up to 424 tokens: queueing, 64-token chunks, preemption
    busy = _engine(smollm2_loaded, num_blocks=30, max_num_seqs=8, budget=64, max_model_len=480)
    together = _run(busy, prompts, params)
    assert busy.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone = _run(_engine(smollm2_loaded, num_blocks=30, max_model_len=480), [prompt], [p])
        assert together[(i, 0)][0] == alone[(0, 0)][0], f"request {i} depends on its batch"
        assert len(together[(i, 0)][0]) == lengths[i]


def test_higher_priority_preempts_a_full_batch_and_every_text_matches_its_run_alone(smollm2_loaded):
    tokens = smollm2_loaded.tokenizer.encode(TEXT * 2)
    prompts = [tokens[i * 40 : i * 40 + 30] for i in range(6)]
    low = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    high = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    engine = _engine(smollm2_loaded, max_num_seqs=4)
    for i in range(4):
        engine.add_request(f"low{i}", prompts[i], low, priority=5)
    results: dict[str, list[int]] = {}
    finished: list[str] = []

    def step():
        for out in engine.step():
            results[out.request_id] = results.get(out.request_id, []) + out.new_token_ids
            if out.finished:
                finished.append(out.request_id)

    for _ in range(3):
        step()
    assert engine.scheduler.num_running == 4
    for i in (4, 5):
        engine.add_request(f"high{i}", prompts[i], high, priority=0)
    step()  # the cap is full of worse priorities: the two newest lows give up their seats at once
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"low0", "low1", "high4", "high5"} and engine.scheduler.num_preemptions == 2
    while engine.has_unfinished_requests():
        step()
    assert set(finished[:2]) == {"high4", "high5"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    for request_id, params in [*((f"low{i}", low) for i in range(4)), *((f"high{i}", high) for i in (4, 5))]:
        alone = _run(_engine(smollm2_loaded), [prompts[int(request_id[-1])]], [params])
        assert results[request_id] == alone[(0, 0)][0], f"{request_id} differs from its run alone"


def test_prefix_caching_hits_and_identical_outputs(smollm2_loaded):
    tokens = smollm2_loaded.tokenizer.encode(TEXT * 4)
    prefix = tokens[:300]
    prompts = [prefix + smollm2_loaded.tokenizer.encode(f" Question {i}: what happened next?") for i in range(16)]
    params = [SamplingParams(max_tokens=8, temperature=0.0)] * 16
    outputs = {}
    for caching in (True, False):
        engine = _engine(smollm2_loaded, prefix_caching=caching)
        first = _run(engine, prompts[:1], params[:1])
        before = engine.stats()
        rest = _run(engine, prompts[1:], params[1:])
        outputs[caching] = [first[(0, 0)][0]] + [rest[(i, 0)][0] for i in range(15)]
        if caching:
            after = engine.stats()
            full_prefix_tokens = 300 // 16 * 16
            hits = after.prefix_cache_hits - before.prefix_cache_hits
            assert hits >= 0.9 * 15 * full_prefix_tokens, (hits, 15 * full_prefix_tokens)
    assert outputs[True] == outputs[False]


def test_n_samples_share_prompt_blocks_and_differ(smollm2_loaded):
    engine = _engine(smollm2_loaded, prefix_caching=False)  # so that only a fork can share blocks
    prompt = smollm2_loaded.tokenizer.encode(TEXT)
    engine.add_request("fork", prompt, SamplingParams(n=4, max_tokens=12, ignore_eos=True))
    engine.step()  # the first sample computes the prompt; the others wait for it
    engine.step()  # then they join, on its full blocks
    bm, num_full = engine.block_manager, (len(prompt) - 1) // engine.block_manager.block_size
    tables = [bm.block_table(r) for r in engine._groups["fork"].samples]
    assert num_full >= 2 and all(table[:num_full] == tables[0][:num_full] for table in tables)
    assert [bm.ref_count(b) for b in tables[0][:num_full]] == [4] * num_full
    assert len({table[num_full] for table in tables}) == 4  # each writes its own last block
    engine.abort("fork")
    sampled = _run(engine, [prompt], [SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)])
    texts = {sampled[(0, k)][0].__repr__() for k in range(4)}
    assert len(texts) == 4, "sampled siblings should differ"
    greedy = _run(engine, [prompt], [SamplingParams(n=3, max_tokens=12, temperature=0.0, ignore_eos=True)])
    assert greedy[(0, 0)][0] == greedy[(0, 1)][0] == greedy[(0, 2)][0]


def test_stop_string_cuts_text_and_finishes(smollm2_loaded):
    engine = _engine(smollm2_loaded)
    prompt = "The capital of France is"
    free_run = _run(engine, [prompt], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)])
    full_text = free_run[(0, 0)][1]
    stop = full_text.strip()[3:6]
    assert stop and stop in full_text
    cut = _run(engine, [prompt], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,))])
    ids, text, reason = cut[(0, 0)]
    assert reason is FinishReason.STOP
    assert text == full_text[: full_text.index(stop)]


def test_abort_frees_blocks_and_reports(smollm2_loaded):
    engine = _engine(smollm2_loaded)
    engine.add_request("a", TEXT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", TEXT[:100], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    finals = engine.abort("a")
    assert [o.finish_reason for o in finals] == [FinishReason.ABORT]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort("a") == []


def test_validation_errors_name_the_numbers(smollm2_loaded):
    engine = _engine(smollm2_loaded, max_model_len=256)
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(250\)"):
        engine.add_request("x", list(range(100, 110)), SamplingParams(max_tokens=250))
    with pytest.raises(ValueError, match="256"):
        engine.add_request("y", list(range(100, 400)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("z", [], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_kv_budget_too_small_is_refused(smollm2_loaded):
    config = EngineConfig(cache=CacheConfig(kv_cache_memory_gib=0.001))
    with pytest.raises(ValueError, match="fewer than one max-length sequence"):
        LLMEngine(config, loaded=smollm2_loaded)


def test_a_pool_short_of_the_model_s_context_starts_it_with_the_context_that_fits(smollm2_loaded, caplog):
    """Without --max-model-len, a pool that holds less than one sequence of the model's context (8192 tokens)
    shortens the context to its whole blocks, rather than refusing to start; prompts past it are refused."""
    config = smollm2_loaded.config
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32
    num_blocks = int(0.1 * 2**30) // (bytes_per_token * 16)
    with caplog.at_level(logging.WARNING, logger="tinyserve.engine.memory.fit_check"):
        engine = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_memory_gib=0.1)), loaded=smollm2_loaded)
    assert config.max_position_embeddings == 8192 and num_blocks * 16 < 8192
    assert engine.max_model_len == engine.config.scheduler.max_model_len == num_blocks * 16
    assert engine.config.cache.num_blocks == num_blocks
    assert f"context limited to {num_blocks * 16} tokens by memory" in caplog.text
    with pytest.raises(ValueError, match=f"the model's context is {num_blocks * 16} tokens"):
        engine.add_request("long", [100] * (num_blocks * 16), SamplingParams(max_tokens=1))


def test_engines_sharing_one_loaded_model_keep_their_own_kv(smollm2_loaded):
    """The KV pools travel with each step's metadata, not in the model: two engines built on one loaded
    model, stepped in turn and then on two threads at once, give each request the tokens it gets alone."""
    tokens = smollm2_loaded.tokenizer.encode(TEXT)
    prompts = {"a": tokens[:90], "b": tokens[40:200]}
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    alone = {rid: _run(_engine(smollm2_loaded), [p], [greedy])[(0, 0)][0] for rid, p in prompts.items()}
    assert alone["a"] != alone["b"]

    def drain(engine, out):
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] = out.get(o.request_id, []) + o.new_token_ids

    first, second = _engine(smollm2_loaded), _engine(smollm2_loaded)
    in_turn: dict[str, list[int]] = {}
    first.add_request("a", prompts["a"], greedy)
    second.add_request("b", prompts["b"], greedy)
    while first.has_unfinished_requests() or second.has_unfinished_requests():
        for engine in (first, second):
            for o in engine.step():
                in_turn[o.request_id] = in_turn.get(o.request_id, []) + o.new_token_ids
    assert in_turn == alone

    threaded: dict[str, list[int]] = {}
    first.add_request("a", prompts["a"], greedy)
    second.add_request("b", prompts["b"], greedy)
    workers = [threading.Thread(target=drain, args=(e, threaded)) for e in (first, second)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert threaded == alone
    for engine in (first, second):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
