"""The backward op's parts one by one (microseconds, medians of 300 after 20 warm-ups), batch 2 and 128: the forward
with a precomputed kernel transform, the same convolution of the output gradient with the rotated transform, the
rotated transform alone, the op asked for dL/dx only, the weight gradient's partial sums and their sum
(conv3x3_winograd_weight_grad), the op asked for dL/dg only, and all three gradients.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-costs/op_parts.py
"""

import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-costs")

from timing import median_seconds  # noqa: E402

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

keep_freed_memory()
ops.load_extension()
K = torch.ops.diffusion_kernels


def median_us(call, n=300):
    return median_seconds(call, n=n, warmups=20) * 1e6


for B in (2, 128):
    for cin, cout, side in ((64, 64, 7), (32, 32, 28)):
        x = torch.randn(B, cin, side, side).contiguous(memory_format=torch.channels_last)
        g = torch.randn(B, cout, side, side).contiguous(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, 3, 3)
        u, rotated = K.winograd_kernel(w, 4, False), K.winograd_kernel(w, 4, True)
        parts = {
            "fwd": lambda: K.conv3x3_winograd(x, u, None),
            "conv_rot": lambda: K.conv3x3_winograd(g, rotated, None),
            "kernel_rot": lambda: K.winograd_kernel(w, 4, True),
            "dx_op": lambda: K.conv3x3_winograd_backward(g, x, w, 4, [True, False, False]),
            "weight_grad": lambda: K.conv3x3_winograd_weight_grad(x, g, 4),
            "dw_op": lambda: K.conv3x3_winograd_backward(g, x, w, 4, [False, True, False]),
            "all_op": lambda: K.conv3x3_winograd_backward(g, x, w, 4, [True, True, True]),
        }
        line = " ".join(f"{name} {median_us(call):.0f}" for name, call in parts.items())
        print(f"batch {B} {cin}->{cout} {side}x{side}: {line}", flush=True)
