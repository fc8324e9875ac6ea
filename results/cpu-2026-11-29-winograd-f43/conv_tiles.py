"""One 3x3 convolution at the U-Net's shapes (batch 128, 2 threads): oneDNN's channels-last forward against
conv3x3_winograd's forward and weight gradient in F(2x2, 3x3) and F(4x4, 3x3), medians of 7 calls, in ms.

    PYTHONPATH=. python results/cpu-2026-11-29-winograd-f43/conv_tiles.py
"""

import time

import torch

from ddpm.kernels import ops

SHAPES = [(128, 32, 28), (128, 64, 14), (128, 64, 7), (128, 128, 7), (128, 64, 8), (128, 64, 4), (128, 64, 2)]


def median_ms(f, n: int = 7) -> float:
    f()
    times = []
    for _ in range(n):
        begin = time.perf_counter()
        f()
        times.append(time.perf_counter() - begin)
    return 1e3 * sorted(times)[n // 2]


def main() -> None:
    ops.load_extension()
    torch.set_num_threads(2)
    for B, C, H in SHAPES:
        x = torch.randn(B, C, H, H).contiguous(memory_format=torch.channels_last)
        g = torch.randn(C, C, 3, 3) * 0.1
        gy = torch.randn(B, C, H, H).contiguous(memory_format=torch.channels_last)
        fwd, wg = {}, {}
        for tile in (2, 4):
            u = ops.winograd_weight(g, tile=tile)
            fwd[tile] = median_ms(lambda: ops.conv3x3_winograd(x, u))
            wg[tile] = median_ms(lambda: ops.conv3x3_winograd_weight_grad(x, gy, tile=tile))
        onednn = median_ms(lambda: torch.nn.functional.conv2d(x, g, padding=1))
        print(
            f"B{B} C{C} {H}x{H}: onednn {onednn:.2f} | F2 fwd {fwd[2]:.2f} wg {wg[2]:.2f} | F4 fwd {fwd[4]:.2f} "
            f"wg {wg[4]:.2f} | fwd F4/F2 {fwd[2] / fwd[4]:.2f}x wg {wg[2] / wg[4]:.2f}x"
        )


if __name__ == "__main__":
    main()
