"""The weight gradient at the 28x28 recipe's shapes (batch 128, F(4x4, 3x3)) with V's and dM's tiles at a padded
stride (an odd number of cache lines apart; a scratch build reading DDPM_WGRAD_PAD per call) against today's, and
the forward pass beside them: microseconds, medians of rounds alternating the three call by call, and whether both
weight gradients give the same bits.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/pad_ab.py
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
    u = K.winograd_kernel(torch.randn(cout, cin, 3, 3), 4, False)
    arms = [
        Arm("plain", "DDPM_WGRAD_PAD", None, lambda: K.conv3x3_winograd_weight_grad(x, g, 4)),
        Arm("padded", "DDPM_WGRAD_PAD", "1", lambda: K.conv3x3_winograd_weight_grad(x, g, 4)),
        Arm("forward", "DDPM_WGRAD_PAD", None, lambda: K.conv3x3_winograd(x, u, None)),
    ]
    same = torch.equal(arms[0].run()[1], arms[1].run()[1])
    med = medians(arms)
    print(
        f"{cin}->{cout} {side}x{side}: forward {med['forward']:.0f} weight grad {med['plain']:.0f} "
        f"padded {med['padded']:.0f} (plain/padded {med['plain'] / med['padded']:.3f}, same bits {same})",
        flush=True,
    )
