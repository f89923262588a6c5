"""Memory at start-up and while serving: the KV pool and context sizing, the fit check before a load, what the process holds and may take, glibc malloc settings and the host heap's bytes."""
