"""The weight gradient at the 28x28 recipe's shapes (batch 128, F(4x4, 3x3)) with its products in 1, 2, 3 or 6
groups (a scratch build reading DDPM_WGRAD_GROUPS per call) and with the build's own choice: microseconds, medians
of rounds that alternate the settings call by call, and whether every setting gives the same bits.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/groups_ab.py
"""

import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-groups")

from alternate import Arm, kernels, medians  # noqa: E402
from shapes import SHAPES, inputs  # noqa: E402

K = kernels()
SETTINGS = {"auto": None, "1": "1", "2": "2", "3": "3", "6": "6"}

torch.manual_seed(0)
for cin, cout, side in SHAPES:
    x, g = inputs(cin, cout, side)
    arms = [
        Arm(label, "DDPM_WGRAD_GROUPS", value, lambda: K.conv3x3_winograd_weight_grad(x, g, 4))
        for label, value in SETTINGS.items()
    ]
    reference = arms[1].run()[1]
    same = all(torch.equal(arm.run()[1], reference) for arm in arms)
    med = medians(arms)
    line = " ".join(f"{label} {med[label]:.0f}" for label in SETTINGS)
    print(f"{cin}->{cout} {side}x{side}: {line}  (1/auto {med['1'] / med['auto']:.3f}, same bits {same})", flush=True)
