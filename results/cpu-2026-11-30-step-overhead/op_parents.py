"""The trainer's step on the latent recipe's U-Net under torch.profiler, operators' self time summed by (operator,
its two parents), per step: which calls the time and the operator count come from.

    PYTHONPATH=. python results/cpu-2026-11-30-step-overhead/op_parents.py 128
"""

from __future__ import annotations

import collections
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def main(batch: int) -> None:
    torch.manual_seed(0)
    images = ImageSet("latents", torch.randn(1024, 4, 8, 8).clamp(-1, 1))
    model = unet_preset("small", image_size=8, in_channels=4, model_channels=32, num_res_blocks=1, dropout=0.0)
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k",
            total_steps=10000,
            batch_size=batch,
            lr=3e-3,
            min_snr_gamma=5.0,
            timestep_sampling="importance",
            checkpoint=f"{folder}/m.pt",
            save_every=0,
            sample_every=0,
        )
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
        for _ in range(5):
            trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step()
    seconds, count = collections.Counter(), collections.Counter()
    for event in prof.events():
        parent, chain = event.cpu_parent, []
        while parent is not None and len(chain) < 2:
            chain.append(parent.name)
            parent = parent.cpu_parent
        key = (event.name, " <- ".join(chain))
        seconds[key] += event.self_cpu_time_total
        count[key] += 1
    print(
        f"batch {batch}, {torch.get_num_threads()} threads: {sum(count.values())} events, "
        f"self time {sum(seconds.values()) / 1e3:.1f} ms"
    )
    for key, us in seconds.most_common(30):
        print(f"{us / 1e3:7.2f} ms {count[key]:5d}  {key[0]}  <-  {key[1]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 128)
