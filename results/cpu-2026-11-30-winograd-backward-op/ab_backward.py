"""The trainer's fp32 step with its Winograd convolutions' transforms and backward as one C++ op each
(``winograd_kernel``, ``conv3x3_winograd_backward``: what the code now runs) against the Python autograd Function
they replaced (the kernel transforms as small GEMMs, dL/dg's transform, the bias gradient as ``grad.sum``), in
interleaved rounds of one process. The CPU recipes' U-Net, batch 128.

    PYTHONPATH=. python results/cpu-2026-11-30-winograd-backward-op/ab_backward.py 8 4 10 [side]   # latent 8x8x4
    PYTHONPATH=. python results/cpu-2026-11-30-winograd-backward-op/ab_backward.py 28 1 3          # pixels 28x28

``side``: Winograd's from maps of this side (default: this CPU's own rule, ``winograd.faster_from``).
"""

from __future__ import annotations

import statistics
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

_GG = {tile: torch.kron(torch.tensor(G), torch.tensor(G)) for tile, G in ops.WINOGRAD_G.items()}
_GG_ROTATED = {tile: gg.flip(1).contiguous() for tile, gg in _GG.items()}


class PythonBackward(torch.autograd.Function):
    """The autograd Function before the ops (ddpm/training/winograd.py until 2026-11-30)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tile):
        x = x.contiguous(memory_format=torch.channels_last)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.tile = bias is not None, tile
        cout, cin = weight.shape[:2]
        taps = weight.reshape(cout, cin, 9).permute(2, 1, 0).reshape(9, cin * cout)
        return ops.conv3x3_winograd(x, (_GG[tile] @ taps).view(-1, cin, cout), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last)
        grad_x = grad_weight = grad_bias = None
        cout, cin = weight.shape[:2]
        if ctx.needs_input_grad[0]:
            rotated = (_GG_ROTATED[ctx.tile] @ weight.reshape(cout * cin, 9).T).view(-1, cout, cin)
            grad_x = ops.conv3x3_winograd(grad, rotated, None)
        if ctx.needs_input_grad[1]:
            dU = ops.conv3x3_winograd_weight_grad(x, grad, tile=ctx.tile)
            products = dU.shape[0]
            taps = dU.view(products, cin * cout).T @ _GG[ctx.tile]
            grad_weight = taps.view(cin, cout, 3, 3).transpose(0, 1).contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum((0, 2, 3))
        return grad_x, grad_weight, grad_bias, None


def main() -> None:
    side, channels, steps = (int(a) for a in sys.argv[1:4])
    if len(sys.argv) > 4:
        winograd._MIN_SIDE[torch.backends.cpu.get_cpu_capability()] = int(sys.argv[4])
    torch.manual_seed(0)
    images = ImageSet("latents", torch.randn(1024, channels, side, side).clamp(-1, 1))
    model = unet_preset(
        "small", image_size=side, in_channels=channels, model_channels=32, num_res_blocks=1, dropout=0.0
    )
    ops_function = winograd._WinogradConv3x3
    variants = {"ops": ops_function, "python": PythonBackward}
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(
            dataset="mnist_5k", total_steps=1000, batch_size=128, lr=3e-3, checkpoint=f"{folder}/m.pt",
            save_every=0, sample_every=0, precision="fp32",
        )  # fmt: skip
        trainer = Trainer(config, model, ScheduleConfig(), images=images, device="cpu")
        swapped = sum(isinstance(m, winograd.WinogradConv2d) for m in trainer.model.modules())
        print(
            f"# {side}x{side}x{channels}, {swapped} convolutions in Winograd's domain from "
            f"{winograd.faster_from()}x{winograd.faster_from()}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, capability {torch.backends.cpu.get_cpu_capability()}; "
            f"images/s per round, {steps} steps a round"
        )
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(7):
            for name, function in variants.items():
                winograd._WinogradConv3x3 = function
                trainer.train_step()  # warm-up
                begin = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()
                rates[name].append(128 * steps / (time.perf_counter() - begin))
        winograd._WinogradConv3x3 = ops_function
    for name, values in rates.items():
        print(f"{name}: {' '.join(f'{v:.0f}' for v in values)} (median {statistics.median(values):.0f})")
    ratios = sorted(o / p for o, p in zip(rates["ops"], rates["python"]))
    print(f"ops / python per round: {' '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
