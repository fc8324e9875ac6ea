"""A/B of the trainer's tensor lists: taken once (now) against walking the modules every step (before: the parameter
and buffer lists for clipping and the EMA, and model.train()), two trainers interleaved in one process, the latent
recipe's U-Net (4x8x8, 32 base channels, one block a level, batch 128 and 8), 2 threads.

    PYTHONPATH=. python results/cpu-2026-11-30-step-overhead/ab_lists.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def trainer(folder: str, batch: int) -> Trainer:
    torch.manual_seed(0)
    images = ImageSet("latents", torch.randn(1024, 4, 8, 8).clamp(-1, 1))
    model = unet_preset("small", image_size=8, in_channels=4, model_channels=32, num_res_blocks=1, dropout=0.0)
    config = TrainConfig(
        dataset="mnist_5k",
        total_steps=100_000,
        batch_size=batch,
        lr=3e-3,
        min_snr_gamma=5.0,
        timestep_sampling="importance",
        checkpoint=f"{folder}/m.pt",
        save_every=0,
        sample_every=0,
    )
    return Trainer(config, model, ScheduleConfig(), images=images, device="cpu")


def walk_before_each_step(t: Trainer) -> None:  # what each step did before
    t.params = list(t.model.parameters())
    t.ema_params = list(t.ema.parameters())
    t.buffer_pairs = list(zip(t.ema.buffers(), t.model.buffers()))
    t.model.train()


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    for batch, steps in ((128, 20), (8, 100)):
        with tempfile.TemporaryDirectory() as folder:
            now, before = trainer(folder, batch), trainer(folder, batch)
            for t in (now, before):
                for _ in range(5):
                    t.train_step()
            times = {"now": [], "before": []}
            for _ in range(5):
                for name, t in (("now", now), ("before", before)):
                    started = time.perf_counter()
                    for _ in range(steps):
                        if name == "before":
                            walk_before_each_step(t)
                        t.train_step()
                    times[name].append((time.perf_counter() - started) / steps * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        rounds = ", ".join(f"{b / n:.3f}" for n, b in zip(times["now"], times["before"]))
        print(
            f"batch {batch}: now {med['now']:.2f} ms/step, before {med['before']:.2f}: "
            f"{med['before'] / med['now']:.3f}x (rounds {rounds})"
        )


if __name__ == "__main__":
    main()
