"""What the process may use (engine/memory/process_memory.py), read from a fake file-system root: a cgroup v2 or v1
limit less the cgroup's working set, within MemAvailable; MemAvailable alone without a limit."""

from pathlib import Path

import pytest

from tinyserve.engine.memory.process_memory import available_memory_bytes, cgroup_limit_bytes, memory_limit_bytes

MIB = 1 << 20


def _root(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"proc/meminfo": "MemTotal:       8388608 kB\nMemFree:         1048576 kB\n"
                                       "MemAvailable:    4194304 kB\n", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path  # MemTotal 8 GiB, MemAvailable 4 GiB


def test_without_a_cgroup_limit_the_allowance_is_mem_available_not_mem_total(tmp_path):
    root = _root(tmp_path, {"sys/fs/cgroup/memory.max": "max\n"})
    assert cgroup_limit_bytes(root) is None
    assert available_memory_bytes(root) == 4096 * MIB
    assert memory_limit_bytes(root) == 8192 * MIB  # the /metrics series keeps the machine's total


def test_a_cgroup_v2_limit_less_its_working_set(tmp_path):
    """1 GiB limit, 600 MiB used of which 100 MiB inactive page cache (droppable): 524 MiB left."""
    root = _root(tmp_path, {"sys/fs/cgroup/memory.max": f"{1024 * MIB}\n",
                            "sys/fs/cgroup/memory.current": f"{600 * MIB}\n",
                            "sys/fs/cgroup/memory.stat": f"anon {400 * MIB}\ninactive_file {100 * MIB}\n"})
    assert cgroup_limit_bytes(root) == memory_limit_bytes(root) == 1024 * MIB
    assert available_memory_bytes(root) == 524 * MIB


def test_a_cgroup_v1_limit(tmp_path):
    root = _root(tmp_path, {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2048 * MIB}\n",
                            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{1000 * MIB}\n",
                            "sys/fs/cgroup/memory/memory.stat": f"total_inactive_file {200 * MIB}\n"})
    assert available_memory_bytes(root) == 1248 * MIB


@pytest.mark.parametrize("limit_mib, expected_mib", [(64 * 1024, 4096), (3000, 3000 - 100)])
def test_the_tighter_of_the_cgroup_and_the_machine(tmp_path, limit_mib, expected_mib):
    """A limit above what the machine has free leaves MemAvailable; one below it, the limit less the usage."""
    root = _root(tmp_path, {"sys/fs/cgroup/memory.max": f"{limit_mib * MIB}",
                            "sys/fs/cgroup/memory.current": f"{100 * MIB}"})
    assert available_memory_bytes(root) == expected_mib * MIB


def test_v1_s_no_limit_number_is_no_limit(tmp_path):
    root = _root(tmp_path, {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"})
    assert available_memory_bytes(root) == 4096 * MIB


def test_nothing_readable_is_none(tmp_path):
    assert available_memory_bytes(tmp_path) is None and memory_limit_bytes(tmp_path) is None


def test_this_machine_reads_a_number():
    assert available_memory_bytes() > 0
