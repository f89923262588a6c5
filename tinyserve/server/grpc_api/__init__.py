"""The gRPC API beside HTTP: the server (health and reflection included), the handlers, and the proto with its generated code."""
