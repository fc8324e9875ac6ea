"""The trainer's default fp32 step with its 3x3 convolutions in F(4x4, 3x3) (from 4x4 maps, F(2x2, 3x3) below),
all in F(2x2, 3x3), and on oneDNN's, in interleaved rounds of one process (one trainer; each round sets every
swapped convolution's ``min_side`` and the tile rule). The CPU recipes' U-Net, batch 128, fp32.

    PYTHONPATH=. python results/cpu-2026-11-29-winograd-f43/tiles.py 28 1 3      # side, channels, steps a round
    PYTHONPATH=. python results/cpu-2026-11-29-winograd-f43/tiles.py 8 4 10 14   # Winograd from this side on
    PYTHONPATH=. python results/cpu-2026-11-29-winograd-f43/tiles.py 28 1 3 1 14   # and F(4x4) from a second side
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.kernels import ops
from ddpm.training import winograd
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig

DEFAULT_TILE = ops.winograd_tile


def main() -> None:
    side, channels, steps = (int(a) for a in sys.argv[1:4])
    start_side = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    winograd._MIN_SIDE[torch.backends.cpu.get_cpu_capability()] = 1  # swap every convolution; rounds set the side
    torch.manual_seed(0)
    images = ImageSet("latents", torch.randn(1024, channels, side, side).clamp(-1, 1))
    model = unet_preset(
        "small", image_size=side, in_channels=channels, model_channels=32, num_res_blocks=1, dropout=0.0
    )
    variants = {  # name: (min_side, tile rule)
        "F(4x4) from 4": (start_side, DEFAULT_TILE),
        "F(2x2)": (start_side, lambda s: 2),
        "oneDNN": (1 << 30, DEFAULT_TILE),
    }
    if len(sys.argv) > 5:
        variants[f"F(4x4) from side {sys.argv[5]}"] = (int(sys.argv[5]), DEFAULT_TILE)
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k", total_steps=1000, batch_size=128, lr=3e-3, checkpoint=f"{folder}/m.pt",
            save_every=0, sample_every=0, precision="fp32",
        )  # fmt: skip
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
        convs = [m for m in trainer.model.modules() if isinstance(m, winograd.WinogradConv2d)]
        print(f"# {side}x{side}x{channels}, Winograd from {start_side}x{start_side}, {len(convs)} convolutions; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
              f"{torch.backends.cpu.get_cpu_capability()}; images/s per round")  # fmt: skip
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(5):
            for name, (min_side, rule) in variants.items():
                for conv in convs:
                    conv.min_side = min_side
                ops.winograd_tile = rule
                trainer.train_step()  # warm-up of this round's kernels
                begin = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()
                rates[name].append(128 * steps / (time.perf_counter() - begin))
    for name, values in rates.items():
        print(f"{name}: {' '.join(f'{v:.0f}' for v in values)}")
    for name in [n for n in variants if n != "oneDNN"]:
        for base in ("F(2x2)", "oneDNN"):
            if name == base:
                continue
            ratios = sorted(w / o for w, o in zip(rates[name], rates[base]))
            print(f"{name} / {base} per round: {' '.join(f'{r:.2f}' for r in ratios)} "
                  f"(median {ratios[len(ratios) // 2]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
