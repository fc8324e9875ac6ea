"""oneDNN's 3x3 convolution at the latent and pixel recipes' shapes (batch 128, channels-last, two threads): the
forward, the input gradient, the weight gradient and the whole backward, fp32 against bf16; then two ways around
its backward built from PyTorch's own ops (im2col by unfold and one GEMM; a dense matrix for tiny maps), forward and
backward through autograd, checked against the convolution's gradients.

    python results/cpu-2026-11-29-step-fusion/conv_backward.py > conv_backward.txt
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = ((128, 64, 2, 64), (128, 128, 2, 64), (128, 64, 4, 64), (128, 32, 8, 32), (128, 64, 14, 64), (128, 32, 28, 32))
CL = torch.channels_last


def ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def unfold_conv(x, w, b):
    """The convolution as im2col (F.unfold) and one batched GEMM."""
    B, C, H, W = x.shape
    y = torch.matmul(w.reshape(w.shape[0], C * 9), F.unfold(x, 3, padding=1))  # (B, Cout, H*W)
    return (y + b[:, None]).view(B, -1, H, W)


def dense_index(H: int, W: int) -> torch.Tensor:
    """idx[out, in]: which of the 9 taps joins output position ``out`` to input position ``in`` (9: none)."""
    idx = torch.full((H * W, H * W), 9, dtype=torch.long)
    for oy in range(H):
        for ox in range(W):
            for dy in range(3):
                for dx in range(3):
                    iy, ix = oy + dy - 1, ox + dx - 1
                    if 0 <= iy < H and 0 <= ix < W:
                        idx[oy * W + ox, iy * W + ix] = dy * 3 + dx
    return idx


def dense_conv(x, w, b, idx):
    """The convolution as one (B, H*W*Cin) @ (H*W*Cin, H*W*Cout) GEMM, the matrix gathered from the 9 taps."""
    B, C, H, W = x.shape
    Co, P = w.shape[0], H * W
    taps = torch.cat([w.reshape(Co, C, 9), w.new_zeros(Co, C, 1)], dim=2)[:, :, idx]  # (Co, C, Pout, Pin)
    matrix = taps.permute(3, 1, 2, 0).reshape(P * C, P * Co)
    y = torch.addmm(b.repeat(P), x.permute(0, 2, 3, 1).reshape(B, P * C), matrix)
    return y.view(B, H, W, Co).permute(0, 3, 1, 2)


def main() -> None:
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call, GFLOP/s in brackets")
    for B, C, H, Co in SHAPES:
        flops = 2 * B * H * H * C * Co * 9
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(B, C, H, H, dtype=dtype).contiguous(memory_format=CL)
            w = torch.randn(Co, C, 3, 3, dtype=dtype).contiguous(memory_format=CL)
            b = torch.randn(Co, dtype=dtype)
            g = torch.randn(B, Co, H, H, dtype=dtype).contiguous(memory_format=CL)

            def backward(mask, g=g, x=x, w=w, Co=Co):
                return torch.ops.aten.convolution_backward(
                    g, x, w, [Co], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask
                )

            fwd = ms(lambda x=x, w=w, b=b: F.conv2d(x, w, b, padding=1))
            dx, dw, whole = (
                ms(lambda m=m: backward(m)) for m in ([True, False, False], [False, True, False], [True] * 3)
            )
            line = (
                f"{(B, C, H, H, Co)} {str(dtype)[6:]:8s} forward {fwd:.2f} ({flops / fwd / 1e6:.0f})"
                f"  input grad {dx:.2f} ({flops / dx / 1e6:.0f})  weight grad {dw:.2f} ({flops / dw / 1e6:.0f})"
                f"  whole backward {whole:.2f}"
            )
            if H <= 8:  # the alternatives, forward and backward through autograd
                xs, ws, bs = (v.detach().clone().requires_grad_() for v in (x, w, b))
                idx = dense_index(H, H)

                def through(conv, xs=xs, ws=ws, bs=bs, g=g):
                    return lambda: torch.autograd.grad(conv(xs, ws, bs), (xs, ws, bs), g)

                reference = through(lambda x, w, b: F.conv2d(x, w, b, padding=1))
                line += f"  | fwd+bwd: oneDNN {ms(reference):.2f}"
                for name, conv in (
                    ("unfold", unfold_conv),
                    ("dense", lambda x, w, b, idx=idx: dense_conv(x, w, b, idx)),
                ):
                    err = max(
                        float((p.float() - q.float()).abs().max() / q.float().abs().max())
                        for p, q in zip(through(conv)(), reference())
                    )
                    line += f", {name} {ms(through(conv)):.2f} (rel. err {err:.0e})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
