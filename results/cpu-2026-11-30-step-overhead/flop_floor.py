"""The floor of the recipes' training step on this CPU: the FLOPs of one forward and backward at batch 128
(torch.utils.flop_counter) over a measured fp32 GEMM rate on 2 threads.

    PYTHONPATH=. python results/cpu-2026-11-30-step-overhead/flop_floor.py
"""

from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from basic_diffusion import UNet, unet_preset


def gemm_rate(n: int = 2048, repeats: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - started)


def main() -> None:
    torch.set_num_threads(2)
    for size, channels in ((8, 4), (28, 1)):
        config = unet_preset(
            "small", image_size=size, in_channels=channels, model_channels=32, num_res_blocks=1, dropout=0.0
        )
        model = UNet(config)
        x, t = torch.randn(128, channels, size, size), torch.randint(0, 1000, (128,))
        with FlopCounterMode(display=False) as counter:
            model(x, t).square().mean().backward()
        flops, peak = counter.get_total_flops(), gemm_rate()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(
            f"{size}x{size}x{channels}: {params:.2f}M params, fwd+bwd {flops / 1e9:.1f} GFLOP per step of 128; "
            f"fp32 GEMM {peak / 1e9:.0f} GFLOP/s -> floor {flops / peak * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
