"""Forward + backward of one 1x1 convolution on channels-last float32 activations: oneDNN's conv2d against
F.linear over the pixels (what ddpm/training/winograd.GemmConv1x1 computes), at the recipes' shapes.

    python results/cpu-2026-11-29-gemm-1x1/conv1x1_vs_linear.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = [(128, 96, 32, 8), (128, 64, 32, 8), (128, 64, 192, 2), (128, 64, 64, 2), (128, 128, 64, 2)]
SHAPES += [(128, 128, 64, 4), (128, 64, 192, 4), (128, 96, 32, 28), (128, 64, 32, 28)]


def timed(fn, reps: int = 40) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    torch.manual_seed(0)
    for batch, cin, cout, side in SHAPES:
        x = torch.randn(batch, cin, side, side).contiguous(memory_format=torch.channels_last).requires_grad_()
        w = torch.randn(cout, cin, 1, 1, requires_grad=True)
        b = torch.randn(cout, requires_grad=True)
        dy = torch.randn(batch, cout, side, side).contiguous(memory_format=torch.channels_last)

        def conv() -> None:
            F.conv2d(x, w, b).backward(dy)

        def linear() -> None:
            F.linear(x.permute(0, 2, 3, 1), w.view(cout, cin), b).permute(0, 3, 1, 2).backward(dy)

        print(batch, cin, cout, side, f"conv {timed(conv):.3f} ms  linear {timed(linear):.3f} ms")


if __name__ == "__main__":
    main()
