"""The 28x28 recipe's training step with the fused skips' weight gradients as one product (torch.mm) or as batched
row chunks (training/winograd.py's _tn), alternating step by step in one process: median milliseconds a step of each
and the median of their per-round ratios.

    PYTHONPATH=. python results/cpu-2026-11-30-small-ops/tn_ab.py [--side 28 --channels 1] [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from ddpm.training import winograd

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    times = {False: [], True: []}
    chunks = winograd._TN_MIN_ROWS
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(side=args.side, channels=args.channels, batch=128, folder=folder)

        def step(chunked: bool) -> float:
            winograd._TN_MIN_ROWS = chunks if chunked else 1 << 40
            start = time.perf_counter()
            trainer.train_step()
            return time.perf_counter() - start

        for chunked in (False, True, False, True):
            step(chunked)
        for r in range(args.rounds):
            for chunked in (False, True) if r % 2 == 0 else (True, False):
                times[chunked].append(step(chunked))
    ratios = [c / m for m, c in zip(times[False], times[True])]
    print(
        f"{args.side}x{args.side}x{args.channels} batch 128, {args.rounds} rounds: one product "
        f"{1e3 * statistics.median(times[False]):.1f} ms, chunks {1e3 * statistics.median(times[True]):.1f} ms a step; "
        f"chunks/one median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
