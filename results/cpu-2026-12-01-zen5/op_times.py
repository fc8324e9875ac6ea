"""The CPU recipes' training step, each operator timed on the wall clock as it runs (a TorchDispatchMode around
every ATen and extension call below autograd), ms per step grouped by operator and input shapes: the profiler's
own allocations moved the largest tensors' ops by several times on this machine, this does not allocate.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/op_times.py [--side 8 --channels 4] [--precision bf16]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


class OpTimes(TorchDispatchMode):
    """Seconds spent in each (operator, input shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:3]
        self.seconds[(str(func.overloadpacket), str(shapes))] += elapsed
        return out


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
        times = OpTimes()
        start = time.perf_counter()
        with times:
            for _ in range(args.steps):
                trainer.train_step()
        step = (time.perf_counter() - start) / args.steps
    per_op = collections.defaultdict(float)
    for (op, _), s in times.seconds.items():
        per_op[op] += s
    total = sum(per_op.values())
    print(f"# {args.side}x{args.side}x{args.channels} {args.precision}, torch {torch.__version__}, ms per step")
    print(f"# {trainer.step_layout}")
    print(f"step {1e3 * step:.1f} ms (timed), operators {1e3 * total / args.steps:.1f} ms")
    print("## by operator")
    for op, s in sorted(per_op.items(), key=lambda kv: -kv[1])[:20]:
        print(f"{1e3 * s / args.steps:8.1f} {op}")
    print("## by operator and shapes")
    for (op, shapes), s in sorted(times.seconds.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{1e3 * s / args.steps:8.1f} {op} {shapes}")


if __name__ == "__main__":
    main()
