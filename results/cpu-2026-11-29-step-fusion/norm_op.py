"""One GroupNorm + scale-shift + SiLU forward and backward at the U-Net's shapes (128 images, 8 groups): PyTorch's
ops on NCHW and on channels-last tensors (under bf16 autocast for bf16) against the extension's group_norm_act and
its backward op (kernels/ops.group_norm_act_trainable), ms per call.

    python results/cpu-2026-11-29-step-fusion/norm_op.py > norm_op.txt
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ddpm.kernels import ops

SHAPES = ((128, 32, 28, 28), (128, 64, 14, 14), (128, 64, 7, 7), (128, 32, 8, 8), (128, 64, 4, 4), (128, 64, 2, 2))


def ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ops.load_extension()
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; ms per forward + backward")
    for shape in SHAPES:
        B, C = shape[:2]
        for dtype in (torch.float32, torch.bfloat16):
            weight, bias = torch.randn(C, requires_grad=True), torch.randn(C, requires_grad=True)
            table = torch.randn(B, 2 * C, requires_grad=True)
            times = []
            for layout in (torch.contiguous_format, torch.channels_last):
                x = torch.randn(*shape).to(dtype).contiguous(memory_format=layout).requires_grad_()
                grad = torch.randn(*shape).to(dtype).contiguous(memory_format=layout)

                def pytorch(x=x, grad=grad):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                        h = F.group_norm(x, 8, weight, bias, 1e-5)
                        y = F.silu(h * (1 + table[:, :C, None, None]) + table[:, C:, None, None])
                    return torch.autograd.grad(y, (x, weight, bias, table), grad.to(y.dtype))

                times.append(ms(pytorch))

            def fused(x=x, grad=grad):
                y = ops.group_norm_act_trainable(x, weight, bias, groups=8, scale=table[:, :C], shift=table[:, C:])
                return torch.autograd.grad(y, (x, weight, bias, table), grad)

            print(
                f"{shape} {str(dtype)[6:]:8s} PyTorch NCHW {times[0]:6.2f}  PyTorch channels-last {times[1]:6.2f}"
                f"  fused op {ms(fused):6.2f}"
            )


if __name__ == "__main__":
    main()
