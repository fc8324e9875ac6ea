"""The weight gradient at the 28x28 recipe's shapes (batch 128, F(4x4, 3x3)) with blocks of 12, 24 (the build's
choice at these shapes), 36, 48, 72 or 96 tiles, on the padded V and dM (a scratch build reading DDPM_WGRAD_BLOCK per
call): microseconds, medians of rounds alternating the settings call by call.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/block_ab.py
"""

import os
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
SETTINGS = ("build", "12", "36", "48", "72", "96")


def run(setting, x, g):
    if setting == "build":
        os.environ.pop("DDPM_WGRAD_BLOCK", None)
    else:
        os.environ["DDPM_WGRAD_BLOCK"] = setting
    start = time.perf_counter()
    out = K.conv3x3_winograd_weight_grad(x, g, 4)
    return time.perf_counter() - start, out


torch.manual_seed(0)
for cin, cout, side in SHAPES:
    x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
    g = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
    times = {s: [] for s in SETTINGS}
    for _ in range(5):
        for s in SETTINGS:
            run(s, x, g)
    for _ in range(40):
        for s in SETTINGS:
            times[s].append(run(s, x, g)[0])
    med = {s: statistics.median(t) * 1e6 for s, t in times.items()}
    line = " ".join(f"{s} {med[s]:.0f}" for s in SETTINGS)
    best = min(SETTINGS[1:], key=med.get)
    print(f"{cin}->{cout} {side}x{side}: {line}  (build/{best} {med['build'] / med[best]:.3f})", flush=True)
