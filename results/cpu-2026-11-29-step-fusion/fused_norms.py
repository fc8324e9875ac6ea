"""The trainer's step with every block's GroupNorm (+ scale-shift) + SiLU through the extension's group_norm_act
and its backward op (kernels/ops.fused_norm_act), against PyTorch's ops, in interleaved rounds, one process. In bf16
the attention blocks also take their float32-softmax path (torch's flash attention backward is slow in bf16 on a CPU).

    python results/cpu-2026-11-29-step-fusion/fused_norms.py fp32 8 4 cl 10   # precision, side, channels, layout,
    python results/cpu-2026-11-29-step-fusion/fused_norms.py bf16 28 1 cl 3   #   steps a round
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

import basic_diffusion
from basic_diffusion import UNetConfig
from ddpm.data.datasets import ImageSet
from ddpm.kernels import ops
from ddpm.training import trainer as trainer_module
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig


def use(model: torch.nn.Module, *, fused: bool, float32_softmax: bool) -> None:
    for module in model.modules():
        if hasattr(module, "norm_act"):
            module.norm_act = ops.fused_norm_act if fused else basic_diffusion.norm_act
        if hasattr(module, "float32_softmax"):
            module.float32_softmax = float32_softmax


def main() -> None:
    precision, side, channels, layout, steps = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
    )
    trainer_module.trains_channels_last = lambda device, config, dims=2: layout == "cl"
    ops.load_extension()
    torch.manual_seed(0)
    images = ImageSet("latents", torch.randn(1024, channels, side, side).clamp(-1, 1))
    model = UNetConfig(
        image_size=side,
        in_channels=channels,
        model_channels=32,
        num_res_blocks=1,
        channel_mult=(1, 2, 2),
        attention_resolutions=(side // 4,),
        norm_groups=8,
        dropout=0.0,
    )
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k",
            total_steps=1000,
            batch_size=128,
            lr=3e-3,
            checkpoint=f"{folder}/m.pt",
            save_every=0,
            sample_every=0,
            precision=precision,
        )
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
        rates: dict[str, list[float]] = {"PyTorch's norms": [], "fused norms": []}
        for _ in range(4):
            for name in rates:
                use(
                    trainer.model,
                    fused=name == "fused norms",
                    float32_softmax=precision == "bf16" and name == "fused norms",
                )
                for _ in range(2):
                    trainer.train_step()
                start = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()
                rates[name].append(128 * steps / (time.perf_counter() - start))
    print(f"# {precision}, {side}x{side}x{channels}, {layout}, torch {torch.__version__}, images/s per round")
    for name, values in rates.items():
        print(f"{name}: {' '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
