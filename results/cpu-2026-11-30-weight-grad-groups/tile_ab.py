"""The weight gradient and the forward pass at the 28x28 recipe's shapes (batch 128) in F(2x2, 3x3) against F(4x4,
3x3), the build's choice on maps of 4x4 and up: microseconds, medians of rounds alternating the two call by call.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/tile_ab.py
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-groups")

from shapes import SHAPES  # noqa: E402

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

keep_freed_memory()
ops.load_extension()
K = torch.ops.diffusion_kernels


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


torch.manual_seed(0)
for cin, cout, side in SHAPES:
    x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
    g = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
    w = torch.randn(cout, cin, 3, 3)
    calls = {
        "fwd F4": lambda: K.conv3x3_winograd(x, K.winograd_kernel(w, 4, False), None),
        "fwd F2": lambda: K.conv3x3_winograd(x, K.winograd_kernel(w, 2, False), None),
        "dW F4": lambda: K.conv3x3_winograd_backward(g, x, w, 4, [False, True, False]),
        "dW F2": lambda: K.conv3x3_winograd_backward(g, x, w, 2, [False, True, False]),
    }
    times = {name: [] for name in calls}
    for _ in range(3):
        for call in calls.values():
            call()
    for _ in range(30):
        for name, call in calls.items():
            times[name].append(seconds(call))
    med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    line = " ".join(f"{name} {value:.0f}" for name, value in med.items())
    print(f"{cin}->{cout} {side}x{side}: {line}", flush=True)
