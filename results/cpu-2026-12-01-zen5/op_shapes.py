"""The CPU recipes' training step under torch.profiler, each operator's self time per step grouped by its input
shapes (the training-28 folder's op_shapes.py), with freed memory kept in the process as train keeps it
(util/memory.keep_freed_memory), more warm-up steps, and the step's precision chosen.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/op_shapes.py [--side 8 --channels 4] [--precision bf16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    keep_freed_memory()
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(
            side=args.side, channels=args.channels, batch=128, folder=folder, precision=args.precision
        )
        for _ in range(8):
            trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                trainer.train_step()
    rows = []
    total = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        if not event.key.startswith(("aten::", "diffusion_kernels::")):
            continue
        ms = event.self_cpu_time_total / 1e3 / args.steps
        total += ms
        rows.append((ms, event.count // args.steps, event.key, str(event.input_shapes)[:150]))
    print(f"# {args.side}x{args.side}x{args.channels} {args.precision}, torch {torch.__version__}, ms per step")
    print(f"# {trainer.step_layout}")
    print(f"total operator self time: {total:.1f} ms")
    for ms, count, key, shapes in sorted(rows, reverse=True)[: args.top]:
        print(f"{ms:8.1f} {count:4d}x {key} {shapes}")


if __name__ == "__main__":
    main()
