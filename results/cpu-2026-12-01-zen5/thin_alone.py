"""The thin 3x3 convolutions alone (batch 128, channels-last float32, two threads): the extension's conv3x3_thin and
its backward against oneDNN's (F.conv2d and autograd), medians of 30 calls, each after a check against float64.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/thin_alone.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

# (Cin, Cout, side): the 28x28 recipe's first and last convolutions, the latent recipe's, RGB's at 32x32.
SHAPES = [(32, 1, 28), (1, 32, 28), (32, 4, 8), (4, 32, 8), (32, 3, 32), (3, 32, 32)]


def median_ms(call, repeats: int = 30) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2]


def main() -> None:
    keep_freed_memory()
    ops.load_extension()
    torch.set_num_threads(2)
    for cin, cout, side in SHAPES:
        x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(cout, cin, 3, 3) * 0.1, torch.randn(cout)
        g = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
        reference = F.conv2d(x.double(), w.double(), b.double(), padding=1)
        error = ((ops.conv3x3_thin(x, w, b).double() - reference).abs().max() / reference.abs().max()).item()
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]

        def onednn_both():
            F.conv2d(*leaves, padding=1).backward(g)

        def ours_both():
            ops.conv3x3_thin(x, w, b)
            ops.conv3x3_thin_backward(g, x, w, wanted=(True, True, True))

        onednn_forward = median_ms(lambda: F.conv2d(x, w, b, padding=1))
        ours_forward = median_ms(lambda: ops.conv3x3_thin(x, w, b))
        print(
            f"{cin} -> {cout} at {side}x{side} (largest error against float64 {error:.1e}): forward oneDNN "
            f"{onednn_forward:.2f} ms, ours {ours_forward:.2f} ms; forward and all three gradients oneDNN "
            f"{median_ms(onednn_both):.2f} ms, ours {median_ms(ours_both):.2f} ms"
        )


if __name__ == "__main__":
    main()
