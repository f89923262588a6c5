"""Several models in one server (server/registry/model_registry.py, model_slot.py, admin.py): requests go to the
model they name, models load on demand and are evicted within --max-loaded-models, the admin API loads,
unloads and swaps them, and a broken model fails alone. Two small random checkpoints of different
architectures (llama, qwen2), saved with the default model's tokenizer; the oracle is each model run
alone through tinyserve.LLM (greedy, so its text is the only right answer)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx
import pytest

from tinyserve import LLM
from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.server.launcher import BackgroundServer
from tinyserve.types import SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
MAX_TOKENS = 12


def _engine_config(model: str) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", device="cpu", cache=CacheConfig(num_blocks=64),
                        scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=16))


@pytest.fixture(scope="module")
def folders(random_hf_folders) -> dict[str, str]:
    return random_hf_folders


@pytest.fixture(scope="module")
def alone(folders) -> dict[str, dict[str, str]]:
    """Each model's greedy text for each prompt, run alone (the offline API)."""
    texts = {}
    for name, folder in folders.items():
        llm = LLM(folder, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        texts[name] = {p: r.text for p, r in zip(PROMPTS, llm.generate(PROMPTS, params))}
    assert texts["llama"] != texts["qwen"]  # else the routing tests could not tell them apart
    return texts


def _server(folders, first: str = "llama", **config) -> BackgroundServer:
    others = tuple((name, path) for name, path in folders.items() if name != first)
    server_config = replace(ServerConfig(port=0, warmup=False, served_model_names=(first,), enable_admin_api=True),
                            models=others)
    return BackgroundServer(_engine_config(folders[first]), replace(server_config, **config))


async def _complete(client: httpx.AsyncClient, model: str, prompt: str, stream: bool = False,
                    max_tokens: int = MAX_TOKENS) -> tuple[str, str | None]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    text, reason = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                import json

                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                reason = choice["finish_reason"] or reason
    return "".join(text), reason


def _cards(base_url: str) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(base_url + "/v1/models").json()["data"]}


