"""engine/sampling/big_stack_worker.py: work runs on threads whose stack is STACK_BYTES (read back from the thread's
own pthread attributes), results and exceptions reach the caller, and the process-wide default stack size
is left as it was."""

import ctypes
import threading

import pytest

from tinyserve.engine.sampling.big_stack_worker import STACK_BYTES, BigStackWorker


def _own_stack_bytes() -> int:
    """The calling thread's stack size, from glibc's pthread_getattr_np."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(256)  # pthread_attr_t is 56 bytes on x86-64 and 64 on aarch64
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    size = ctypes.c_size_t()
    libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
    libc.pthread_attr_destroy(attr)
    return size.value


def test_work_runs_on_a_large_stack_and_the_default_is_restored():
    before = threading.stack_size()
    worker = BigStackWorker(num_threads=2, name="test-big-stack")
    assert worker.run(_own_stack_bytes) >= STACK_BYTES
    assert threading.stack_size() == before
    other = []
    thread = threading.Thread(target=lambda: other.append(_own_stack_bytes()))
    thread.start()
    thread.join()
    assert other[0] < STACK_BYTES  # threads started elsewhere keep the default


def test_results_and_exceptions_reach_the_caller():
    worker = BigStackWorker(num_threads=1, name="test-big-stack")
    assert worker.run(pow, 2, 10) == 1024
    with pytest.raises(ZeroDivisionError):
        worker.run(lambda: 1 / 0)
    assert worker.run(threading.current_thread).name == "test-big-stack-0"
