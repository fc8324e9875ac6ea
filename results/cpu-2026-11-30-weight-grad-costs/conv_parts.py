"""The Winograd convolution's forward, input gradient and weight gradient alone at the 28x28 recipe's shapes (batch
from $B, default 128), channels-last float32, medians of $N calls after 3 warm-ups, ms a call.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-costs/conv_parts.py
"""

import os
import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-costs")

from timing import median_seconds  # noqa: E402

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

keep_freed_memory()
torch.manual_seed(0)
B = int(os.environ.get("B", "128"))
N = int(os.environ.get("N", "15"))
for cin, cout, side in [(32, 32, 28), (64, 64, 14), (64, 64, 7), (128, 64, 7), (96, 32, 28)]:
    x = torch.randn(B, cin, side, side).contiguous(memory_format=torch.channels_last)
    g = torch.randn(B, cout, side, side).contiguous(memory_format=torch.channels_last)
    w = torch.randn(cout, cin, 3, 3) * 0.1
    tile = ops.winograd_tile(side)
    u = ops.winograd_kernel(w, tile=tile)
    calls = {
        "fwd": lambda: ops.conv3x3_winograd(x, u, None),
        "dx": lambda: ops.conv3x3_winograd_backward(g, x, w, tile=tile, wanted=(True, False, False)),
        "dw": lambda: ops.conv3x3_winograd_backward(g, x, w, tile=tile, wanted=(False, True, False)),
    }
    ms = {}
    for name, call in calls.items():
        ms[name] = median_seconds(call, n=N, warmups=3) * 1e3
    print(
        f"{cin:3d}->{cout:3d} {side:2d}x{side:2d} batch {B} tile {tile}: fwd {ms['fwd']:6.2f} dx {ms['dx']:6.2f} "
        f"dw {ms['dw']:6.2f} ms, dw/fwd {ms['dw'] / ms['fwd']:.2f}",
        flush=True,
    )
