"""One 3x3 convolution, channels-last float32: oneDNN's direct convolution against the extension's
conv3x3_winograd, median of repeats, at the shapes the runner and the training recipes meet.

    DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DDPM_KERNELS_ISA=avx2 python conv_layers.py   # AVX2 kernels
    python conv_layers.py                                                                        # the CPU's own
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ddpm.kernels import ops  # noqa: E402

SHAPES = [  # (batch, channels in and out, side)
    (64, 32, 28),
    (64, 64, 14),
    (64, 64, 7),
    (64, 64, 16),
    (64, 128, 8),
    (64, 256, 4),
    (128, 32, 8),
    (128, 64, 4),
    (16, 128, 32),
    (16, 256, 16),
]


def median_seconds(f, repeats: int) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ops.load_extension()
    torch.manual_seed(0)
    isa = os.environ.get("DDPM_KERNELS_ISA")
    print("capability", torch.backends.cpu.get_cpu_capability(), "DNNL", os.environ.get("DNNL_MAX_CPU_ISA"))
    print("ISA", isa, "threads", torch.get_num_threads())
    for batch, channels, side in SHAPES:
        x = torch.randn(batch, channels, side, side).contiguous(memory_format=torch.channels_last)
        weight, bias = torch.randn(channels, channels, 3, 3) * 0.05, torch.randn(channels)
        u = ops.winograd_weight(weight)
        flops = 2 * batch * channels * channels * 9 * side * side
        repeats = max(5, int(2e10 / flops))
        with torch.no_grad():
            direct = median_seconds(lambda: F.conv2d(x, weight, bias, padding=1), repeats)
            winograd = median_seconds(lambda: torch.ops.diffusion_kernels.conv3x3_winograd(x, u, bias), repeats)
        print(
            f"B{batch} C{channels} {side}x{side}: oneDNN {direct * 1e3:8.2f} ms ({flops / direct / 1e9:6.1f} GFLOP/s)"
            f"  winograd {winograd * 1e3:8.2f} ms  ratio {direct / winograd:5.2f}x"
        )


if __name__ == "__main__":
    main()
