"""The weight gradient (conv3x3_winograd_backward asked for dL/dg alone) at the 28x28 recipe's shapes, batch 128,
under settings a scratch build of the extension reads from an environment variable each call, alternating the
settings call by call in one process: ms a call (median of 21) and the median of the paired ratios to the first
setting. The scratch builds: ``block_size.diff`` (WG_GRAD_BLOCK: tiles per block, 0 for the shipped choice) and
``channel_split.diff`` (WG_SPLIT=1: the threads split the input channels instead of the tiles).

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-costs/ab_env.py WG_GRAD_BLOCK 0 48 96
"""

import os
import sys
import time

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

SHAPES = [(32, 32, 28), (64, 64, 14), (64, 64, 7), (128, 64, 7), (96, 32, 28), (64, 32, 28), (32, 64, 14)]
SHAPES += [(128, 64, 14), (96, 64, 14)]
ROUNDS = 21


def main() -> None:
    variable, settings = sys.argv[1], sys.argv[2:]
    keep_freed_memory()
    torch.manual_seed(0)
    for cin, cout, side in SHAPES:
        x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last)
        g = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, 3, 3) * 0.1
        tile = ops.winograd_tile(side)

        def call():
            return ops.conv3x3_winograd_backward(g, x, w, tile=tile, wanted=(False, True, False))

        times = {s: [] for s in settings}
        for s in settings:
            os.environ[variable] = s
            call()
            call()
        for r in range(ROUNDS):
            for s in settings if r % 2 else settings[::-1]:
                os.environ[variable] = s
                start = time.perf_counter()
                call()
                times[s].append(time.perf_counter() - start)
        base = times[settings[0]]
        cells = []
        for s, mine in times.items():
            ratio = sorted(b / a for a, b in zip(base, mine))[ROUNDS // 2]
            cells.append(f"{s}: {sorted(mine)[ROUNDS // 2] * 1e3:6.2f} ms ({ratio:.3f})")
        print(f"{cin:3d}->{cout:3d} {side:2d}x{side:2d}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
