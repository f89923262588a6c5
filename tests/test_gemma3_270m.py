"""The real Gemma 3 270M (base, Q4_K_M GGUF: Q5_0 / Q4_K / Q6_K / Q8_0 / F32 tensors) in float32 against
transformers loading the same file (its own GGUF reader, name map, norm shift and config mapping; eager
attention, whose mask applies the 512-token window): 8 prompts of 5 to 1,500 tokens, three longer than the
window. Logits within 1e-3 and the same argmax at every position; 64 greedy tokens identical. Then the
engine: the same prompts chunked (a 64-token prefill budget) and batched with 15 others give the same
tokens, and so does /v1/completions over HTTP. Tens of minutes on a 2-core CPU (transformers' generate is
most of it), too long for CI's run: marked slow, run with `pytest -m slow tests/test_gemma3_270m.py`."""

from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path

import httpx
import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.loader.model_loader import GEMMA3_PACKAGE, load_model, resolve_model_path
from tinyserve.server.launcher import BackgroundServer
from tinyserve.types import SamplingParams

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROMPT_LENGTHS = (5, 60, 200, 450, 511, 700, 1100, 1500)  # tokens, bos included: three past the window
NUM_NEW_TOKENS = 64
BOS = 2


def _sources() -> list[str]:
    """Text the package ships (so, fixed for its pinned version): the Gemma terms' prose, and the same page's
    raw HTML (markup, URLs, code)."""
    data = Path(importlib.util.find_spec(GEMMA3_PACKAGE).submodule_search_locations[0]) / "data"
    page = (data / "GEMMA_TERMS.html").read_text(encoding="utf-8")
    prose = re.sub(r"(?s)<script.*?</script>|<style.*?</style>|<[^>]+>", " ", page)
    prose = re.sub(r"\s+", " ", html.unescape(prose))
    return [prose[prose.index("By using, reproducing"):], page]


@pytest.fixture(scope="module")
def loaded():
    return load_model("gemma3-270m", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    sources = [loaded.tokenizer.encode(text, add_special_tokens=False) for text in _sources()]
    out = []
    for i, n in enumerate(PROMPT_LENGTHS):
        tokens = sources[i % 2]
        start = (i * 97) % (len(tokens) - n)
        out.append([BOS, *tokens[start:start + n - 1]])
    assert [len(p) for p in out] == list(PROMPT_LENGTHS)
    return out


@pytest.fixture(scope="module")
def hf():
    path = resolve_model_path("gemma3-270m")
    return tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                   attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts) -> list[list[int]]:
    config = tf.GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return [hf.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist() for ids in prompts]


@torch.no_grad()
def _hf_logits_in_slices(hf, ids: list[int], rows: int = 256):
    """transformers' logits, [rows, vocab] at a time: 1,500 x 262,144 float32 would be 1.6 GB at once."""
    hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    for start in range(0, len(ids), rows):
        yield start, hf.lm_head(hidden[start:start + rows])  # no final_logit_softcapping in Gemma 3


def test_logits_and_argmax_match_transformers_at_every_position(loaded, hf, prompts):
    assert hf.config.final_logit_softcapping is None and hf.config.sliding_window == 512
    diffs = {}
    for ids in prompts:
        ours = forward_sequence(loaded.model, ids)  # [len, vocab]
        worst = 0.0
        for start, expected in _hf_logits_in_slices(hf, ids):
            got = ours[start:start + len(expected)]
            worst = max(worst, (got - expected).abs().max().item())
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), f"{len(ids)} tokens, from {start}"
        diffs[len(ids)] = worst
    print("max |logit diff| by prompt length:", {n: f"{d:.2e}" for n, d in diffs.items()})
    assert max(diffs.values()) <= 1e-3, diffs


def _engine(loaded, **scheduler) -> LLMEngine:
    config = EngineConfig(model="gemma3-270m", dtype="float32", device="cpu",
                          cache=CacheConfig(kv_cache_memory_gib=0.5),
                          scheduler=SchedulerConfig(max_model_len=2048, **scheduler))
    return LLMEngine(config, loaded=loaded)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_greedy_continuations_match_transformers(loaded, prompts, hf_greedy):
    assert _greedy(_engine(loaded), prompts) == hf_greedy


def test_chunked_and_batched_with_15_others_gives_the_same_tokens(loaded, prompts, hf_greedy):
    """A 64-token prefill budget cuts every prompt but the first into chunks (the 1,500-token one into 24),
    several of them across the window's edge; 15 other prompts of 3-900 tokens run in the same steps."""
    others = [[BOS, *range(1000 + 31 * i, 1000 + 31 * i + n)] for i, n in enumerate(range(2, 900, 60))]
    assert len(others) == 15
    engine = _engine(loaded, max_num_batched_tokens=64, max_num_seqs=32)
    got = _greedy(engine, prompts + others)
    assert got[:len(prompts)] == hf_greedy


def test_completions_over_http_equal_the_engine(loaded, prompts, hf_greedy):
    engine_config = EngineConfig(model="gemma3-270m", dtype="float32", device="cpu",
                                 cache=CacheConfig(kv_cache_memory_gib=0.5), scheduler=SchedulerConfig(max_model_len=2048))
    server = BackgroundServer(engine_config, ServerConfig(port=0, warmup=False),
                              lambda cfg: LLMEngine(cfg, loaded=loaded))
    body = {"prompt": [prompts[i] for i in (0, 5)], "max_tokens": NUM_NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    with server as srv, httpx.Client(base_url=srv.base_url, timeout=300) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    for choice, i in zip(choices, (0, 5), strict=True):
        assert choice["text"] == loaded.tokenizer.decode(hf_greedy[i]), i
        assert len(choice["logprobs"]["tokens"]) == NUM_NEW_TOKENS
