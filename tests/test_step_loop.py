"""engine/loop/step_loop.py: several AsyncEngines on one StepLoop thread. Both busy engines progress (their
steps interleave), their outputs equal each engine's run alone, a step that raises kills only its own
engine, and stopping one engine leaves the other stepping. A job run in pieces (a model's load) leaves
an attached engine stepping between its pieces, and its result or exception reaches its future."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tinyserve.engine.loop.async_engine import AsyncEngine, EngineDeadError
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.loop.step_loop import StepLoop
from tinyserve.loader.gguf.checkpoint import open_gguf
from tinyserve.loader.model_loader import LoadedModel, resolve_model_path
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.types import SamplingParams, as_job

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_models() -> list[LoadedModel]:
    tokenizer = Tokenizer.from_gguf(open_gguf(resolve_model_path("smollm2-135m")))
    loaded = []
    for seed in (0, 1):
        config = ModelConfig(architecture="llama", vocab_size=tokenizer.vocab_size, hidden_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                             max_position_embeddings=256, norm_eps=1e-5, tie_word_embeddings=True,
                             eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)))
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.2)
        loaded.append(LoadedModel(model.eval().requires_grad_(False), config, tokenizer, Path(f"tiny-{seed}")))
    return loaded


def _engine(loaded: LoadedModel) -> LLMEngine:
    return LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_num_seqs=4)),
                     loaded=loaded)


def _alone(loaded: LoadedModel, prompt_ids: list[int]) -> list[int]:
    engine = _engine(loaded)
    engine.add_request("r", prompt_ids, GREEDY)
    ids = []
    while engine.has_unfinished_requests():
        ids += [t for out in engine.step() for t in out.new_token_ids]
    return ids


async def _ids(engine: AsyncEngine, request_id: str, prompt_ids: list[int]) -> list[int]:
    return [t async for out in engine.generate(request_id, prompt_ids, GREEDY) for t in out.new_token_ids]


def test_two_engines_on_one_thread_interleave_and_match_their_runs_alone(two_models):
    prompt = two_models[0].tokenizer.encode("The river ran clear")
    expected = [_alone(m, prompt) for m in two_models]
    assert expected[0] != expected[1]
    loop = StepLoop()
    order: list[int] = []

    async def go():
        engines = [await AsyncEngine.launch(as_job(lambda m=m: _engine(m)), step_loop=loop) for m in two_models]
        assert {e._thread for e in engines} == {loop.thread}
        for index, engine in enumerate(engines):
            engine.step_listeners.append(lambda outputs, now, i=index: order.append(i))
        got = await asyncio.gather(*(_ids(e, "r", prompt) for e in engines))
        for engine in engines:
            engine.stop()
        return got

    assert asyncio.run(go()) == expected
    # one step each per round while both are busy: neither waits for the other to finish
    last = {i: len(order) - 1 - order[::-1].index(i) for i in (0, 1)}
    assert order.index(1) < last[0] and order.index(0) < last[1], order
    loop.stop()


def test_a_failing_step_kills_only_its_engine(two_models):
    prompt = two_models[0].tokenizer.encode("Hello")
    loop = StepLoop()

    async def go():
        good, bad = [await AsyncEngine.launch(as_job(lambda m=m: _engine(m)), step_loop=loop) for m in two_models]

        def broken_step():
            raise RuntimeError("kernel fault")

        bad.engine.step = broken_step
        with pytest.raises(EngineDeadError):
            await _ids(bad, "x", prompt)
        assert not bad.is_alive and good.is_alive and loop.thread.is_alive()
        first = await _ids(good, "y", prompt)
        stopper = threading.Thread(target=bad.stop)
        stopper.start()
        stopper.join(10)
        second = await _ids(good, "z", prompt)  # stopping the dead one left the live one stepping
        good.stop()
        return first, second

    first, second = asyncio.run(go())
    assert first == second == _alone(two_models[0], prompt)
    loop.stop()


def test_an_engine_keeps_stepping_while_a_job_runs_in_pieces(two_models):
    """The job ends when the engine's generation has finished, or after max_pieces pieces (~5 s of them):
    a loop that ran a job's pieces back to back, whatever its engines had to do, would reach the cap with
    the generation not yet started."""
    max_pieces = 5000
    prompt = two_models[0].tokenizer.encode("The river ran clear")
    loop = StepLoop()
    generated = threading.Event()
    steps_seen: list[int] = []

    def load_like_job():
        for _ in range(max_pieces):
            if generated.is_set():
                return engine.engine.num_steps  # read on the loop's thread, between its rounds
            steps_seen.append(engine.engine.num_steps)
            time.sleep(0.001)  # a piece of work
            yield
        return None

    async def go():
        nonlocal engine
        engine = await AsyncEngine.launch(as_job(lambda: _engine(two_models[0])), step_loop=loop)
        job = asyncio.wrap_future(loop.run(load_like_job()))
        ids = await _ids(engine, "r", prompt)
        generated.set()
        num_steps = await job
        engine.stop()
        return ids, num_steps

    engine = None
    ids, num_steps = asyncio.run(go())
    loop.stop()
    assert ids == _alone(two_models[0], prompt)
    assert num_steps is not None, "the job ran to its end before the engine generated"
    assert num_steps - steps_seen[0] >= len(ids)  # every step of the generation ran while the job was in progress


def test_a_job_s_result_or_exception_reaches_its_future_and_jobs_run_in_order():
    loop = StepLoop()
    order: list[str] = []

    def job(name: str, num_pieces: int, error: Exception | None = None):
        for _ in range(num_pieces):
            order.append(name)
            yield
        if error is not None:
            raise error
        return name.upper()

    futures = [loop.run(job("a", 3)), loop.run(job("b", 2, ValueError("bad checkpoint"))), loop.run(job("c", 1)),
               loop.run(as_job(lambda: "one piece"))]
    assert futures[0].result(timeout=10) == "A"
    with pytest.raises(ValueError, match="bad checkpoint"):
        futures[1].result(timeout=10)
    assert futures[2].result(timeout=10) == "C" and futures[3].result(timeout=10) == "one piece"
    assert order == ["a", "a", "a", "b", "b", "c"]
    loop.stop()


def test_stopping_the_loop_fails_and_closes_the_job_in_progress():
    loop = StepLoop()
    started, closed = threading.Event(), threading.Event()

    def endless():
        try:
            while True:
                started.set()
                time.sleep(0.001)
                yield
        finally:
            closed.set()

    future = loop.run(endless())
    assert started.wait(10)
    loop.stop()
    assert not loop.thread.is_alive() and closed.is_set()
    with pytest.raises(RuntimeError, match="stopped"):
        future.result(timeout=1)
    with pytest.raises(RuntimeError, match="stopped"):
        loop.run(endless())
