"""The trainer's default step with fp32's 3x3 convolutions in Winograd's domain against the same step on oneDNN's
convolutions, in interleaved rounds of one process (one trainer; each round sets every swapped convolution's
``min_side``: the CPU's side, or past every map for oneDNN's). The CPU recipes' U-Net, batch 128, fp32.

    PYTHONPATH=. python results/cpu-2026-11-29-winograd-training/interleaved.py 28 1 3   # side, channels, steps a round
    PYTHONPATH=. python results/cpu-2026-11-29-winograd-training/interleaved.py 8 4 10 1   # and Winograd's side
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from basic_diffusion import unet_preset
from ddpm.data.datasets import ImageSet
from ddpm.training import winograd
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def main() -> None:
    side, channels, steps = (int(a) for a in sys.argv[1:4])
    if len(sys.argv) > 4:  # Winograd from this side on, whatever this CPU's rule
        winograd._MIN_SIDE[torch.backends.cpu.get_cpu_capability()] = int(sys.argv[4])
    start_side = winograd.faster_from()
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
        convs = [m for m in trainer.model.modules() if isinstance(m, winograd.WinogradConv2d)]
        print(f"# {side}x{side}x{channels}, {trainer.step_layout}; {len(convs)} convolutions swapped; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
              f"{torch.backends.cpu.get_cpu_capability()}; images/s per round")  # fmt: skip
        rates: dict[str, list[float]] = {"Winograd": [], "oneDNN": []}
        for _ in range(5):
            for name in rates:
                for conv in convs:
                    conv.min_side = start_side if name == "Winograd" else 1 << 30
                trainer.train_step()  # warm-up of this round's kernels
                begin = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()
                rates[name].append(128 * steps / (time.perf_counter() - begin))
    for name, values in rates.items():
        print(f"{name}: {' '.join(f'{v:.0f}' for v in values)}")
    ratios = sorted(w / o for w, o in zip(rates["Winograd"], rates["oneDNN"]))
    print(
        f"Winograd / oneDNN per round: {' '.join(f'{r:.2f}' for r in ratios)} (median {ratios[len(ratios) // 2]:.2f})"
    )


if __name__ == "__main__":
    main()
