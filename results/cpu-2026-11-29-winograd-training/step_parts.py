"""Where a CPU training step's time goes, by part: the trainer's own step (training/trainer.py) on the latent
recipe's U-Net (or the 28×28 pixel recipe's: --pixels) under torch.profiler, each operator's self time summed into
a part, per step; --convs onednn keeps oneDNN's convolutions (the default trains some in Winograd's domain).

    PYTHONPATH=. python results/cpu-2026-11-29-winograd-training/step_parts.py [--pixels] [--convs onednn]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig

PARTS = (  # (part, substrings of operator names), the first match wins
    ("Winograd weight gradient", ("conv3x3_winograd_weight_grad",)),
    ("Winograd convolutions (forward, input gradient)", ("conv3x3_winograd",)),
    ("convolution backward", ("convolution_backward",)),
    ("convolution forward", ("mkldnn_convolution", "conv3x3_winograd", "_convolution")),
    ("GroupNorm", ("group_norm",)),
    ("SiLU", ("silu",)),
    ("attention", ("scaled_dot_product", "bmm", "softmax", "baddbmm")),
    ("linear layers", ("addmm", "aten::mm")),
    ("optimizer, clipping, EMA", ("adamw", "foreach", "lerp", "norm", "clamp")),
    ("layout copies", ("copy_", "contiguous", "clone", "to_dense", "reorder")),
    ("elementwise (add, mul, cat, loss)", ("add", "mul", "cat", "sub", "pow", "mean", "sum", "div", "fill", "zero")),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=("nchw", "nhwc"), default="nhwc")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pixels", action="store_true", help="the 28x28 pixel recipe's U-Net on 1x28x28 images")
    parser.add_argument("--convs", choices=("default", "onednn"), default="default")
    args = parser.parse_args()
    torch.manual_seed(0)
    side, channels = (28, 1) if args.pixels else (8, 4)
    images = ImageSet("latents", torch.randn(1024, channels, side, side).clamp(-1, 1))  # float32 images or latents
    # The CPU recipes' U-Net: the small preset at 32 base channels, one block a level, no dropout.
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
            cpu_channels_last=args.layout == "nhwc",
            winograd_convs=args.convs == "default",
        )
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
        for _ in range(5):
            trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                trainer.train_step()
    parts: dict[str, float] = defaultdict(float)
    total = 0.0
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "diffusion_kernels::")) and "Backward" not in event.key:
            continue
        seconds = event.self_cpu_time_total / 1e6 / args.steps
        total += seconds
        name = event.key.lower()
        part = next((p for p, keys in PARTS if any(k.lower() in name for k in keys)), "other")
        parts[part] += seconds
    threads = torch.get_num_threads()
    print(f"# {side}x{side}, {args.layout}, convs {args.convs}, torch {torch.__version__}, {threads} threads, per step")
    for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{part}: {seconds * 1e3:.1f} ms ({100 * seconds / total:.0f}%)")
    print(f"total operator time: {total * 1e3:.1f} ms")
    others = sorted((e.self_cpu_time_total, e.key) for e in prof.key_averages() if e.key.startswith("aten::"))
    print("largest operators:", ", ".join(f"{key} {us / 1e3 / args.steps:.1f} ms" for us, key in others[-12:][::-1]))


if __name__ == "__main__":
    main()
