"""The trainer's step at the 28x28 pixel recipe's U-Net under torch.profiler, NCHW against channels-last (forced, in
any precision): each ATen operator's own time per step, the largest first.

    python results/cpu-2026-11-29-step-fusion/layout_profile.py bf16 nchw > layout_profile_bf16_nchw.txt
"""

from __future__ import annotations

import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from basic_diffusion import UNetConfig
from ddpm.data.datasets import ImageSet
from ddpm.training import trainer as trainer_module
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def main() -> None:
    precision, layout, steps = sys.argv[1], sys.argv[2], 3
    trainer_module.trains_channels_last = lambda device, config, dims=2: layout == "cl"
    torch.manual_seed(0)
    images = ImageSet("digits", torch.randn(1024, 1, 28, 28).clamp(-1, 1))
    model = UNetConfig(
        image_size=28,
        in_channels=1,
        model_channels=32,
        num_res_blocks=1,
        channel_mult=(1, 2, 2),
        attention_resolutions=(7,),
        norm_groups=8,
        dropout=0.0,
    )
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k",
            total_steps=100,
            batch_size=128,
            lr=1.5e-3,
            checkpoint=f"{folder}/m.pt",
            save_every=0,
            sample_every=0,
            precision=precision,
        )
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
        for _ in range(2):
            trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                trainer.train_step()
    own: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            own[event.key] += event.self_cpu_time_total / steps / 1e3
    print(f"# {precision}, {layout}, torch {torch.__version__}, ms a step (operators' own time)")
    print(f"all ATen operators: {sum(own.values()):.1f}")
    for name, ms in sorted(own.items(), key=lambda kv: -kv[1])[:16]:
        print(f"{ms:7.1f} {name}")


if __name__ == "__main__":
    main()
