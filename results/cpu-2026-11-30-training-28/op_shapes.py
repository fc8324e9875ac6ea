"""The CPU recipes' training step (28x28 pixels by default; --side 8 --channels 4: the latent one) under
torch.profiler, each operator's self time per step grouped by its input shapes: which convolutions, norms and copies
the step's time goes to.

    PYTHONPATH=. python results/cpu-2026-11-30-training-28/op_shapes.py [--side 8 --channels 4] [--steps 5] [--top 40]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import heap_only, recipe_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--no-mmap", action="store_true", help="glibc serves every block from the heap (M_MMAP_MAX 0)")
    args = parser.parse_args()
    if args.no_mmap:
        heap_only()
    side, channels = args.side, args.channels
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(side=side, channels=channels, batch=128, folder=folder)
        for _ in range(3):
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
    print(f"# {side}x{side}x{channels}, torch {torch.__version__}, {torch.get_num_threads()} threads, ms per step")
    print(f"total operator self time: {total:.1f} ms")
    for ms, count, key, shapes in sorted(rows, reverse=True)[: args.top]:
        print(f"{ms:8.1f} {count:4d}x {key} {shapes}")


if __name__ == "__main__":
    main()
