"""The app's edges without a model (the lifespan never runs, so the server stays "loading"): readiness
503s, the open routes, CORS, the request id and the body limit, through httpx's ASGI transport."""

import asyncio

import httpx

from tinyserve.config import EngineConfig, ServerConfig
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
    r = _request(ServerConfig(max_body_bytes=2048), "POST", "/tokenize", content=b"x" * 4096)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_health_reports_a_stalled_or_dead_engine():
    from tinyserve.server.state import ServerState

    class StubEngine:
        is_alive, stalled = True, False

        def is_stalled(self, timeout):
            return self.stalled

    state = ServerState(EngineConfig(), ServerConfig(stall_timeout=5))
    state.phase, state.engine = "ready", StubEngine()
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
