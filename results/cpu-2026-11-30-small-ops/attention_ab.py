"""The 28x28 recipe's training step with its attention blocks by scaled_dot_product_attention (the fused CPU kernel)
or by two matmuls and a softmax (AttentionBlock.float32_softmax: in fp32 just that), alternating step by step
in one process (the host's pace moves too much between processes to compare them): median milliseconds a step of
each and the median of their per-round ratios.

    PYTHONPATH=. python results/cpu-2026-11-30-attention/attention_ab.py [--side 28 --channels 1] [--rounds 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from basic_diffusion import AttentionBlock

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    times = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(side=args.side, channels=args.channels, batch=128, folder=folder)
        blocks = [m for m in trainer.model.modules() if isinstance(m, AttentionBlock)]

        def step(matmul: bool) -> float:
            for block in blocks:
                block.float32_softmax = matmul
            start = time.perf_counter()
            trainer.train_step()
            return time.perf_counter() - start

        for matmul in (False, True, False, True):
            step(matmul)
        for r in range(args.rounds):
            for matmul in (False, True) if r % 2 == 0 else (True, False):
                times[matmul].append(step(matmul))
    ratios = [m / s for s, m in zip(times[False], times[True])]
    print(
        f"{args.side}x{args.side}x{args.channels} batch 128, {len(blocks)} attention blocks, {args.rounds} rounds "
        f"({torch.get_num_threads()} threads): sdpa {1e3 * statistics.median(times[False]):.1f} ms, matmuls "
        f"{1e3 * statistics.median(times[True]):.1f} ms a step; matmuls/sdpa median {statistics.median(ratios):.3f} "
        f"(rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
