"""One 3x3 convolution's training cost (forward, input gradient, weight gradient, bias gradient) at the U-Net's
shapes: oneDNN on NCHW (what the trainer runs), oneDNN on channels-last, and Winograd's F(2x2, 3x3)
(ddpm/training/winograd.py). The median of many repeats after a warm-up; the threads torch uses as given.

    python results/cpu-2026-11-29-training-step/conv_layers.py --threads 2 > conv_layers_2t.txt
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from ddpm.training.winograd import conv3x3, weight_grad_available

# (batch, Cin, Cout, side): the latent recipe's U-Net (8x8 latents), the 8x8 digits' and the 28x28 pixel recipe's.
SHAPES = [
    (128, 32, 32, 8),
    (128, 64, 64, 4),
    (128, 128, 64, 4),
    (128, 64, 64, 2),
    (128, 96, 32, 8),
    (128, 32, 32, 28),
    (128, 64, 64, 14),
    (128, 128, 64, 14),
    (128, 96, 32, 28),
    (128, 64, 64, 7),
]


def median_ms(step, repeats: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert weight_grad_available()
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
        f"ATen {torch.backends.cpu.get_cpu_capability()}"
    )
    print("batch Cin Cout side | NCHW ms | NHWC ms | Winograd ms | NCHW/Winograd NHWC/Winograd")
    for B, cin, cout, side in SHAPES:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(B, cin, side, side, generator=gen)
        w = (torch.randn(cout, cin, 3, 3, generator=gen) / (3 * cin**0.5)).requires_grad_()
        b = torch.zeros(cout, requires_grad=True)
        grad = torch.randn(B, cout, side, side, generator=gen)
        cl = torch.channels_last
        rows = {}
        for name, conv, layout in (
            ("NCHW", lambda x: F.conv2d(x, w, b, padding=1), torch.contiguous_format),
            ("NHWC", lambda x: F.conv2d(x, w, b, padding=1), cl),
            ("Winograd", lambda x: conv3x3(x, w, b), cl),
        ):
            xi = x.contiguous(memory_format=layout).requires_grad_()
            gi = grad.contiguous(memory_format=layout)

            def step(conv=conv, xi=xi, gi=gi):
                conv(xi).backward(gi)

            rows[name] = median_ms(step, args.repeats)
        ratio = f"{rows['NCHW'] / rows['Winograd']:.2f}x {rows['NHWC'] / rows['Winograd']:.2f}x"
        print(f"{B} {cin} {cout} {side} | {rows['NCHW']:.3f} | {rows['NHWC']:.3f} | {rows['Winograd']:.3f} | {ratio}")


if __name__ == "__main__":
    main()
