"""loader/file_reads.py and its use by load_weights_in_pieces: every tensor is read on the load's I/O thread,
the job yields the read's Future while it runs (never blocks), and a read that gives nothing within the
timeout fails the load with ModelLoadError."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
from torch import nn

from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.file_reads import FileReads
from tinyserve.loader.weights import TensorSource, load_weights_in_pieces
from tinyserve.types import run_to_end


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 3), requires_grad=False)


def test_reads_run_on_the_io_thread_and_fill_the_model():
    model, threads = _Tiny(), []

    def read() -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return torch.arange(6, dtype=torch.float32).reshape(2, 3)

    reads = FileReads(5.0)
    run_to_end(load_weights_in_pieces(model, [("weight", TensorSource((2, 3), read))], reads=reads))
    reads.close()
    assert threads == ["tinyserve-load-io"]
    assert torch.equal(model.weight, torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_a_waiting_job_yields_the_future_instead_of_blocking():
    release = threading.Event()
    reads = FileReads(5.0)
    job = reads.read(lambda: release.wait(5.0) and 7, "a slow file")
    start = time.monotonic()
    waiting_on = next(job)
    assert isinstance(waiting_on, concurrent.futures.Future) and not waiting_on.done()
    assert time.monotonic() - start < 0.5  # the piece came back while the read still runs
    release.set()
    assert run_to_end(job) == 7
    reads.close()


def test_a_stalled_tensor_read_fails_the_load_within_its_timeout():
    stalled = threading.Event()
    model = _Tiny()
    reads = FileReads(0.3)
    source = TensorSource((2, 3), lambda: stalled.wait(30) or torch.zeros(2, 3))
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"reading tensor 'weight' stalled: no data within 0.3s"):
        run_to_end(load_weights_in_pieces(model, [("weight", source)], reads=reads))
    assert 0.3 <= time.monotonic() - start < 2.0
    stalled.set()  # lets the I/O thread go
    reads.close()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        FileReads(0)
