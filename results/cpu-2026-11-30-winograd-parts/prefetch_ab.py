"""The prefetch's effect, interleaved in one process: a scratch build of diffusion_winograd.cpp whose WinogradConv
reads WG_PF at each call (WG_PF=0: no prefetch; the committed code has no switch) alternates prefetch off and on,
per op (forward and whole backward at four of the 28x28 recipe's layers, 24 pairs each) or per training step (two
trainers built alike, their steps alternating, `--step` rounds); prints the median of the on/off ratios.

    PYTHONPATH=. python results/cpu-2026-11-30-winograd-parts/prefetch_ab.py [--step 32] [--side 28 --channels 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def with_prefetch(on: bool, function) -> float:
    os.environ["WG_PF"] = "1" if on else "0"
    return timed(function)


def ops_rounds() -> None:
    ops.load_extension()
    backward = torch.ops.diffusion_kernels.conv3x3_winograd_backward
    torch.manual_seed(0)
    for cin, cout, side in [(32, 32, 28), (64, 64, 14), (64, 64, 7), (96, 32, 28)]:
        x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
        weight = torch.randn(cout, cin, 3, 3) * 0.1
        grad = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
        kernel = ops.winograd_kernel(weight, tile=4)
        calls = {
            "forward": lambda: ops.conv3x3_winograd(x, kernel, None),
            "backward": lambda: backward(grad, x, weight, 4, [True, True, True]),
        }
        line = []
        for name, call in calls.items():
            call(), call()
            ratios = [with_prefetch(True, call) / with_prefetch(False, call) for _ in range(24)]
            line.append(f"{name} {statistics.median(ratios):.3f}")
        print(f"{cin}->{cout} at {side}x{side}, on/off: " + ", ".join(line))


def step_rounds(rounds: int, side: int, channels: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        trainers = {}
        for name in ("on", "off"):
            os.makedirs(f"{folder}/{name}")
            trainers[name] = recipe_trainer(side=side, channels=channels, batch=128, folder=f"{folder}/{name}")
        ratios = []
        for round_ in range(-2, rounds):  # two rounds of warm-up
            order = ("on", "off") if round_ % 2 else ("off", "on")
            times = {name: with_prefetch(name == "on", trainers[name].train_step) for name in order}
            if round_ >= 0:
                ratios.append(times["on"] / times["off"])
                print(f"round {round_}: on {1e3 * times['on']:.0f} ms, off {1e3 * times['off']:.0f} ms", flush=True)
    print(
        f"step on/off, median of {len(ratios)}: {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", type=int, default=0, help="rounds of training steps (0: the ops instead)")
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    args = parser.parse_args()
    keep_freed_memory()
    if args.step:
        step_rounds(args.step, args.side, args.channels)
    else:
        ops_rounds()


if __name__ == "__main__":
    main()
