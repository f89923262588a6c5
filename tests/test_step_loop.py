"""engine/step_loop.py: several AsyncEngines on one StepLoop thread. Both busy engines progress (their
steps interleave), their outputs equal each engine's run alone, a step that raises kills only its own
engine, and stopping one engine leaves the other stepping."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tinyserve.engine.async_engine import AsyncEngine, EngineDeadError
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.engine.step_loop import StepLoop
from tinyserve.loader.gguf import open_gguf
from tinyserve.loader.model_loader import LoadedModel, resolve_model_path
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.types import SamplingParams

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
        engines = [await AsyncEngine.launch(lambda m=m: _engine(m), step_loop=loop) for m in two_models]
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
        good, bad = [await AsyncEngine.launch(lambda m=m: _engine(m), step_loop=loop) for m in two_models]

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
