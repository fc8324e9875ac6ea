"""How much memory there is, whether an error was memory running out, and keeping freed CPU memory in the process.

    available_bytes(torch.device("cpu"))        # MemAvailable, bounded by a cgroup memory limit
    is_out_of_memory(exc)                       # True for any allocation failure, CPU or GPU
    keep_freed_memory()                         # once, before a CPU loop: glibc stops handing freed pages back

The checks before work (ddpm/batch_memory.py for a U-Net batch, datasets held in memory) measure against
available_bytes; keep_freed_memory spares a CPU loop the page faults of re-allocating the same activations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ddpm.util.messages import format_bytes

SAFETY_FRACTION = 0.9  # plan for at most this share of the available memory


# ----- what is available ---------------------------------------------------------------------------
def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_dirs() -> list[tuple[Path, str]]:
    """(directory, version) of this process's memory cgroup and its ancestors, where they are mounted."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[Path, str]] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, version = Path("/sys/fs/cgroup"), "v2"
        elif "memory" in controllers.split(","):
            root, version = Path("/sys/fs/cgroup/memory"), "v1"
        else:
            continue
        # In a container the process's own cgroup is usually mounted as the root, so the path may not exist.
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            found.append((root.joinpath(*parts[:depth]), version))
    return found


def _cgroup_headroom() -> int | None:
    """The smallest (limit - working set) over the cgroups that limit this process, if any does."""
    headroom = None
    for directory, version in _cgroup_dirs():
        if version == "v2":
            limit, usage = _read_int(directory / "memory.max"), _read_int(directory / "memory.current")
            reclaimable = _stat_value(directory / "memory.stat", "inactive_file")
        else:
            limit, usage = (
                _read_int(directory / "memory.limit_in_bytes"),
                _read_int(directory / "memory.usage_in_bytes"),
            )
            reclaimable = _stat_value(directory / "memory.stat", "total_inactive_file")
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes a huge number for no limit
            continue
        room = max(0, limit - max(0, usage - reclaimable))  # page cache that can be dropped is not in use
        headroom = room if headroom is None else min(headroom, room)
    return headroom


def _host_available() -> int:
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 1 << 62  # nothing to go by: do not refuse anything
    cgroup = _cgroup_headroom()
    return available if cgroup is None else min(available, cgroup)


def available_bytes(device: torch.device) -> int:
    """Bytes a new allocation can use now on ``device``: free GPU memory (plus what this process's
    caching allocator holds unused), or the host's MemAvailable bounded by a cgroup memory limit."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    return _host_available()


def check_held_in_host_memory(need: int, *, what: str, advice: Callable[[int], str]) -> None:
    """Refuse data that would be held whole in host memory when it needs more than half of what is
    available (the work on it needs the rest); ``advice(available bytes)`` says what to change."""
    free = available_bytes(torch.device("cpu"))
    if need > 0.5 * free:
        raise ValueError(
            f"{what} need {format_bytes(need)} in memory and {format_bytes(free)} is available; {advice(free)}"
        )


# ----- out-of-memory errors ------------------------------------------------------------------------
# First-line fragments (lower case) of the RuntimeErrors PyTorch raises when an allocation fails:
# c10's DefaultCPUAllocator ("[enforce fail at alloc_cpu.cpp:...] err == 0. DefaultCPUAllocator: can't
# allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)"), C++'s
# std::bad_alloc passed through as its what(), "... not enough memory" (NNPACK, oneMKL), and CUDA
# libraries' "out of memory" / CUBLAS_STATUS_ALLOC_FAILED / CUDNN_STATUS_ALLOC_FAILED.
_OOM_FRAGMENTS = (
    "can't allocate memory",
    "std::bad_alloc",
    "not enough memory",
    "out of memory",
    "status_alloc_failed",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure on a CPU or a GPU (MemoryError, torch.OutOfMemoryError, the
    allocator's RuntimeErrors), also when it is the cause of the exception that reached us."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
            return True
        if isinstance(exc, RuntimeError):
            lines = str(exc).strip().splitlines()
            if lines and any(fragment in lines[0].lower() for fragment in _OOM_FRAGMENTS):
                return True
        exc = exc.__cause__
    return False


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory: no heap trimming, and every block from the heap, since a block
    mapped afresh (glibc's way past 32 MiB, the most its threshold takes) faults in every page each time it is
    allocated. True when applied (now or by an earlier call), False where there is no glibc mallopt."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trimmed = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)  # glibc returns 1 on success, 0 on failure
    mapped = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    unmapped = mallopt(_M_MMAP_MAX, 0)
    return bool(trimmed and mapped and unmapped)


def allocator_description() -> str:
    """Apply :func:`keep_freed_memory` and say what malloc does now: the benchmarks' ``cpu_allocator`` entry."""
    return "glibc malloc keeps freed memory (util/memory.py)" if keep_freed_memory() else "default"
