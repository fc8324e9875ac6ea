"""The 28x28 pixel recipe's training step under torch.profiler, each operator's self time per step grouped by its
input shapes: which convolutions, norms and copies the step's time goes to.

    PYTHONPATH=. python results/cpu-2026-11-30-training-28/op_shapes.py [--steps 5] [--top 40] [--no-mmap]
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--no-mmap", action="store_true", help="glibc serves every block from the heap (M_MMAP_MAX 0)")
    args = parser.parse_args()
    if args.no_mmap:
        ctypes.CDLL("libc.so.6").mallopt(-4, 0)  # M_MMAP_MAX
    torch.manual_seed(0)
    side, channels = args.side, args.channels
    images = ImageSet("images", torch.randn(1024, channels, side, side).clamp(-1, 1))
    model = unet_preset(
        "small", image_size=side, in_channels=channels, model_channels=32, num_res_blocks=1, dropout=0.0
    )
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k",
            total_steps=100,
            batch_size=128,
            lr=3e-3,
            min_snr_gamma=5.0,
            timestep_sampling="importance",
            checkpoint=f"{folder}/m.pt",
            save_every=0,
            sample_every=0,
        )
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
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
