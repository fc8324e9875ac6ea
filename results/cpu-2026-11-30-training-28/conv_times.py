"""The Winograd forward convolution and weight-gradient op alone at the 28x28 and latent steps' shapes in F(4x4, 3x3),
batch 128, median microseconds: run alternately against another build (PYTHONPATH naming the folder of its .so
first) to compare the two.

    PYTHONPATH=. python results/cpu-2026-11-30-training-28/conv_times.py
"""

import sys

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from op_times import timed  # noqa: E402


def main() -> None:
    keep_freed_memory()
    for cin, cout, side in [(32, 32, 28), (64, 64, 14), (96, 32, 28), (64, 64, 4), (32, 32, 8)]:
        x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
        g = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
        u = ops.winograd_kernel(torch.randn(cout, cin, 3, 3), tile=4)
        n = 50 if side < 10 else 10
        fwd = timed(lambda: ops.conv3x3_winograd(x, u, None), n)
        wg = timed(lambda: ops.conv3x3_winograd_weight_grad(x, g, tile=4), n)
        print(f"{cin}->{cout} {side}x{side}: fwd {fwd:.0f} wg {wg:.0f} us")


if __name__ == "__main__":
    main()
