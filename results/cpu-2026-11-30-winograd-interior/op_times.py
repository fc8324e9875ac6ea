"""The Winograd F(4x4, 3x3) ops alone at the 28x28 recipe's shapes (batch 128): median milliseconds of the forward
and of the whole backward, and a checksum of their outputs; run alternately against another build of the extension
(PYTHONPATH naming the folder of its .so first) to compare the two.

    PYTHONPATH=<build>:. python results/cpu-2026-11-30-winograd-interior/op_times.py LABEL
"""

from __future__ import annotations

import sys
import time

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

SHAPES = [(128, 32, 32, 28), (128, 64, 64, 28), (128, 64, 64, 14), (128, 96, 32, 28), (128, 64, 64, 7)]


def median_ms(call, repeats: int = 10) -> float:
    call()
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2]


def main() -> None:
    keep_freed_memory()
    torch.manual_seed(0)
    parts = []
    for batch, cin, cout, side in SHAPES:
        x = torch.randn(batch, cin, side, side).contiguous(memory_format=torch.channels_last)
        grad = torch.randn(batch, cout, side, side).contiguous(memory_format=torch.channels_last)
        weight = torch.randn(cout, cin, 3, 3) * 0.1
        kernel = ops.winograd_kernel(weight, tile=4)
        forward = median_ms(lambda: ops.conv3x3_winograd(x, kernel))
        wanted = (True, True, True)
        backward = median_ms(lambda: ops.conv3x3_winograd_backward(grad, x, weight, tile=4, wanted=wanted))
        y = ops.conv3x3_winograd(x, kernel)
        grads = ops.conv3x3_winograd_backward(grad, x, weight, tile=4, wanted=wanted)
        checksum = hash((y.sum().item(), grads[0].sum().item(), grads[1].sum().item())) % 10000
        parts.append(f"{cin}->{cout}@{side} fwd {forward:.2f} bwd {backward:.2f} [{checksum}]")
    print(sys.argv[1] if len(sys.argv) > 1 else "", " | ".join(parts))


if __name__ == "__main__":
    main()
