"""Where the weight gradient's time goes: conv3x3_winograd_weight_grad (the partial sums of dL/dU) with stages
skipped by a scratch build (``stage_skip.diff``: WG_GSKIP bits 1 the input transform, 2 the output gradient's
adjoint transform, 4 the GEMMs; a stage reading a skipped stage's buffer reads stale memory, so single-stage rows
are rough), beside the forward convolution of the same shape; ms a call, medians of 21, batch 128.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-costs/stage_skip.py
"""

import os
import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-costs")

from timing import median_seconds  # noqa: E402

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

STAGES = [("all", 0), ("no input transform", 1), ("no adjoint", 2), ("no GEMM", 4), ("GEMM only", 3)]
STAGES += [("input transform only", 6), ("adjoint only", 5)]


def median_ms(call, n=21):
    return median_seconds(call, n=n, warmups=3) * 1e3


def main() -> None:
    keep_freed_memory()
    torch.manual_seed(0)
    for cin, cout, side in [(32, 32, 28), (64, 64, 14), (64, 64, 7)]:
        x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
        g = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, 3, 3) * 0.1
        tile = ops.winograd_tile(side)
        u = ops.winograd_kernel(w, tile=tile)
        cells = [f"fwd {median_ms(lambda: ops.conv3x3_winograd(x, u, None)):.2f}"]
        for label, bits in STAGES:
            os.environ["WG_GSKIP"] = str(bits)
            cells.append(f"{label} {median_ms(lambda: ops.conv3x3_winograd_weight_grad(x, g, tile=tile)):.2f}")
        print(f"{cin}->{cout} {side}x{side}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
