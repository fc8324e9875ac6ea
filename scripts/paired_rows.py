"""Time benchmark rows interleaved in one process, pair by pair against the first row.

    OMP_NUM_THREADS=2 python scripts/paired_rows.py cuda_fused_unet,diffusers,compile,torchscript,original 5 OUT.json

How results/cpu-2026-11-25-fused-unet/paired_interleaved_16x16_b64_ddim50.json and
results/cpu-2026-11-25-winograd/paired_rows_16x16_b64_ddim50.json were measured (the rows as they were named
then: results/HISTORY.md). Benchmark mode's ``--interleave`` now does the same for any configuration; this
script keeps the one it timed: the small U-Net, 64x1x16x16, DDIM 50, fp32, on the CPU.

Benchmark mode times its rows one after another, so a machine whose speed drifts over minutes (this
shared 2-core VM: the same row moved by 15% between runs) favours whichever row ran in a fast spell.
This builds every row once (through the same sampling_bench.make_row and model as benchmark mode),
warms each up, then runs them in turn, A B C ... A B C ..., and reports each row's time over the first
row's pair by pair, so drift cancels.
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's flat layout

from basic_diffusion import UNet, unet_preset  # noqa: E402
from ddpm.benchmarks import sampling_bench  # noqa: E402
from ddpm.util.memory import keep_freed_memory  # noqa: E402
from noise_schedule import NoiseSchedule, ScheduleConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "rows", help="comma-separated benchmark rows; the first is the one the others are timed against"
    )
    parser.add_argument("rounds", type=int, help="timed rounds (each row once per round, after one warm-up run)")
    parser.add_argument("out", help="the JSON file to write")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    keep_freed_memory()  # as benchmark mode does on the CPU
    rows, rounds, out = args.rows.split(","), args.rounds, args.out
    torch.manual_seed(0)
    model = UNet(unet_preset("small", image_size=16, in_channels=1)).eval()
    sampling_bench.perturb_zero_init(model, seed=0)
    plan = NoiseSchedule(ScheduleConfig()).make_plan("ddim", sampling_steps=50, device="cpu")
    runs, times = {}, {name: [] for name in rows}
    with torch.no_grad():
        for name in rows:
            _, run, _, _ = sampling_bench.make_row(
                name, model=model, plan=plan, shape=(64, 1, 16, 16), precision="fp32"
            )
            run(torch.Generator().manual_seed(0))  # warm-up: builds, compiles
            runs[name] = run
        for r in range(rounds):
            for name in rows:
                started = time.perf_counter()
                runs[name](torch.Generator().manual_seed(0))
                times[name].append(time.perf_counter() - started)
            print(r, {n: round(t[-1], 3) for n, t in times.items()}, flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(date, "torch", torch.__version__)
    base = rows[0]
    for name in rows:
        ratios = [b / a for a, b in zip(times[base], times[name])]
        print(
            f"{name:18s} median {statistics.median(times[name]):.3f} s  min {min(times[name]):.3f} max "
            f"{max(times[name]):.3f}  "
            f"time / {base}'s, pair by pair: median {statistics.median(ratios):.3f} min {min(ratios):.3f} max "
            f"{max(ratios):.3f}"
        )
    Path(out).write_text(json.dumps({"rows": rows, "times_s": times, "date": date}, indent=1))


if __name__ == "__main__":
    main()
