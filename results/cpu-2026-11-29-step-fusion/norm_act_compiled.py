"""The trainer's step with each residual block's GroupNorm (+ the time embedding's scale and shift) + SiLU compiled
by Inductor into fused kernels (forward and backward), the convolutions and the rest eager, against the eager step:
an upper bound on what fusing the norms alone gives inside the step. Interleaved rounds, one process.

    python results/cpu-2026-11-29-step-fusion/norm_act_compiled.py fp32 8 4 cl 10   # precision, side, channels,
    python results/cpu-2026-11-29-step-fusion/norm_act_compiled.py bf16 28 1 nchw 3 #   layout, steps a round
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch
import torch._dynamo
import torch.nn.functional as F

import basic_diffusion
from basic_diffusion import UNetConfig
from ddpm.data.datasets import ImageSet
from ddpm.training import trainer as trainer_module
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import ScheduleConfig

torch._dynamo.config.cache_size_limit = 128  # one compiled graph per block shape
torch._dynamo.config.recompile_limit = 128


def norm_act(h, weight, bias, groups: int, eps: float, scale, shift):
    h = F.group_norm(h, groups, weight, bias, eps)
    if scale is not None:
        h = h * (1 + scale) + shift
    return F.silu(h)


fused = torch.compile(norm_act, dynamic=False)


def forward_fused(self, x, emb):
    """basic_diffusion.ResBlock.forward (scale-shift conditioning) with the two norm-act pairs compiled."""
    n1, n2 = self.norm1, self.norm2
    h = self.conv1(fused(x, n1.weight, n1.bias, n1.num_groups, n1.eps, None, None))
    scale, shift = self.emb_proj(F.silu(emb)).view(emb.shape[0], -1, 1, 1).chunk(2, dim=1)
    h = fused(h, n2.weight, n2.bias, n2.num_groups, n2.eps, scale, shift)
    return self.skip(x) + self.conv2(self.dropout(h))


def main() -> None:
    precision, side, channels, layout, steps = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
    )
    if layout == "cl":  # channels-last whatever the precision
        trainer_module.trains_channels_last = lambda device, config, dims=2: True
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
    eager = basic_diffusion.ResBlock.forward
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
        rates: dict[str, list[float]] = {"eager": [], "norm-act compiled": []}
        for _ in range(4):
            for name, forward in (("eager", eager), ("norm-act compiled", forward_fused)):
                basic_diffusion.ResBlock.forward = forward
                for _ in range(2):  # warm-up (the first round compiles)
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
