"""The weight gradient and the forward pass at the 28x28 recipe's shapes (batch 128) in F(2x2, 3x3) against F(4x4,
3x3), the build's choice on maps of 4x4 and up: microseconds, medians of rounds alternating the four call by call.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/tile_ab.py
"""

import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-groups")

from alternate import Arm, kernels, medians  # noqa: E402
from shapes import SHAPES, inputs  # noqa: E402

K = kernels()

torch.manual_seed(0)
for cin, cout, side in SHAPES:
    x, g = inputs(cin, cout, side)
    w = torch.randn(cout, cin, 3, 3)
    arms = [
        Arm("fwd F4", None, None, lambda: K.conv3x3_winograd(x, K.winograd_kernel(w, 4, False), None)),
        Arm("fwd F2", None, None, lambda: K.conv3x3_winograd(x, K.winograd_kernel(w, 2, False), None)),
        Arm("dW F4", None, None, lambda: K.conv3x3_winograd_backward(g, x, w, 4, [False, True, False])),
        Arm("dW F2", None, None, lambda: K.conv3x3_winograd_backward(g, x, w, 2, [False, True, False])),
    ]
    med = medians(arms, rounds=30, warmups=3)
    line = " ".join(f"{label} {value:.0f}" for label, value in med.items())
    print(f"{cin}->{cout} {side}x{side}: {line}", flush=True)
