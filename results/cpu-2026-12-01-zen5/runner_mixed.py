"""The sampling runner in bf16 as it is (bf16 Winograd GEMMs in F(2x2, 3x3)) against the same runner with its 3x3
convolutions by the mixed path (fp32 F(4x4, 3x3) on the bf16 activations) and against the fp32 runner: one forward
of a fresh small U-Net (weights N(0, 0.05)) at batch 64, t = 500, relative error against float64 and medians of 10
forwards, interleaved. Arguments: side, channels, base channels, blocks a level.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/runner_mixed.py 28 1 32 1
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import optimized_diffusion as od
from basic_diffusion import UNet, unet_preset
from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    side, channels, base, blocks = (int(a) for a in sys.argv[1:5])
    torch.manual_seed(0)
    config = unet_preset(
        "small", image_size=side, in_channels=channels, model_channels=base, num_res_blocks=blocks, dropout=0.0
    )
    model = UNet(config).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    runners = {
        "fp32": od.FusedUNet(model, dtype=torch.float32),
        "bf16": od.FusedUNet(model, dtype=torch.bfloat16),
        "mixed": od.FusedUNet(model, dtype=torch.bfloat16),
    }
    runners["mixed"].winograd4 = {c: ops.winograd_weight(c.weight, tile=4) for c in runners["mixed"].winograd}
    x, t = torch.randn(64, channels, side, side), torch.full((64,), 500)
    with torch.no_grad():
        reference = model.double()(x.double(), t)
        model.float()
        for name, runner in runners.items():
            error = ((runner(x, t).double() - reference).norm() / reference.norm()).item()
            print(f"{name}: relative error against float64 {error:.2e}")
        times = {name: [] for name in runners}
        for _ in range(12):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner(x, t)
                times[name].append(time.perf_counter() - start)
    print(", ".join(f"{name} {1e3 * statistics.median(v[2:]):.1f} ms" for name, v in times.items()))


if __name__ == "__main__":
    main()