def _metric(base_url: str, line_start: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    return 0.0


def test_each_request_goes_to_the_model_it_names(folders, alone):
    with _server(folders) as srv:
        cards = _cards(srv.base_url)
        assert {n: (c["state"], c["memory_bytes"] > 0) for n, c in cards.items()} == {
            "llama": ("loaded", True), "qwen": ("loaded", True)}

        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                jobs = [(name, p, i % 2 == 0) for i, (name, p) in enumerate(
                    (name, p) for _ in range(2) for name in ("llama", "qwen") for p in PROMPTS)]
                results = await asyncio.gather(*(_complete(client, n, p, s) for n, p, s in jobs))
                return list(zip(jobs, results))

        results = asyncio.run(go())
        assert len(results) == 16
        for (name, prompt, _), (text, reason) in results:
            assert (text, reason) == (alone[name][prompt], "length"), (name, prompt)
        missing = httpx.post(srv.base_url + "/v1/completions", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'llama', 'qwen'" in missing.json()["error"]["message"]
        assert _metric(srv.base_url, 'tinyserve:generation_tokens_total{model_name="qwen"}') == 8 * MAX_TOKENS
        assert httpx.get(srv.base_url + "/health?model=qwen").json() == {"status": "ok"}


def test_one_loaded_model_at_a_time_alternating(folders, alone):
    """--max-loaded-models 1: each request to the other model evicts the idle one and loads its own."""
    with _server(folders, max_loaded_models=1) as srv:
        assert {n: c["state"] for n, c in _cards(srv.base_url).items()} == {"llama": "loaded", "qwen": "unloaded"}

        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                return [await _complete(client, name, PROMPTS[0]) for name in ("qwen", "llama", "qwen", "llama")]

        texts = [text for text, _ in asyncio.run(go())]
        assert texts == [alone[n][PROMPTS[0]] for n in ("qwen", "llama", "qwen", "llama")]
        assert {n: c["state"] for n, c in _cards(srv.base_url).items()} == {"llama": "loaded", "qwen": "unloaded"}
        assert _metric(srv.base_url, 'tinyserve:model_loads_total{model_name="qwen",outcome="ok"}') == 2
        assert _metric(srv.base_url, 'tinyserve:model_loads_total{model_name="llama",outcome="ok"}') == 3
        assert _metric(srv.base_url, 'tinyserve:model_unloads_total{model_name="llama",reason="evicted"}') == 2
        assert _metric(srv.base_url, 'tinyserve:model_unloads_total{model_name="qwen",reason="evicted"}') == 2


def test_concurrent_requests_alternating_models_all_wait_for_their_load(folders, alone):
    """--max-loaded-models 1, four clients alternating the two models: a request that saw its model's
    load finish is admitted before another load may evict that model (ModelRegistry.ensure_loaded pins
    it), so none gets 503 model_unloaded and every text is its model's."""
    with _server(folders, max_loaded_models=1) as srv:
        jobs = [("llama", "qwen")[i % 2] for i in range(24)]

        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                seats = asyncio.Semaphore(4)

                async def one(name: str):
                    async with seats:
                        body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                "ignore_eos": True}
                        r = await client.post("/v1/completions", json=body)
                        return name, r.status_code, r.json()

                return await asyncio.gather(*(one(name) for name in jobs))

        results = asyncio.run(go())
        assert [(name, status) for name, status, _ in results] == [(name, 200) for name in jobs], \
            [body for _, status, body in results if status != 200][:2]
        for name, _, body in results:
            assert alone[name][PROMPTS[0]].startswith(body["choices"][0]["text"]), name
        refused = [line for line in httpx.get(srv.base_url + "/metrics").text.splitlines()
                   if line.startswith("tinyserve:request_rejected_total{") and float(line.split()[-1]) > 0]
        assert refused == []


def test_unload_waits_for_in_flight_requests(folders, alone):
    with _server(folders) as srv:
        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                stream = asyncio.ensure_future(_complete(client, "qwen", PROMPTS[1], stream=True, max_tokens=60))
                while not srv.state.registry.resolve("qwen").num_in_flight:
                    await asyncio.sleep(0.01)
                unloaded = await client.post("/admin/models/unload", json={"model": "qwen"})
                return stream.done(), await stream, unloaded

        done_before_reply, (text, reason), unloaded = asyncio.run(go())
        assert done_before_reply and reason == "length"  # finished, not aborted, before the reply came
        assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
        assert unloaded.json()["memory_bytes"] == 0
        assert text.startswith(alone["qwen"][PROMPTS[1]])
        engine = srv.state.registry.resolve("llama").engine
        assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_blocks


def test_swap_serves_new_requests_from_the_new_file(folders, alone):
    """In-flight requests finish on the old weights; requests after the switch get the new ones."""
    with _server({"llama": folders["llama"]}) as srv:
        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                old = [asyncio.ensure_future(_complete(client, "llama", p, stream=True)) for p in PROMPTS]
                while srv.state.registry.default.num_in_flight < len(PROMPTS):
                    await asyncio.sleep(0.01)
                swapped = await client.post("/admin/models/swap", json={"model": "llama", "path": folders["qwen"]})
                new = [await _complete(client, "llama", p) for p in PROMPTS]
                return await asyncio.gather(*old), swapped, new

        old, swapped, new = asyncio.run(go())
        assert [t for t, _ in old] == [alone["llama"][p] for p in PROMPTS]
        assert swapped.status_code == 200 and swapped.json()["state"] == "loaded"
        assert [t for t, _ in new] == [alone["qwen"][p] for p in PROMPTS]
        assert _metric(srv.base_url, 'tinyserve:model_swaps_total{model_name="llama",outcome="ok"}') == 1
        bad = httpx.post(srv.base_url + "/admin/models/swap", json={"model": "llama", "path": "/no/such/file.gguf"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"


def test_a_failed_swap_leaves_the_old_weights_serving(folders, alone, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with _server({"llama": folders["llama"]}) as srv:
        r = httpx.post(srv.base_url + "/admin/models/swap", json={"model": "llama", "path": str(broken)}, timeout=60)
        assert r.status_code == 422 and r.json()["error"]["code"] == "model_load_failed"
        card = _cards(srv.base_url)["llama"]
        assert card["state"] == "loaded" and card["error"] is None
        assert asyncio.run(_one(srv.base_url, "llama", PROMPTS[0]))[0] == alone["llama"][PROMPTS[0]]
        assert _metric(srv.base_url, 'tinyserve:model_swaps_total{model_name="llama",outcome="failed"}') == 1


def test_past_the_drain_timeout_a_request_on_the_old_weights_ends_with_abort(folders):
    with _server({"llama": folders["llama"]}, drain_timeout=0.2) as srv:
        llm_engine = srv.state.registry.default.engine.engine
        step = llm_engine.step
        llm_engine.step = lambda: (time.sleep(0.02), step())[1]  # 200 tokens take 4 s: past the drain

        async def go():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                stream = asyncio.ensure_future(_complete(client, "llama", PROMPTS[2], stream=True, max_tokens=200))
                while not srv.state.registry.default.num_in_flight:
                    await asyncio.sleep(0.01)
                r = await client.post("/admin/models/swap", json={"model": "llama", "path": folders["qwen"]})
                return await stream, r

        (text, reason), swapped = asyncio.run(go())
        assert swapped.status_code == 200 and reason == "abort"  # ended, not hung, and said so


def test_an_idle_model_is_unloaded_and_loads_again_on_demand(folders, alone):
    with _server({"llama": folders["llama"]}, idle_unload=0.3) as srv:
        deadline = time.monotonic() + 30
        unloads = 'tinyserve:model_unloads_total{model_name="llama",reason="idle"}'
        # the card says unloaded at once; the unload is counted once its engine stopped and its memory went back
        while _cards(srv.base_url)["llama"]["state"] != "unloaded" or _metric(srv.base_url, unloads) < 1:
            assert time.monotonic() < deadline, "never unloaded"
            time.sleep(0.05)
        assert _metric(srv.base_url, unloads) == 1
        assert asyncio.run(_one(srv.base_url, "llama", PROMPTS[3]))[0] == alone["llama"][PROMPTS[3]]
        assert _metric(srv.base_url, 'tinyserve:model_loads_total{model_name="llama",outcome="ok"}') == 2


def test_a_corrupt_model_fails_alone(folders, alone, tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with _server({"llama": folders["llama"]}, models_dir=str(tmp_path)) as srv:
        assert _cards(srv.base_url)["broken"]["state"] == "unloaded"
        r = httpx.post(srv.base_url + "/admin/models/load", json={"model": "broken"}, timeout=60)
        assert r.status_code == 422 and r.json()["error"]["code"] == "model_load_failed"
        assert "broken" in r.json()["error"]["message"]
        card = _cards(srv.base_url)["broken"]
        assert card["state"] == "failed" and card["error"] and card["error"] in r.json()["error"]["message"]
        asked = httpx.post(srv.base_url + "/v1/completions", json={"model": "broken", "prompt": "x"})
        assert asked.status_code == 503 and asked.json()["error"]["code"] == "model_failed"
        assert httpx.get(srv.base_url + "/health?model=broken").status_code == 503
        assert httpx.get(srv.base_url + "/health").status_code == 200
        text, _ = asyncio.run(_one(srv.base_url, "llama", PROMPTS[0]))
        assert text == alone["llama"][PROMPTS[0]]
        assert _metric(srv.base_url, 'tinyserve:model_loads_total{model_name="broken",outcome="failed"}') == 1


async def _one(base_url: str, model: str, prompt: str):
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await _complete(client, model, prompt)


def test_a_model_over_its_memory_share_is_refused_and_evicts_nothing(folders, tmp_path):
    import shutil

    big = tmp_path / "big"
    shutil.copytree(folders["qwen"], big)
    (big / "padding.safetensors").write_bytes(bytes(32 << 20))  # counted as weights: 38 MiB on disk
    with _server({"llama": folders["llama"]}, models_dir=str(tmp_path), max_loaded_models=1,
                 memory_budget_gib=0.02) as srv:  # one share of 20 MiB; llama's weights take ~6
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "big", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 507 and r.json()["error"]["code"] == "model_too_large"
        assert "do not fit its share of the memory budget (0.02 GiB" in r.json()["error"]["message"]
        cards = _cards(srv.base_url)
        assert (cards["llama"]["state"], cards["big"]["state"]) == ("loaded", "failed")  # nothing evicted for it
        assert _metric(srv.base_url, 'tinyserve:model_unloads_total{model_name="llama",reason="evicted"}') == 0


def test_admin_api_needs_the_key_and_a_known_model(folders):
    with _server({"llama": folders["llama"]}, api_key="k") as srv:
        assert httpx.post(srv.base_url + "/admin/models/unload", json={"model": "llama"}).status_code == 401
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(srv.base_url + "/admin/models/unload", json={"model": "nope"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(srv.base_url + "/admin/models/load", json={}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_serve_flags_name_several_models():
    from tinyserve.cli import build_parser, server_config_from_args
    from tinyserve.cli_engine import engine_config_from_args

    args = build_parser().parse_args(["serve", "--model", "a=/m/one.gguf", "--model", "/m/two", "--max-loaded-models",
                                      "1", "--idle-unload", "30", "--memory-budget", "4"])
    config = server_config_from_args(args)
    assert engine_config_from_args(args).model == "/m/one.gguf" and config.served_model_names == ("a",)
    assert config.models == (("/m/two", "/m/two"),) and config.max_loaded_models == 1
    assert (config.idle_unload, config.memory_budget_gib) == (30.0, 4.0)
    with pytest.raises(ValueError, match="max_loaded_models"):
        ServerConfig(max_loaded_models=0)


def test_a_draft_models_weights_and_pool_count_in_the_models_memory(folders):
    """Speculative method "draft" holds a second model and KV pool: the slot's memory figures include both."""
    from tinyserve.config import SpeculativeConfig
    from tinyserve.engine.loop.llm_engine import LLMEngine
    from tinyserve.server.registry.model_slot import _kv_bytes, _weight_bytes_by_format

    def _weight_bytes(engine):
        return sum(_weight_bytes_by_format(engine).values())

    plain = LLMEngine(_engine_config(folders["llama"]))
    spec = SpeculativeConfig(method="draft", draft_model=folders["qwen"], num_speculative_tokens=2)
    drafting = LLMEngine(replace(_engine_config(folders["llama"]), speculative=spec))
    draft_alone = LLMEngine(_engine_config(folders["qwen"]))
    assert _weight_bytes(drafting) == _weight_bytes(plain) + _weight_bytes(draft_alone)
    assert _kv_bytes(plain) > 0 and _kv_bytes(draft_alone) > 0
    assert _kv_bytes(drafting) == _kv_bytes(plain) + _kv_bytes(draft_alone)
