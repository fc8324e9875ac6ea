"""The forward Winograd convolution at the 28x28 recipe's shapes (batch 128, fp32, F(4x4, 3x3)) with V's and M's
tiles at a padded stride (an odd number of cache lines apart; a scratch build reading DDPM_FWD_PAD per call) against
today's: microseconds, medians of rounds alternating the two call by call, and whether both give the same bits.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/pad_fwd_ab.py
"""

import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-groups")

from alternate import Arm, kernels, medians  # noqa: E402
from shapes import SHAPES  # noqa: E402

K = kernels()

torch.manual_seed(0)
for cin, cout, side in SHAPES:
    x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
    u = K.winograd_kernel(torch.randn(cout, cin, 3, 3), 4, False)
    arms = [
        Arm("plain", "DDPM_FWD_PAD", None, lambda: K.conv3x3_winograd(x, u, None)),
        Arm("padded", "DDPM_FWD_PAD", "1", lambda: K.conv3x3_winograd(x, u, None)),
    ]
    same = torch.equal(arms[0].run()[1], arms[1].run()[1])
    med = medians(arms)
    print(
        f"{cin}->{cout} {side}x{side}: forward {med['plain']:.0f} padded {med['padded']:.0f} "
        f"(plain/padded {med['plain'] / med['padded']:.3f}, same bits {same})",
        flush=True,
    )
