"""The default CPU training step with and without 1x1 convolutions as GEMMs (ddpm/training/winograd._GEMM_1X1),
two trainers interleaved in one process, 5 rounds; the latent recipe's U-Net on 4x8x8 latents, or with --pixels
the pixel recipe's on 1x28x28 images.

    PYTHONPATH=. python results/cpu-2026-11-29-gemm-1x1/ab_1x1.py [--pixels]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training import winograd
from ddpm.training.trainer import TrainConfig, Trainer
from ddpm.util.memory import keep_freed_memory
from noise_schedule import ScheduleConfig


def make(images: ImageSet, side: int, channels: int, gemm: bool, folder: str) -> Trainer:
    winograd._GEMM_1X1 = ("AVX2",) if gemm else ()  # read when the trainer swaps its convolutions
    torch.manual_seed(0)
    model = unet_preset(
        "small", image_size=side, in_channels=channels, model_channels=32, num_res_blocks=1, dropout=0.0
    )
    config = TrainConfig(
        dataset="mnist_5k",
        total_steps=1000,
        batch_size=128,
        lr=3e-3,
        min_snr_gamma=5.0,
        timestep_sampling="importance",
        checkpoint=f"{folder}/m{int(gemm)}.pt",
        save_every=0,
        sample_every=0,
    )
    trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
    print(gemm, trainer.step_layout)
    return trainer


def main() -> None:
    keep_freed_memory()
    side, channels, steps = (28, 1, 3) if "--pixels" in sys.argv else (8, 4, 10)
    torch.manual_seed(0)
    images = ImageSet("latents", torch.randn(1024, channels, side, side).clamp(-1, 1))
    with tempfile.TemporaryDirectory() as folder:
        a, b = make(images, side, channels, True, folder), make(images, side, channels, False, folder)
        for trainer in (a, b):
            for _ in range(3):
                trainer.train_step()
        ratios, times_a, times_b = [], [], []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(steps):
                a.train_step()
            mid = time.perf_counter()
            for _ in range(steps):
                b.train_step()
            end = time.perf_counter()
            times_a.append((mid - start) / steps * 1e3)
            times_b.append((end - mid) / steps * 1e3)
            ratios.append((end - mid) / (mid - start))
    print(
        f"{side}x{side}: with 1x1 GEMMs {statistics.median(times_a):.1f} ms/step, oneDNN's 1x1"
        f" {statistics.median(times_b):.1f} ms/step, speedup median {statistics.median(ratios):.3f}"
        f" (rounds {', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
