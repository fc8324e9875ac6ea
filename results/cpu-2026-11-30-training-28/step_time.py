"""The CPU recipes' training step (the trainer's default CPU step, 32 base channels, one block a level, batch 128),
median milliseconds a step over --steps after warm-up: run alternately against another build of the extension
(PYTHONPATH naming the folder of its .so first) to compare the two.

    PYTHONPATH=. python results/cpu-2026-11-30-training-28/step_time.py --side 8 --channels 4 [--batch 128] [--no-mmap]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import resource
import tempfile
import time

import torch

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def heap_only() -> None:
    """glibc serves every block from the heap (M_MMAP_MAX 0), as keep_freed_memory does since this folder's change."""
    ctypes.CDLL("libc.so.6").mallopt(-4, 0)  # M_MMAP_MAX


def recipe_trainer(*, side: int, channels: int, batch: int, folder: str, **overrides) -> Trainer:
    """The trainer's default CPU step on the CPU recipes' U-Net (the small preset at 32 base channels, one block a
    level, no dropout) over random images of side x side x channels, its checkpoint in ``folder``; ``overrides`` go to
    TrainConfig (another row's step)."""
    torch.manual_seed(0)
    images = ImageSet("images", torch.randn(1024, channels, side, side).clamp(-1, 1))
    model = unet_preset(
        "small", image_size=side, in_channels=channels, model_channels=32, num_res_blocks=1, dropout=0.0
    )
    config = TrainConfig(
        dataset="mnist_5k",
        total_steps=1000,
        batch_size=batch,
        lr=3e-3,
        min_snr_gamma=5.0,
        timestep_sampling="importance",
        checkpoint=f"{folder}/m.pt",
        save_every=0,
        sample_every=0,
        **overrides,
    )
    return Trainer(config, model, ScheduleConfig(), images=images, device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", type=int, default=8)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--label", default="")
    parser.add_argument("--no-mmap", action="store_true", help="glibc serves every block from the heap (M_MMAP_MAX 0)")
    args = parser.parse_args()
    if args.no_mmap:
        heap_only()
    with tempfile.TemporaryDirectory() as folder:
        trainer = recipe_trainer(side=args.side, channels=args.channels, batch=args.batch, folder=folder)
        for _ in range(3):
            trainer.train_step()
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    times.sort()
    where = importlib.import_module("_diffusion_kernels").__file__
    print(
        f"{args.label} {args.side}x{args.side}x{args.channels} batch {args.batch}: "
        f"{1e3 * times[len(times) // 2]:.1f} ms/step (median of {args.steps}), {faults:.0f} page faults a step {where}"
    )


if __name__ == "__main__":
    main()
