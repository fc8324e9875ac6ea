"""The weight gradient at the 28x28 recipe's shapes (batch 128, F(4x4, 3x3)) with blocks of 12, 24 (the build's
choice at these shapes), 36, 48, 72 or 96 tiles, on the padded V and dM (a scratch build reading DDPM_WGRAD_BLOCK per
call): microseconds, medians of rounds alternating the settings call by call.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/block_ab.py
"""

import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-groups")

from alternate import Arm, kernels, medians  # noqa: E402
from shapes import SHAPES, inputs  # noqa: E402

K = kernels()
SETTINGS = {"build": None, "12": "12", "36": "36", "48": "48", "72": "72", "96": "96"}

torch.manual_seed(0)
for cin, cout, side in SHAPES:
    x, g = inputs(cin, cout, side)
    arms = [
        Arm(label, "DDPM_WGRAD_BLOCK", value, lambda: K.conv3x3_winograd_weight_grad(x, g, 4))
        for label, value in SETTINGS.items()
    ]
    med = medians(arms)
    line = " ".join(f"{label} {med[label]:.0f}" for label in SETTINGS)
    best = min(list(SETTINGS)[1:], key=med.get)
    print(f"{cin}->{cout} {side}x{side}: {line}  (build/{best} {med['build'] / med[best]:.3f})", flush=True)
