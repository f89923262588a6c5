"""The FastAPI app factory. Routes, error handlers and middleware are wired here; the app's life
(load, warm-up, ready, drain, stop) lives in ServerState, driven by the lifespan below."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import tinyserve
from tinyserve.config import EngineConfig, ServerConfig
from tinyserve.server.registry import admin
from tinyserve.server.openai_api import chat, completions
from tinyserve.server.observability import engine_view, web
from tinyserve.server import routes
from tinyserve.server.errors import install_error_handlers
from tinyserve.server.intake.middleware import RequestContextMiddleware
from tinyserve.server.state import ServerState

logger = logging.getLogger(__name__)


def build_app(engine_config: EngineConfig, config: ServerConfig,
              engine_factory: Callable[[EngineConfig], object] | None = None) -> FastAPI:
    """`engine_factory(engine_config) -> LLMEngine` replaces the default loader (tests share one loaded
    model between apps; each model's engine_config names its source). The start-up models load in the
    background once the app starts: /health is 503 until their warm-up generations have run. With
    `config.grpc_port` the gRPC API runs on the same event loop (`app.state.grpc`, server/grpc_api/grpc_server.py).
    The admin API is mounted only with `config.enable_admin_api`; a server that listens beyond loopback
    without an API key says so loudly (ServerConfig refuses the admin API there)."""
    state = ServerState(engine_config, config, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        grpc_server = None
        if config.grpc_port is not None:  # bound first: a port in use fails the start before any load
            from tinyserve.server.grpc_api.grpc_server import GrpcServer

            grpc_server = app.state.grpc = GrpcServer(state)
            await grpc_server.start()
        state.start_loading()
        try:
            yield
        finally:
            await state.close()  # drains gRPC's calls in flight with HTTP's
            if grpc_server is not None:
                await grpc_server.stop()

    app = FastAPI(title="tinyserve", version=tinyserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    install_error_handlers(app)
    routers = (completions.router, chat.router, routes.api, routes.public, engine_view.router, web.router)
    for router in routers + ((admin.router,) if config.enable_admin_api else ()):  # off: /admin/* is 404
        app.include_router(router)
    if config.api_key is None and not config.is_loopback_only:
        logger.warning("SECURITY: listening on %s without an API key: anyone who can reach this address can "
                       "use the API and spend this machine's compute; set --api-key-file (or "
                       "$TINYSERVE_API_KEY), or listen on 127.0.0.1", config.host)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestContextMiddleware, max_body_bytes=config.limits.max_body_bytes,
                       body_read_timeout=config.body_read_timeout)
    return app
