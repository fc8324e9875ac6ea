"""The 28x28 recipe's 3x3 convolutions in bf16 (batch 128, channels-last, two threads): oneDNN's forward and its
forward and backward (autograd) against the extension's bf16 Winograd forward (F(2x2, 3x3) on AVX512-BF16's dot
products, the sampling runner's) and the fp32 Winograd forward in F(4x4, 3x3), medians of 20 calls: what a bf16
Winograd training step could gain on a CPU with the instruction.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/bf16_winograd.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

SHAPES = [(32, 32, 28), (96, 32, 28), (64, 64, 28), (64, 64, 14), (128, 64, 14), (64, 64, 7)]


def median_ms(call, repeats: int = 20) -> float:
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
    cl = torch.channels_last
    for cin, cout, side in SHAPES:
        x = torch.randn(128, cin, side, side).contiguous(memory_format=cl)
        w, b = torch.randn(cout, cin, 3, 3) * 0.1, torch.randn(cout)
        xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
        g = torch.randn(128, cout, side, side).bfloat16().contiguous(memory_format=cl)
        u16 = ops.winograd_weight(w, dtype=torch.bfloat16)
        u4 = ops.winograd_weight(w, tile=4)
        onednn = median_ms(lambda: F.conv2d(xb, wb, bb, padding=1))
        ours16 = median_ms(lambda: ops.conv3x3_winograd(xb, u16, b))
        ours4 = median_ms(lambda: ops.conv3x3_winograd(x, u4, b))
        xr, wr = xb.detach().requires_grad_(), wb.detach().requires_grad_()

        def both() -> None:
            F.conv2d(xr, wr, bb, padding=1).backward(g)

        onednn_both = median_ms(both)
        print(
            f"{cin} -> {cout} at {side}x{side}: forward oneDNN bf16 {onednn:.2f} ms, Winograd bf16 F(2x2) "
            f"{ours16:.2f} ms, Winograd fp32 F(4x4) {ours4:.2f} ms; "
            f"oneDNN bf16 forward and backward {onednn_both:.2f} ms"
        )


if __name__ == "__main__":
    main()
