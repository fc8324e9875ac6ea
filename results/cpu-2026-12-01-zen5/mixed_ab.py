"""The 28x28 recipe's bf16 training step as train runs it on this CPU (its 3x3 convolutions by the extension's mixed
path: fp32 Winograd on the bf16 activations, read and written as bf16) against the same step with oneDNN's bf16
convolutions (nn.Conv2d's forward under autocast), alternating step by step in one process.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/mixed_ab.py [--rounds 30] [--side 28]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from torch import nn

from ddpm.training import winograd
from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--side", type=int, default=28)
    args = parser.parse_args()
    keep_freed_memory()
    times = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(side=args.side, channels=1, batch=128, folder=folder, precision="bf16")
        print(f"# {trainer.step_layout}")
        convs = [m for m in trainer.model.modules() if isinstance(m, winograd.WinogradConv2d)]
        assert convs, "the trainer swapped no Winograd convolutions in (mixed_is_fast is False here)"

        def step(on: bool) -> float:
            for conv in convs:
                if on:
                    conv.__dict__.pop("forward", None)
                else:
                    conv.forward = nn.Conv2d.forward.__get__(conv)
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
        f"{args.side}x{args.side} bf16 batch 128, {len(convs)} 3x3 convolutions, {args.rounds} rounds: oneDNN bf16 "
        f"{a:.1f} ms, mixed Winograd {b:.1f} ms a step; mixed/oneDNN median {statistics.median(ratios):.3f} "
        f"(rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
