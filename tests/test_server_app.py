"""The app's edges without a model (the lifespan never runs, so the server stays "loading"): readiness
503s, the open routes, CORS, the request id and the body limit, through httpx's ASGI transport."""

import asyncio

import httpx

from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.request_limits import RequestLimits
from tinyserve.server.app import build_app


def _request(config: ServerConfig, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=build_app(EngineConfig(), config))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_loading_is_503_with_retry_after():
    r = _request(ServerConfig(), "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "loading" and r.json()["error"]["type"] == "service_unavailable_error"
    health = _request(ServerConfig(), "GET", "/health")
    assert health.status_code == 503 and health.json() == {"status": "loading"}


def test_open_routes_need_no_key_and_api_routes_do():
    config = ServerConfig(api_key="secret")
    assert _request(config, "GET", "/health").status_code == 503  # open, just not ready
    assert _request(config, "GET", "/metrics").status_code == 200
    assert _request(config, "GET", "/version").status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/tokenize")):
        r = _request(config, method, path, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    r = _request(config, "GET", "/v1/models", headers={"Authorization": "Bearer secret"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2-135m"


def test_served_model_names():
    config = ServerConfig(served_model_names=("mine", "alias"))
    r = _request(config, "GET", "/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["mine", "alias"]
    assert _request(config, "GET", "/v1/models/alias").status_code == 200
    assert _request(config, "GET", "/v1/models/other").status_code == 404


def test_cors_off_by_default_and_on_when_asked():
    preflight = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
    off = _request(ServerConfig(), "OPTIONS", "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    on = _request(ServerConfig(allowed_origins=("http://a.example",)), "OPTIONS", "/v1/completions",
                  headers=preflight)
    assert on.status_code == 200 and on.headers["access-control-allow-origin"] == "http://a.example"


def test_request_id_echoed_sanitised_or_generated():
    echoed = _request(ServerConfig(), "GET", "/version", headers={"X-Request-Id": "job-7"})
    assert echoed.headers["x-request-id"] == "job-7"
    bad = _request(ServerConfig(), "GET", "/version", headers={"X-Request-Id": "a b\tc"}).headers["x-request-id"]
    assert bad != "a b\tc" and len(bad) == 32
    assert len(_request(ServerConfig(), "GET", "/version").headers["x-request-id"]) == 32


def test_body_limit_from_content_length():
    r = _request(ServerConfig(limits=RequestLimits(max_body_bytes=2048)), "POST", "/tokenize", content=b"x" * 4096)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_health_reports_a_stalled_or_dead_engine():
    from tinyserve.server.state import ServerState

    class StubEngine:
        is_alive, stalled = True, False

        def is_stalled(self, timeout):
            return self.stalled

    state = ServerState(EngineConfig(), ServerConfig(stall_timeout=5))
    state.phase = "ready"
    _serve(state, StubEngine())
    assert state.is_healthy() == (True, "ok")
    state.engine.stalled = True
    assert state.is_healthy() == (False, "engine_stalled")
    state.engine.is_alive = False
    assert state.is_healthy() == (False, "engine_dead")
    state.phase = "draining"
    assert state.is_healthy() == (False, "draining")


def test_unexpected_error_is_a_500_naming_the_request_id():
    app = build_app(EngineConfig(), ServerConfig())

    async def boom():
        raise RuntimeError("secret internals")

    app.add_api_route("/boom", boom)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/boom", headers={"X-Request-Id": "req-42"})

    r = asyncio.run(go())
    assert r.status_code == 500 and r.headers["x-request-id"] == "req-42"
    assert r.json()["error"]["code"] == "internal_error" and "req-42" in r.json()["error"]["message"]
    assert "secret internals" not in r.text and "Traceback" not in r.text


class _QueueStub:
    """Just what admission reads of an AsyncEngine."""

    is_alive = True

    def __init__(self, num_running: int, num_waiting: int):
        from tinyserve.engine.observability.stats import EngineStats

        fields = {f: 0 for f in EngineStats.__dataclass_fields__}
        self.stats = EngineStats(**{**fields, "num_running": num_running, "num_waiting": num_waiting})
        self.num_waiting = num_waiting


class _RejectedCounter:
    def __init__(self):
        self.reasons: list[str] = []

    def rejected(self, reason: str) -> None:
        self.reasons.append(reason)


def _admission(num_running: int, num_waiting: int, max_queue: int = 4, max_num_seqs: int = 2):
    from tinyserve.config import SchedulerConfig
    from tinyserve.server.state import ServerState

    state = ServerState(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)),
                        ServerConfig(max_queue=max_queue))
    state.phase = "ready"
    _serve(state, _QueueStub(num_running, num_waiting))
    state.default.metrics = _RejectedCounter()
    return state


def _serve(state, engine) -> None:
    """The first model loaded, on `engine` (a stub of what admission and health read)."""
    from types import SimpleNamespace

    state.default.phase, state.default.current = "loaded", SimpleNamespace(engine=engine, num_in_flight=0)


def test_admission_counts_every_sample_of_a_request():
    import pytest

    from tinyserve.server.errors import BadRequest, ServiceUnavailable

    full = _admission(num_running=2, num_waiting=2)  # no free batch slot, 2 of 4 queue places taken
    full.admit(2)
    with pytest.raises(ServiceUnavailable) as exc:
        full.admit(3)
    assert exc.value.code == "overloaded" and exc.value.status == 503
    idle = _admission(num_running=0, num_waiting=2)  # 2 free slots take 2 of the waiting at once
    idle.admit(4)
    with pytest.raises(ServiceUnavailable):  # the slack is 2 slots, no more
        _admission(num_running=0, num_waiting=6).admit(1)
    with pytest.raises(BadRequest) as exc:  # more samples than the whole queue: never admissible
        idle.admit(5)
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, "n", "too_many_samples")
    assert exc.value.message.startswith("n")
    assert full.default.metrics.reasons == ["overloaded"] and idle.default.metrics.reasons == ["too_many_samples"]
    assert _admission(0, 10**6, max_queue=None).admit(10**6) is not None  # no limit


def test_server_config_limits_are_validated():
    import pytest

    for field, bad in (("max_connections", 0),
                       ("stream_write_timeout", 0), ("body_read_timeout", -1.0), ("keep_alive_timeout", 0),
                       ("body_read_timeout", float("nan")), ("max_queue", 0)):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            ServerConfig(**{field: bad})
    for field, bad in (("max_prompts_per_request", 0), ("max_messages", 0), ("max_body_bytes", 1000),
                       ("max_n", 0), ("max_logprobs", -1), ("max_priority", True), ("max_request_timeout", "1")):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            RequestLimits(**{field: bad})


def test_the_admin_api_is_off_unless_enabled():
    for path in ("/admin/models/load", "/admin/models/unload", "/admin/models/swap"):
        r = _request(ServerConfig(), "POST", path, json={"model": "smollm2-135m", "path": "/etc/passwd"})
        assert r.status_code == 404 and "error" in r.json(), path  # not mounted: nothing reads the body
    on = _request(ServerConfig(enable_admin_api=True), "POST", "/admin/models/unload", json={"model": "x"})
    assert on.status_code == 503 and on.json()["error"]["code"] == "loading"  # mounted, the server not ready
    keyed = _request(ServerConfig(enable_admin_api=True, api_key="k", host="0.0.0.0"), "POST",
                     "/admin/models/unload", json={"model": "x"})
    assert keyed.status_code == 401


def test_the_admin_api_beyond_loopback_needs_a_key():
    import pytest

    for host in ("0.0.0.0", "::", "10.0.0.5", "example.com"):
        with pytest.raises(ValueError, match="enable_admin_api.*needs an API key"):
            ServerConfig(host=host, enable_admin_api=True)
        assert ServerConfig(host=host, enable_admin_api=True, api_key="k").enable_admin_api
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert ServerConfig(host=host, enable_admin_api=True).is_loopback_only, host


def test_listening_beyond_loopback_without_a_key_warns_loudly(caplog):
    caplog.set_level("WARNING", logger="tinyserve.server.app")
    build_app(EngineConfig(), ServerConfig(host="0.0.0.0"))
    (record,) = [r for r in caplog.records if r.name == "tinyserve.server.app"]
    assert record.levelname == "WARNING" and "without an API key" in record.getMessage()
    assert "0.0.0.0" in record.getMessage()
    caplog.clear()
    build_app(EngineConfig(), ServerConfig(host="0.0.0.0", api_key="k"))
    build_app(EngineConfig(), ServerConfig(host="127.0.0.1"))
    assert not [r for r in caplog.records if r.name == "tinyserve.server.app"]
