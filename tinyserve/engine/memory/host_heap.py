"""The host heap's bytes in use (glibc's mallinfo2: every arena plus mmapped blocks), to estimate what
one piece of work keeps allocated: a compiled grammar's matcher (engine/sampling/grammar_cache.py). Native
libraries such as llguidance allocate through the same malloc, so their memory shows here."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _mallinfo2():
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    function.restype = _MallInfo2
    return function


def heap_bytes_in_use() -> int | None:
    """Bytes malloc has handed out and not taken back; None where the C library cannot say. Includes
    other threads' allocations of the moment, so a difference of two readings is an estimate."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return info.uordblks + info.hblkhd
