"""group_norm_act's forward (fp32, channels-last, no SiLU) per group width: 16 samples, one thread, the best of 3 runs
of 30 calls each.

    PYTHONPATH=. python results/cpu-2026-11-29-gemm-1x1/group_norm_widths.py
"""

from __future__ import annotations

import time

import torch

from ddpm.kernels import ops

CASES = [(192, 32, 28, 28), (192, 48, 28, 28), (96, 16, 28, 28), (384, 64, 28, 28), (160, 32, 28, 28)]
CASES += [(224, 32, 28, 28), (192, 32, 1, 784), (192, 32, 6, 7), (192, 48, 6, 7)]


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def main() -> None:
    ops.load_extension()
    torch.set_num_threads(1)
    for channels, groups, height, width in CASES:
        x = torch.randn(16, channels, height, width).contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(channels), torch.randn(channels)
        ms = timed(lambda: ops.group_norm_act(x, w, b, groups=groups, silu=False))
        print(
            channels, groups, height, width, f"cg={channels / groups:g} {ms:.3f} ms, {x.numel() / ms / 1e6:.2f} Gelem/s"
        )


if __name__ == "__main__":
    main()
