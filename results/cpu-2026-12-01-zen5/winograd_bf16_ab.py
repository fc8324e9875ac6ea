"""The 28x28 recipe's bf16 training step (autocast, oneDNN's bf16 convolutions) against the same step with its 3x3
convolutions trained in fp32 Winograd (the bf16 input widened, the fp32 weights as they are, the output rounded to
bf16), alternating step by step in one process: whether fp32 Winograd inside a bf16 step beats oneDNN's bf16
convolutions on a CPU with AVX512-BF16 but no AMX.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/winograd_bf16_ab.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from ddpm.training import winograd
from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def widened(self: winograd.WinogradConv2d, x: torch.Tensor) -> torch.Tensor:
    """conv3x3 in fp32 on a bf16 input under CPU autocast, the output rounded to bf16."""
    if x.dtype == torch.bfloat16 and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return winograd.conv3x3(x.float(), self.weight, self.bias).bfloat16()
    return nn.Conv2d.forward(self, x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--side", type=int, default=28)
    args = parser.parse_args()
    keep_freed_memory()
    times = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(side=args.side, channels=1, batch=128, folder=folder, precision="bf16")
        swapped = winograd.use_winograd_convs(trainer.model, side=1)
        convs = [m for m in trainer.model.modules() if isinstance(m, winograd.WinogradConv2d)]

        def step(on: bool) -> float:
            for conv in convs:
                conv.forward = widened.__get__(conv) if on else nn.Conv2d.forward.__get__(conv)
            start = time.perf_counter()
            trainer.train_step()
            return time.perf_counter() - start

        for on in (False, True, False, True):
            step(on)
        for r in range(args.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                times[on].append(step(on))
    ratios = [b / a for a, b in zip(times[False], times[True])]
    a, b = (1e3 * statistics.median(times[k]) for k in (False, True))
    print(
        f"{args.side}x{args.side} bf16 batch 128, {swapped} 3x3 convolutions, {args.rounds} rounds: oneDNN bf16 "
        f"{a:.1f} ms, fp32 Winograd {b:.1f} ms a step; Winograd/oneDNN median {statistics.median(ratios):.3f} "
        f"(rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
