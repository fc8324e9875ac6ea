"""The fused norm's backward op alone against its forward, batch 128, channels-last float32, and the backward with
its statistics pass skipped by a scratch build (``norm_stats_skip.diff``: GN_SKIP_STATS=1; the numbers it then
computes are wrong, only its time counts), the two backwards alternating call by call: ms a call, medians of 21.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-costs/norm_backward.py
"""

import os
import sys
import time

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-costs")

from norm_alone import SHAPES, channels_last, norm_inputs  # noqa: E402

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

ROUNDS = 21


def main() -> None:
    keep_freed_memory()
    ops.load_extension()
    kernels = torch.ops.diffusion_kernels
    torch.manual_seed(0)
    for c1, c2, side, modulated in SHAPES:
        x, x2, w, b, scale, shift = norm_inputs(c1, c2, side, modulated)
        grad = channels_last(128, c1 + c2, side, side)
        options = dict(groups=32, eps=1e-5, silu=True)

        def forward():
            return kernels.group_norm_act(x, x2, w, b, None, scale, shift, **options)  # noqa: B023

        def backward():
            return kernels.group_norm_act_backward(grad, x, x2, w, b, scale, shift, **options)  # noqa: B023

        times = {"fwd": [], "bwd": [], "bwd no stats": []}
        for _ in range(3):
            forward()
            backward()
        for r in range(ROUNDS):
            start = time.perf_counter()
            forward()
            times["fwd"].append(time.perf_counter() - start)
            order = (("bwd", "0"), ("bwd no stats", "1"))
            for key, skip in order if r % 2 else order[::-1]:
                os.environ["GN_SKIP_STATS"] = skip
                start = time.perf_counter()
                backward()
                times[key].append(time.perf_counter() - start)
        ms = {key: sorted(v)[ROUNDS // 2] * 1e3 for key, v in times.items()}
        print(
            f"{c1}+{c2} ch {side}x{side} mod={modulated}: "
            + ", ".join(f"{key} {v:.2f} ms" for key, v in ms.items())
            + f"; bwd/fwd {ms['bwd'] / ms['fwd']:.2f}, stats pass {1 - ms['bwd no stats'] / ms['bwd']:.0%} of bwd",
            flush=True,
        )


if __name__ == "__main__":
    main()
