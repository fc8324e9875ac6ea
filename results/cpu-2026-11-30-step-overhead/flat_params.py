"""What one step's per-parameter bookkeeping costs on a CPU: gradient clipping, fused AdamW and the EMA's lerp over
the latent recipe's U-Net's 166 parameter tensors, against the same on one flat tensor of all their values.

    PYTHONPATH=. python results/cpu-2026-11-30-step-overhead/flat_params.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from basic_diffusion import UNet, unet_preset


def main() -> None:
    torch.set_num_threads(2)
    config = unet_preset("small", image_size=8, in_channels=4, model_channels=32, num_res_blocks=1, dropout=0.0)
    params = list(UNet(config).to(memory_format=torch.channels_last).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    flat = nn.Parameter(torch.cat([p.detach().flatten() for p in params]))
    flat.grad = torch.randn_like(flat)
    ema_flat = flat.detach().clone()
    opt_flat = torch.optim.AdamW([flat], lr=1e-3, fused=True)

    def per_param() -> None:
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        torch._foreach_lerp_(ema, params, 0.01)

    def flat_one() -> None:
        nn.utils.clip_grad_norm_([flat], 1.0)
        opt_flat.step()
        torch._foreach_lerp_([ema_flat], [flat], 0.01)

    for f in (per_param, flat_one, per_param, flat_one):
        for _ in range(20):
            f()
        started = time.perf_counter()
        for _ in range(200):
            f()
        print(f.__name__, f"{(time.perf_counter() - started) / 200 * 1e3:.3f} ms", len(params), "params")


if __name__ == "__main__":
    main()
