"""util/memory.py: the memory a run measures against (available_bytes, out-of-memory errors) and keeping
freed CPU memory in the process."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, make_trainer

from ddpm.util import memory
from ddpm.util.memory import available_bytes, is_out_of_memory, keep_freed_memory
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
    monkeypatch.setattr(memory, "_cgroup_dirs", lambda: [(v2, "v2"), (v1, "v1")])
    assert memory._cgroup_headroom() == 8 * GiB - (5 * GiB - 2 * GiB)
    (v2 / "memory.max").write_text("max\n")
    assert memory._cgroup_headroom() is None


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


def _faults_of_one_step(megabytes: int = 24) -> int:
    """Minor page faults of allocating, touching and freeing a few activation-sized tensors (one 'step')."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(megabytes * 2**20 // 4 // 3) for _ in range(3)]  # written: every page touched
    del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_stops_page_faults_on_repeated_steps():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent
    for _ in range(6):  # the first steps grow the heap: their pages fault once
        _faults_of_one_step()
    repeats = [_faults_of_one_step() for _ in range(3)]
    # 24 MB of fresh pages is ~6,000 faults a step (glibc's default); kept memory is reused without any. The
    # median, since another thread's allocation can land in one step's count (321 seen once on 2 cores).
    median = sorted(repeats)[1]
    assert median < 200, f"{repeats} page faults on repeated steps: freed memory was returned to the kernel"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_keeps_blocks_past_glibcs_mmap_threshold():
    """Activations of 40 MB (a 96-channel 28x28 batch of 128 is 38.5 MB) come from the heap too: glibc maps any
    block past 32 MiB afresh otherwise, every page faulting on every step. In a fresh process: a failed allocation
    (another test's) moves this one's thread to a malloc arena of its own, whose heaps are unmapped when free."""
    script = """
import sys
sys.path[:0] = ["tests", "tests/util"]
from test_memory import _faults_of_one_step
from ddpm.util.memory import keep_freed_memory
assert keep_freed_memory()
for _ in range(4):
    _faults_of_one_step(120)  # three 40 MB tensors
print(sorted(_faults_of_one_step(120) for _ in range(3))[1])
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    median = int(done.stdout.split()[-1])
    assert median < 200, f"{median} page faults a step on 40 MB tensors: glibc mapped them afresh"


def test_the_cpu_trainer_keeps_freed_memory(tmp_path, monkeypatch):
    # A training step frees and reallocates its activations like a sampling step: the trainer asks for the same
    # malloc setting on a CPU (BENCHMARKS.md, "A faster CPU training step").
    import ddpm.training.trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: calls.append("cpu") or True)
    make_trainer(tmp_path)
    assert calls == ["cpu"]
