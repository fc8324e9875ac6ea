"""Two settings of the 28x28 recipe's training step, alternating step by step in one trainer (the host's pace moves
too much between processes to compare them): what attention_ab.py and tn_ab.py share.

    from ab import alternate
    print(alternate(set_setting, rounds=40, names=("one product", "chunks")))
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def arguments(rounds: int) -> argparse.Namespace:
    """--side, --channels (the recipe's image) and --rounds (pairs of steps)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser.parse_args()


def alternate(args: argparse.Namespace, setting: Callable[[object, bool], None], names: tuple[str, str]) -> str:
    """Steps of one recipe trainer with ``setting(trainer, False)`` and ``setting(trainer, True)`` in turn (the pair's
    order flipping every round), after two warm-up pairs: the median milliseconds a step of each and the median of
    the per-round ratios (second / first)."""
    times = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(side=args.side, channels=args.channels, batch=128, folder=folder)

        def step(second: bool) -> float:
            setting(trainer, second)
            start = time.perf_counter()
            trainer.train_step()
            return time.perf_counter() - start

        for second in (False, True, False, True):
            step(second)
        for r in range(args.rounds):
            for second in (False, True) if r % 2 == 0 else (True, False):
                times[second].append(step(second))
    ratios = [b / a for a, b in zip(times[False], times[True])]
    first, second = (1e3 * statistics.median(times[k]) for k in (False, True))
    return (
        f"{args.side}x{args.side}x{args.channels} batch 128, {args.rounds} rounds: {names[0]} {first:.1f} ms, "
        f"{names[1]} {second:.1f} ms a step; {names[1]}/{names[0]} median {statistics.median(ratios):.3f} "
        f"(rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )
