"""The OpenAI-compatible HTTP layer (and gRPC beside it) over AsyncEngine: the only package that imports
fastapi, pydantic, grpc and prometheus_client.

app (factory, lifespan) -> intake/middleware (request id, body limit) -> openai_api/chat, completions and
routes (endpoints) -> intake/request_start (the one start path: checks, model, admission, deadline)
-> intake/generation (one request's run: merge, disconnects, SSE, log line) -> AsyncEngine. state holds the
life cycle (load, warm-up, ready, drain); registry/ the models served and the admin API; errors the OpenAI
error body; observability/ metrics, the engine view and the web page; launcher runs uvicorn (SIGTERM drain)
or a background server; grpc_api/ is the gRPC API on the same event loop, through the same start path.
"""
