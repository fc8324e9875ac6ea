"""Keep freed CPU memory in the process, so that a sampling or training loop on the CPU stops paying page faults.

    from ddpm.util.cpu_memory import keep_freed_memory
    keep_freed_memory()  # once, before a CPU sampling or training loop: every implementation gains alike

A U-Net forward (and backward) on the CPU allocates and frees the same few-megabyte activations every step. glibc's
malloc hands large freed blocks back to the kernel (its heap is trimmed past a threshold that it keeps
moving, and blocks above the mmap threshold are unmapped), so the next step touches fresh pages: about
2,300 page faults per forward of the benchmark's 16x16 U-Net at batch 64, each a kernel entry and a
zeroed page. PyTorch's CPU performance guide answers this with jemalloc or tcmalloc through LD_PRELOAD;
this does the same with glibc's own knobs, from inside the process: the heap is never trimmed and
blocks up to 32 MiB (glibc's largest mmap threshold) come from it. The price is resident memory: the
process keeps its peak heap until it exits, which is what a sampling or benchmark run holds anyway.

It changes malloc for the whole process, which is why the benchmark applies it once, before any row is
timed (every implementation runs under it), and why the sample mode and the trainer apply it only for the CPU. Does
nothing (returns False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory (no heap trimming; blocks up to 32 MiB from the heap).
    True when applied (now or by an earlier call), False where there is no glibc mallopt."""
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
    return bool(trimmed and mapped)


def allocator_description() -> str:
    """Apply :func:`keep_freed_memory` and say what malloc does now: the benchmarks' ``cpu_allocator`` entry."""
    return "glibc malloc keeps freed memory (cpu_memory.py)" if keep_freed_memory() else "default"
