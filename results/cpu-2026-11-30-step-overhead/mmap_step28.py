"""The 28x28 pixel recipe's training step (32 base channels, one block a level, batch 128, the default CPU step) with
keep_freed_memory's malloc settings ("keep") and with mmap off as well ("nommap"); run alternately as processes.

    PYTHONPATH=. python results/cpu-2026-11-30-step-overhead/mmap_step28.py keep|nommap
"""

from __future__ import annotations

import ctypes
import resource
import sys
import tempfile
import time

import torch

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def main(mode: str, steps: int = 5) -> None:
    torch.manual_seed(0)
    images = ImageSet("x", torch.randn(512, 1, 28, 28).clamp(-1, 1))
    model = unet_preset("small", image_size=28, in_channels=1, model_channels=32, num_res_blocks=1, dropout=0.0)
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k",
            total_steps=1000,
            batch_size=128,
            lr=1.5e-3,
            checkpoint=f"{folder}/m.pt",
            save_every=0,
            sample_every=0,
        )
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")  # keep_freed_memory()
        if mode == "nommap":
            assert ctypes.CDLL("libc.so.6").mallopt(-4, 0) == 1  # M_MMAP_MAX
        for _ in range(2):
            trainer.train_step()
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        ms = (time.perf_counter() - started) / steps * 1e3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{mode}: {ms:.1f} ms/step, max RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1])
