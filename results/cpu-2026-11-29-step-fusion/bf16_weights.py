"""A training step (forward, loss, backward, clipping, fused AdamW on float32 weights) three ways: fp32; bf16
autocast (float32 weights cast per operation, the trainer's bf16); and bf16 weights and activations end to end with
float32 master weights (gradients cast up before the update, the weights copied down after). Channels-last; the
U-Net of the latent recipe (4x8x8) or the 28x28 pixel recipe; interleaved rounds, one process.

    python results/cpu-2026-11-29-step-fusion/bf16_weights.py 8 4 10
    python results/cpu-2026-11-29-step-fusion/bf16_weights.py 28 1 3
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import torch.nn.functional as F

from basic_diffusion import UNet, UNetConfig
from ddpm.util.memory import keep_freed_memory


def main() -> None:
    side, channels, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    keep_freed_memory()  # as the trainer does on a CPU
    config = UNetConfig(
        image_size=side,
        in_channels=channels,
        model_channels=32,
        num_res_blocks=1,
        channel_mult=(1, 2, 2),
        attention_resolutions=(side // 4,),
        norm_groups=8,
        dropout=0.0,
    )
    cl = torch.channels_last
    x = torch.randn(128, channels, side, side).contiguous(memory_format=cl)
    noise = torch.randn(128, channels, side, side).contiguous(memory_format=cl)
    t = torch.randint(0, 1000, (128,))

    def setup(mode: str):
        torch.manual_seed(0)
        master = UNet(config).to(memory_format=cl)
        work = copy.deepcopy(master).to(torch.bfloat16) if mode == "bf16 weights" else master
        return master, work, torch.optim.AdamW(master.parameters(), lr=1e-4, fused=True)

    def step(mode: str, master, work, optimizer) -> None:
        if mode == "bf16 autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = work(x, t)
        else:
            out = work(x.to(torch.bfloat16) if mode == "bf16 weights" else x, t)
        loss = F.mse_loss(out.float(), noise)
        optimizer.zero_grad(set_to_none=True)
        work.zero_grad(set_to_none=True)
        loss.backward()
        if work is not master:
            for p, q in zip(master.parameters(), work.parameters()):
                p.grad = q.grad.float()
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        optimizer.step()
        if work is not master:
            with torch.no_grad():
                torch._foreach_copy_(list(work.parameters()), list(master.parameters()))

    rates: dict[str, list[float]] = {}
    for _ in range(3):
        for mode in ("fp32", "bf16 autocast", "bf16 weights"):
            state = setup(mode)
            for _ in range(3):
                step(mode, *state)
            start = time.perf_counter()
            for _ in range(steps):
                step(mode, *state)
            rates.setdefault(mode, []).append(128 * steps / (time.perf_counter() - start))
    print(f"# {side}x{side}x{channels}, channels-last, torch {torch.__version__}, images/s per round")
    for mode, values in rates.items():
        print(f"{mode}: {' '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
