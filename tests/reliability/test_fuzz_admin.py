"""Fuzzing the admin API (issue 44): load, unload and swap with hostile bodies and paths, on a live server
with the admin API on. Strategies and the error shape come from test_fuzz.py (HTTP's fuzz)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import time
from collections import Counter
from dataclasses import replace

import httpx
import pytest
from hypothesis import strategies as st

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.server.launcher import BackgroundServer

from .test_fuzz import ERROR_KEYS, MALFORMED, draw_all, texts, wrong_type

# The admin API (issue 44): load, unload and swap with fuzzed names and paths, aimed at the files a loader must
# never open (pipes, devices, sockets, folders, links to them), files that are no model, and wrong types. The
# bar: every reply is 200, 400, 404 model_not_found, 413, 422 model_load_failed or 503 in OpenAI's error
# shape; every refused path gets one message (no oracle of the server's files), a pipe, a device, a folder and
# a socket within 1 s; afterwards the engine is alive, /health is 200 and the model answers.
ADMIN_PATHS = ("/admin/models/load", "/admin/models/unload", "/admin/models/swap")
ADMIN_SYSTEM_PATHS = ["/dev/zero", "/dev/null", "/dev/urandom", "/dev/stdin", "/", "/proc/self", "/proc/self/mem",
                      "/etc/passwd", "", "\x00", "/tmp/\x00x", "a" * 5000, "~", "../../../../etc/passwd", "/no/such.gguf"]


def _admin_hostile_files(root, model_folder: str) -> tuple[list[str], list[str], object]:
    """(paths of kinds that must be refused unopened, paths of regular files that are no model, the socket to
    close): a pipe, a socket, links to them, a folder, a checkpoint folder whose config.json is a pipe; an
    empty file (refused at the first look inside), a truncated GGUF (its magic passes: the load fails)."""

    os.mkfifo(root / "pipe.gguf")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(root / "sock.gguf"))
    (root / "link.gguf").symlink_to(root / "pipe.gguf")
    (root / "empty_dir").mkdir()
    trap = root / "trap_folder"
    shutil.copytree(model_folder, trap)
    (trap / "config.json").unlink()
    os.mkfifo(trap / "config.json")
    (root / "empty.gguf").write_bytes(b"")
    (root / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    refused = [str(root / n) for n in ("pipe.gguf", "sock.gguf", "link.gguf", "empty_dir", "trap_folder")]
    refused += ["/dev/zero", "/dev/null", "/", "/proc/self", str(root / "missing.gguf")]
    return refused, [str(root / "empty.gguf"), str(root / "truncated.gguf")], listener


def _admin_cases(paths: list[str], count: int) -> list[tuple[str, bytes]]:
    names = st.sampled_from(["llama", "nope", "", "LLAMA", "llama "]) | wrong_type
    path_values = st.sampled_from(paths) | texts | wrong_type
    well_formed = st.fixed_dictionaries({"model": st.just("llama"), "path": st.sampled_from(paths)})
    body = st.one_of(
        well_formed, well_formed, well_formed,
        st.fixed_dictionaries({"model": names, "path": path_values}),
        st.fixed_dictionaries({"model": names}, optional={"path": path_values, "extra": wrong_type}),
        st.dictionaries(st.sampled_from(["model", "path", "x"]), wrong_type, max_size=3),
        wrong_type,
    ).map(lambda b: json.dumps(b).encode())
    raw = st.one_of(body, st.binary(max_size=32), st.sampled_from(MALFORMED))
    every_path = [("/admin/models/swap", json.dumps({"model": "llama", "path": path}).encode()) for path in paths]
    return every_path + draw_all(st.tuples(st.sampled_from(ADMIN_PATHS), raw), count)


def _admin_problem(status: int, payload: object) -> str | None:
    if status == 200:
        return None if isinstance(payload, dict) and payload.get("id") == "llama" else f"200 {payload!r:.200}"
    if status not in (400, 404, 413, 422, 503):
        return f"status {status}: {payload!r:.200}"
    if not isinstance(payload, dict) or set(payload) != {"error"} or set(payload["error"]) != ERROR_KEYS:
        return f"not an OpenAI error body: {payload!r:.200}"
    code = payload["error"]["code"]
    if (status == 404 and code != "model_not_found") or (status == 422 and code != "model_load_failed"):
        return f"{status} {code}"
    if status == 503 and code in ("engine_dead", "engine_stalled"):
        return f"engine died: {payload!r:.200}"
    return None


@pytest.mark.reliability
def test_fuzz_admin_api(random_hf_folders, tmp_path):

    refused, not_models, listener = _admin_hostile_files(tmp_path, random_hf_folders["llama"])
    cases = _admin_cases(refused + not_models + ADMIN_SYSTEM_PATHS + [random_hf_folders["llama"]], 400)
    engine = EngineConfig(model=random_hf_folders["llama"], dtype="float32", device="cpu",
                          cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_model_len=128),
                          load_read_timeout=10.0)
    config = replace(ServerConfig(port=0, warmup=False, served_model_names=("llama",)), enable_admin_api=True)
    completion = {"model": "llama", "prompt": "Hi", "max_tokens": 4}
    try:
        with BackgroundServer(engine, config) as srv:
            async def send_all() -> list[tuple[int, object]]:
                semaphore = asyncio.Semaphore(8)
                async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
                    async def one(route: str, content: bytes):
                        async with semaphore:
                            r = await client.post(route, content=content,
                                                  headers={"content-type": "application/json"})
                            try:
                                return r.status_code, r.json()
                            except ValueError:
                                return r.status_code, r.text

                    return await asyncio.gather(*(one(route, content) for route, content in cases))

            replies = asyncio.run(send_all())
            problems = [(c, p) for c, (s, b) in zip(cases, replies) if (p := _admin_problem(s, b))]
            statuses = Counter(s for s, _ in replies)
            print(f"admin fuzz: {len(cases)} bodies; replies {dict(statuses)}")
            assert statuses[200] and statuses[400] and statuses[422], "the fuzz never reached every outcome"
            assert not problems, "\n".join(f"{route} {content[:200]!r}: {p}" for (route, content), p in problems[:12])
            messages = set()
            for path in refused:  # one at a time: each within 1 s, and one message for all
                start = time.monotonic()
                r = httpx.post(srv.base_url + "/admin/models/swap", json={"model": "llama", "path": path}, timeout=10)
                assert time.monotonic() - start < 1.0, path
                assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", (path, r.text)
                messages.add(r.json()["error"]["message"].replace(repr(path[:256]), "PATH"))
            assert len(messages) == 1, messages
            loaded = httpx.post(srv.base_url + "/admin/models/load", json={"model": "llama"}, timeout=120)
            assert loaded.status_code == 200 and loaded.json()["state"] == "loaded", loaded.text
            r = httpx.post(srv.base_url + "/v1/completions", json=completion, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
            assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    finally:
        listener.close()
