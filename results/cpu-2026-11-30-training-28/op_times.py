"""The Winograd training ops timed alone at the latent step's shapes (batch 8 and 128, F(4x4, 3x3)), median
microseconds of 50 calls: the forward convolution, the kernel transform, the backward op asked for each gradient
alone, the weight-gradient op, and oneDNN's convolution backward for scale. Run alternately against another build
(PYTHONPATH naming the folder of its .so first) to compare the two.

    PYTHONPATH=. python results/cpu-2026-11-30-training-28/op_times.py
"""

import time

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory


def timed(f, n=50) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[n // 2] * 1e6


def main() -> None:
    torch.manual_seed(0)
    keep_freed_memory()  # as the trainer does
    for batch in (8, 128):
        for cin, cout, side in [(32, 32, 8), (64, 64, 4), (64, 64, 2), (128, 64, 4)]:
            x = torch.randn(batch, cin, side, side).contiguous(memory_format=torch.channels_last)
            g = torch.randn(batch, cout, side, side).contiguous(memory_format=torch.channels_last)
            w = torch.randn(cout, cin, 3, 3)
            u = ops.winograd_kernel(w, tile=4)
            rows = dict(
                fwd=timed(lambda: ops.conv3x3_winograd(x, u, None)),
                kern=timed(lambda: ops.winograd_kernel(w, tile=4)),
                dx=timed(lambda: ops.conv3x3_winograd_backward(g, x, w, tile=4, wanted=(True, False, False))),
                dw=timed(lambda: ops.conv3x3_winograd_backward(g, x, w, tile=4, wanted=(False, True, False))),
                db=timed(lambda: ops.conv3x3_winograd_backward(g, x, w, tile=4, wanted=(False, False, True))),
                wg=timed(lambda: ops.conv3x3_winograd_weight_grad(x, g, tile=4)),
                onednn_bwd=timed(
                    lambda: torch.ops.aten.convolution_backward(
                        g, x, w, [cout], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
                    )
                ),
            )
            print(f"B{batch} {cin}->{cout} {side}x{side}: " + " ".join(f"{k} {v:.0f}" for k, v in rows.items()) + " us")


if __name__ == "__main__":
    main()
