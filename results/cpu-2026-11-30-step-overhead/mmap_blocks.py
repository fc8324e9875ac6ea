"""glibc malloc and large blocks: a clone of a channels-last (128, C, 28, 28) float32 tensor with malloc as it comes
("none"), with util/memory.keep_freed_memory's settings ("keep": no trimming, the mmap threshold at its 32 MiB
maximum), and with mmap off as well ("nommap", M_MMAP_MAX = 0): blocks over 32 MiB are mapped afresh, and so
page-faulted, on every allocation unless mmap is off.

    python results/cpu-2026-11-30-step-overhead/mmap_blocks.py none|keep|nommap
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4


def median_seconds(f, n: int = 10) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - started) / n)
    return sorted(times)[2]


def main(mode: str) -> None:
    torch.set_num_threads(2)
    libc = ctypes.CDLL("libc.so.6")
    if mode != "none":
        assert libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20) == 1
    if mode == "nommap":
        assert libc.mallopt(M_MMAP_MAX, 0) == 1
    for channels in (64, 96, 128):
        x = torch.randn(128, channels, 28, 28).contiguous(memory_format=torch.channels_last)
        ms = median_seconds(lambda: x.clone()) * 1e3
        print(f"{mode} {channels} channels: clone {ms:.2f} ms ({x.numel() * 4 / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main(sys.argv[1])
