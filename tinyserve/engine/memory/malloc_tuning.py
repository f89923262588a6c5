"""glibc malloc tuning for the host process: freed memory kept for the next step while serving, handed back
when a model is unloaded. Process-wide; the engine applies it at start-up (engine/loop/llm_engine.py).

Loading runs under the same setting. It used to map every buffer over 1 MiB apart while a model loaded (its
float32 copies left holes in the heap); loads are staged a matrix at a time now (loader/staged_linears.py),
and the setting, being process-wide, slowed the steps of the models serving beside a swap, and stayed on
after a failed one (docs/PERFORMANCE.md, "Resident memory")."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


# glibc malloc's M_TRIM_THRESHOLD, M_TOP_PAD and M_MMAP_THRESHOLD (mallopt's parameter numbers).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def _set_malloc(settings: tuple[tuple[int, int], ...], trim: bool = False) -> bool:
    """mallopt each (parameter, value), after malloc_trim(0) if trim; False (nothing changed) where the
    C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    if trim:
        malloc_trim(0)
    return all(mallopt(param, value) == 1 for param, value in settings)


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc to keep freed memory instead of returning it to the kernel at once.

    Why: a CPU step allocates and frees the same multi-MB activations (KV gathers, MLP outputs) every
    layer. By default glibc maps big blocks fresh from the kernel and hands the top of its heap back on
    free, so the next allocation page-faults the memory in again: on the offline benchmark a large share
    of CPU time went to the kernel (docs/PERFORMANCE.md, "Changes, each measured before and after"). The
    heap then stays at its high-water mark, which the steady state reaches anyway.

    What loading freed (float32 weights quantized or cast, file buffers) is handed back first. Returns
    False (and changes nothing) where the C library is not glibc."""
    # Blocks above the mmap threshold get fresh pages on every allocation: serve them from the heap too.
    settings = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    ok = _set_malloc(settings, trim=True)
    logger.debug("malloc tuned to keep freed memory: %s", ok)
    return ok


def return_freed_host_memory() -> bool:
    """After an engine is dropped (a model unloaded): hand glibc's free pages back to the kernel, which
    the serving settings above would keep resident. False where the C library is not glibc."""
    return _set_malloc((), trim=True)
