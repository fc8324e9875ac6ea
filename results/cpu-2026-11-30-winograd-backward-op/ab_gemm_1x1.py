"""The trainer's default fp32 step with its plain 1x1 convolutions as GEMMs (``GemmConv1x1``) on every map, on maps
up to 8x8 only, and on oneDNN's, in interleaved rounds of one process: each round sets every such module's class
and ``max_side``. The CPU recipes' U-Net, batch 128.

    PYTHONPATH=. python results/cpu-2026-11-30-winograd-backward-op/ab_gemm_1x1.py 8 4 10    # latent 8x8x4
    PYTHONPATH=. python results/cpu-2026-11-30-winograd-backward-op/ab_gemm_1x1.py 28 1 3    # pixels 28x28
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training import winograd
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def main() -> None:
    side, channels, steps = (int(a) for a in sys.argv[1:4])
    torch.manual_seed(0)
    images = ImageSet("latents", torch.randn(1024, channels, side, side).clamp(-1, 1))
    model = unet_preset(
        "small", image_size=side, in_channels=channels, model_channels=32, num_res_blocks=1, dropout=0.0
    )
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k", total_steps=1000, batch_size=128, lr=3e-3, checkpoint=f"{folder}/m.pt",
            save_every=0, sample_every=0, precision="fp32",
        )  # fmt: skip
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
        convs = [m for m in trainer.model.modules() if type(m) is nn.Conv2d and winograd.is_plain_1x1(m)]
        convs += [m for m in trainer.model.modules() if isinstance(m, winograd.GemmConv1x1)]
        print(
            f"# {side}x{side}x{channels}, {len(convs)} 1x1 convolutions; {trainer.step_layout}; torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads, capability "
            f"{torch.backends.cpu.get_cpu_capability()}; images/s per round, {steps} steps a round"
        )
        variants = {"GEMM": None, "GEMM up to 8x8": 8, "oneDNN": 0}
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(7):
            for name, max_side in variants.items():
                for conv in convs:
                    conv.__class__ = nn.Conv2d if max_side == 0 else winograd.GemmConv1x1
                    conv.max_side = max_side
                trainer.train_step()  # warm-up
                begin = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()
                rates[name].append(128 * steps / (time.perf_counter() - begin))
    for name, values in rates.items():
        print(f"{name}: {' '.join(f'{v:.0f}' for v in values)} (median {statistics.median(values):.0f})")
    for name in ("GEMM", "GEMM up to 8x8"):
        ratios = sorted(g / o for g, o in zip(rates[name], rates["oneDNN"]))
        rounds = " ".join(f"{r:.3f}" for r in ratios)
        print(f"{name} / oneDNN per round: {rounds} (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
