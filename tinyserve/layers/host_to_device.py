"""The step's inputs go from host lists to the device through pinned memory, without waiting.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")` of a pageable tensor) copies and then
waits for the stream: every input tensor of a step would stop the host until the GPU caught up. A copy
from pinned memory with non_blocking=True is queued behind the step's work and the host goes on; torch's
pinned-memory cache keeps the host buffer until the copy has run. On CPU both are the tensor itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, queued without a host sync on CUDA."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def int64_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device` (to_device)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)
