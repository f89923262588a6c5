"""The gRPC server beside HTTP: tinyserve.v1.TinyServe (server/grpc_api/grpc_service.py), the standard
grpc.health.v1 health service and server reflection, on --host:--grpc-port.

It runs on the app's own event loop (started and stopped by the app's lifespan, server/app.py), so it
shares the ServerState, its engines and its metrics with HTTP. Health follows ServerState.is_healthy:
SERVING when /health would say 200, NOT_SERVING while the models load, while draining and when the
engine is dead; a Check reads it then, and watchers hear of changes within HEALTH_POLL_S. On shutdown the
drain (ServerState.close) ends the calls in flight first, as it does HTTP's; the server then stops with
STOP_GRACE_S for their last messages.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from tinyserve.server.grpc_api.grpc_service import SERVICE_NAME, TinyServeService, add_service
from tinyserve.server.state import ServerState

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 2.0
_SERVICES = ("", SERVICE_NAME)  # "" is the whole server's health, as the health protocol defines it


class _Health(health_aio.HealthServicer):
    def __init__(self, state: ServerState):
        super().__init__()
        self.state = state

    async def sync(self) -> None:
        ok, _ = self.state.is_healthy()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in _SERVICES:
            await self.set(service, status)

    async def Check(self, request, context):
        await self.sync()
        return await super().Check(request, context)


class GrpcServer:
    def __init__(self, state: ServerState):
        self.state = state
        self.port: int | None = None  # bound by start() (the port asked for, or the one 0 got)
        self._server: grpc.aio.Server | None = None
        self._health = _Health(state)
        self._poll: asyncio.Task | None = None

    async def start(self) -> None:
        """Raises RuntimeError when the port cannot be bound."""
        config = self.state.config
        # no SO_REUSEPORT: a second server on a port in use must fail, not share it; a message is capped
        # as HTTP caps a body, and calls as HTTP caps connections (beyond: RESOURCE_EXHAUSTED)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", config.limits.max_body_bytes)],
                                 maximum_concurrent_rpcs=config.max_connections)
        add_service(TinyServeService(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        host = f"[{config.host}]" if ":" in config.host else config.host
        self.port = server.add_insecure_port(f"{host}:{config.grpc_port}")
        await self._health.sync()
        await server.start()
        self._server = server
        self._poll = asyncio.create_task(self._keep_health())

    async def _keep_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self._health.sync()

    async def stop(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
