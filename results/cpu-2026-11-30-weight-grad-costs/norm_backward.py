"""The fused norm's backward op alone against its forward, batch 128, channels-last float32, and the backward with
its statistics pass skipped by a scratch build (``norm_stats_skip.diff``: GN_SKIP_STATS=1; the numbers it then
computes are wrong, only its time counts), the two backwards alternating call by call: ms a call, medians of 21.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-costs/norm_backward.py
"""

import os
import time

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

ROUNDS = 21


def channels_last(*shape):
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


def main() -> None:
    keep_freed_memory()
    ops.load_extension()
    kernels = torch.ops.diffusion_kernels
    torch.manual_seed(0)
    for c1, c2, side, modulated in ((32, 0, 28, True), (64, 32, 28, False), (64, 0, 14, True), (64, 0, 7, True)):
        x = channels_last(128, c1, side, side)
        x2 = channels_last(128, c2, side, side) if c2 else None
        channels = c1 + c2
        w, b = torch.randn(channels), torch.randn(channels)
        scale = torch.randn(128, channels) * 0.1 if modulated else None
        shift = torch.randn(128, channels) * 0.1 if modulated else None
        grad = channels_last(128, channels, side, side)
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
