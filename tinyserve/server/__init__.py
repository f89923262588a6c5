"""The OpenAI-compatible HTTP layer over AsyncEngine (the only package that imports fastapi, pydantic and
prometheus_client).

app (factory) -> middleware (request id, body limit, 500s) -> completions / chat / routes (endpoints)
-> intake (admission, parsing, tokenization, validation) -> generation (one request's run: merge,
deadline, disconnects, SSE, log line) -> AsyncEngine. state holds the life cycle (load, warm-up, ready,
drain) and admission; protocol the request models; errors the OpenAI error body; metrics Prometheus;
launcher runs uvicorn (SIGTERM drain) or a background server for tests and benchmarks. grpc_server and
grpc_service are the gRPC API (proto/) on the same event loop, through the same intake and generation.
"""
