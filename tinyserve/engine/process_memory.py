"""What the process holds in memory, for the server's memory series: resident set, the limit it runs
under, and CUDA device memory when torch has initialized CUDA. Reads /proc and cgroup files (Linux);
None where a number is not available."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

_NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a number near 2**63


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # "cuda:0"
    allocated_bytes: int  # held by tensors
    reserved_bytes: int  # held by torch's caching allocator (allocated + cached free blocks)
    total_bytes: int


def process_rss_bytes() -> int | None:
    """The resident set of this process (/proc/self/statm's second field, in pages)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_limit_bytes() -> int | None:
    """The memory this process may use: its cgroup's limit (v2, then v1), else the machine's MemTotal."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_CGROUP_LIMIT:
            return int(text)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_memory() -> list[DeviceMemory]:
    """Each CUDA device's memory, once this process has initialized CUDA (never initializes it)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return [DeviceMemory(f"cuda:{i}", torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i),
                         torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]
