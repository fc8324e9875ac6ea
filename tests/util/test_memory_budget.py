"""util/memory_budget.py: the memory available (MemAvailable, the cgroup arithmetic), the byte format and the
out-of-memory recognizer."""

from pathlib import Path

import pytest
import torch

from ddpm.util import memory_budget
from ddpm.util.memory_budget import available_bytes, is_out_of_memory
from ddpm.util.messages import format_bytes

GiB = 1 << 30


def test_available_bytes_on_this_cpu_is_at_most_memavailable():
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    mem_available = int(meminfo["MemAvailable"].split()[0]) * 1024
    available = available_bytes(torch.device("cpu"))
    assert 0 < available <= mem_available * 1.05  # MemAvailable moves between the two reads


def test_cgroup_headroom_is_the_limit_minus_the_working_set(tmp_path, monkeypatch):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    (v2 / "memory.max").write_text(f"{8 * GiB}\n")
    (v2 / "memory.current").write_text(f"{5 * GiB}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {2 * GiB}\nactive_file 3\n")  # page cache it can drop
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    monkeypatch.setattr(memory_budget, "_cgroup_dirs", lambda: [(v2, "v2"), (v1, "v1")])
    assert memory_budget._cgroup_headroom() == 8 * GiB - (5 * GiB - 2 * GiB)
    (v2 / "memory.max").write_text("max\n")
    assert memory_budget._cgroup_headroom() is None


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(int(41.2 * GiB)) == "41.2 GiB"
    assert format_bytes(3 << 50) == "3.0 PiB"


def test_is_out_of_memory_recognizes_a_real_cpu_allocation_failure():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: no address space has room, so malloc fails at once
    assert "DefaultCPUAllocator: can't allocate memory" in str(info.value)
    assert is_out_of_memory(info.value)


def test_is_out_of_memory_recognizes_the_other_kinds_and_nothing_else():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("std::bad_alloc"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    wrapped = ValueError("the step failed")
    wrapped.__cause__ = MemoryError()
    assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not is_out_of_memory(ValueError("batch size must be at least 1, got 0"))
    assert not is_out_of_memory(KeyboardInterrupt())
