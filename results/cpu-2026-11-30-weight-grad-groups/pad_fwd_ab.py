"""The forward Winograd convolution at the 28x28 recipe's shapes (batch 128, fp32, F(4x4, 3x3)) with V's and M's
tiles at a padded stride (an odd number of cache lines apart; a scratch build reading DDPM_FWD_PAD per call) against
today's: microseconds, medians of rounds alternating the two call by call, and whether both give the same bits.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/pad_fwd_ab.py
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


def run(pad, x, u):
    if pad:
        os.environ["DDPM_FWD_PAD"] = "1"
    else:
        os.environ.pop("DDPM_FWD_PAD", None)
    start = time.perf_counter()
    out = K.conv3x3_winograd(x, u, None)
    return time.perf_counter() - start, out


torch.manual_seed(0)
for cin, cout, side in SHAPES:
    x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
    u = K.winograd_kernel(torch.randn(cout, cin, 3, 3), 4, False)
    same = torch.equal(run(True, x, u)[1], run(False, x, u)[1])
    times = {False: [], True: []}
    for _ in range(5):
        run(False, x, u), run(True, x, u)
    for _ in range(40):
        for pad in (False, True):
            times[pad].append(run(pad, x, u)[0])
    plain, padded = (statistics.median(times[p]) * 1e6 for p in (False, True))
    print(
        f"{cin}->{cout} {side}x{side}: forward {plain:.0f} padded {padded:.0f} "
        f"(plain/padded {plain / padded:.3f}, same bits {same})",
        flush=True,
    )
