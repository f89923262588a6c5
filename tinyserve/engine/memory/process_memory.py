"""What the process holds in memory, for the server's memory series: resident set, the limit it runs
under, and CUDA device memory when torch has initialized CUDA; and what it may still take, which a model
load is checked against (engine/memory/fit_check.py). Reads /proc and cgroup files (Linux);
None where a number is not available."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

_NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a number near 2**63
CGROUP_LIMIT_FILES = ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1
# (usage, stat, its inactive page cache's key): v2, then v1
CGROUP_USAGE_FILES = (("sys/fs/cgroup/memory.current", "sys/fs/cgroup/memory.stat", "inactive_file"),
                      ("sys/fs/cgroup/memory/memory.usage_in_bytes", "sys/fs/cgroup/memory/memory.stat",
                       "total_inactive_file"))


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


def cgroup_limit_bytes(root: Path = Path("/")) -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, then v1's limit), None when unlimited or
    not readable. root: the file system's root (tests point it at a fake tree)."""
    for path in CGROUP_LIMIT_FILES:
        text = _read(root / path)
        if text is not None and text.isdigit() and int(text) < _NO_CGROUP_LIMIT:
            return int(text)
    return None


def memory_limit_bytes(root: Path = Path("/")) -> int | None:
    """The memory this process may use: its cgroup's limit (v2, then v1), else the machine's MemTotal
    (the /metrics series; what a load may still take is available_memory_bytes)."""
    return cgroup_limit_bytes(root) or _meminfo_bytes(root, "MemTotal")


def available_memory_bytes(root: Path = Path("/")) -> int | None:
    """What this process may still take: the machine's MemAvailable, and under a cgroup limit no more than
    the limit less the cgroup's working set (its usage less the page cache it can drop, as container
    runtimes count it). None when neither is readable."""
    available = _meminfo_bytes(root, "MemAvailable")
    limit = cgroup_limit_bytes(root)
    if limit is None:
        return available
    in_cgroup = limit - _cgroup_working_set_bytes(root)
    return in_cgroup if available is None else min(in_cgroup, available)


def _cgroup_working_set_bytes(root: Path) -> int:
    """The cgroup's usage less its inactive page cache (v2, then v1); this process's resident set if the
    cgroup's usage is not readable."""
    for usage_file, stat_file, inactive_key in CGROUP_USAGE_FILES:
        usage = _read(root / usage_file)
        if usage is None or not usage.isdigit():
            continue
        stat = dict(line.split()[:2] for line in (_read(root / stat_file) or "").splitlines() if " " in line)
        inactive = int(stat.get(inactive_key, "0")) if stat.get(inactive_key, "0").isdigit() else 0
        return max(0, int(usage) - inactive)
    return process_rss_bytes() or 0


def _meminfo_bytes(root: Path, key: str) -> int | None:
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        name, _, value = line.partition(":")
        if name == key and value.split() and value.split()[0].isdigit():
            return int(value.split()[0]) * 1024  # kB
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def device_memory() -> list[DeviceMemory]:
    """Each CUDA device's memory, once this process has initialized CUDA (never initializes it)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return [DeviceMemory(f"cuda:{i}", torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i),
                         torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]
