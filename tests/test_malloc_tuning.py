"""engine/memory/malloc_tuning.py's malloc settings, each in a fresh process (they are process-wide)."""

import subprocess
import sys

import pytest

# Allocates, touches and frees an 8 MiB buffer twice; prints how much of it stayed resident (MiB).
_PROBE = """
import ctypes, sys
from tinyserve.engine.memory import malloc_tuning
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
assert getattr(malloc_tuning, sys.argv[1])()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
before = rss()
for _ in range(2):
    p = libc.malloc(8 << 20)
    ctypes.memset(p, 1, 8 << 20)
    libc.free(ctypes.c_void_p(p))
print(rss() - before)
"""


def _kept_mib(setting: str) -> float:
    result = subprocess.run([sys.executable, "-c", _PROBE, setting], capture_output=True, text=True, check=True)
    return float(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_buffers_stay_for_the_next_step_after_loading():
    assert _kept_mib("keep_freed_host_memory") >= 7.5
