"""The recipe's thin 3x3 convolutions (1 -> 32 in, 32 -> 1 out; the latent's 4 -> 32 and 32 -> 4) by GEMMs over
the nine taps instead of oneDNN's, forward and backward: checked against float64 conv2d, then timed alternately
(batch 128, channels-last, two threads). The strided convolutions' own forward and backward parts beside them.

    PYTHONPATH=. python results/cpu-2026-11-30-small-ops/thin_convs.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from ddpm.util.memory import keep_freed_memory


def taps(x: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) -> (B, H, W, 9, C): x at (y + ky - 1, x + kx - 1), zero outside."""
    B, H, W, C = x.shape
    xp = F.pad(x, (0, 0, 1, 1, 1, 1))
    return torch.stack([xp[:, ky : ky + H, kx : kx + W] for ky in range(3) for kx in range(3)], dim=3)


class TapConv3x3(torch.autograd.Function):
    """conv2d(x, w, b, padding=1) for few input or few output channels: the taps gathered and one GEMM (Cin <= Cout),
    or one GEMM to every tap's output and the taps added in place (Cin > Cout)."""

    @staticmethod
    def forward(ctx, x, w, b):
        B, Cin, H, W = x.shape
        Cout = w.shape[0]
        xr = x.permute(0, 2, 3, 1)  # (B, H, W, Cin): a view of channels-last x
        ctx.gather = Cin <= Cout
        if ctx.gather:
            col = taps(xr).reshape(-1, 9 * Cin)
            wm = w.permute(0, 2, 3, 1).reshape(Cout, 9 * Cin)
            out = torch.addmm(b, col, wm.t())
            ctx.save_for_backward(col, w)
        else:
            wm = w.permute(1, 2, 3, 0).reshape(Cin, 9 * Cout)
            y = (xr.reshape(-1, Cin) @ wm).view(B, H, W, 3, 3, Cout)
            out = b.expand(B, H + 2, W + 2, Cout).clone()
            for ky in range(3):
                for kx in range(3):
                    out[:, 2 - ky : 2 - ky + H, 2 - kx : 2 - kx + W] += y[:, :, :, ky, kx]
            out = out[:, 1 : H + 1, 1 : W + 1]
            ctx.save_for_backward(x, w)
        return out.reshape(B, H, W, Cout).permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, g):
        B, Cout, H, W = g.shape
        gr = g.permute(0, 2, 3, 1).contiguous()  # (B, H, W, Cout)
        db = gr.sum((0, 1, 2))
        if ctx.gather:  # the input's gradient is not wanted (the U-Net's first convolution)
            col, w = ctx.saved_tensors
            dw = (gr.reshape(-1, Cout).t() @ col).view(Cout, 3, 3, w.shape[1]).permute(0, 3, 1, 2)
            return None, dw, db
        x, w = ctx.saved_tensors
        Cin = w.shape[1]
        gp = F.pad(gr, (0, 0, 1, 1, 1, 1))  # each input position's view of the output gradient, tap by tap
        g9 = torch.stack([gp[:, 2 - ky : 2 - ky + H, 2 - kx : 2 - kx + W] for ky in range(3) for kx in range(3)], 3)
        g9 = g9.reshape(-1, 9 * Cout)
        wm = w.permute(1, 2, 3, 0).reshape(Cin, 9 * Cout)
        dx = (g9 @ wm.t()).view(B, H, W, Cin).permute(0, 3, 1, 2)
        dw = (x.permute(0, 2, 3, 1).reshape(-1, Cin).t() @ g9).view(Cin, 3, 3, Cout).permute(3, 0, 1, 2)
        return dx, dw, db


def check(cin: int, cout: int) -> float:
    x = torch.randn(4, cin, 9, 7, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(cin > cout)
    w = torch.randn(cout, cin, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(cout, dtype=torch.float64, requires_grad=True)
    wanted = [w, b] + ([x] if cin > cout else [])
    ref = F.conv2d(x, w, b, padding=1)
    g = torch.randn_like(ref)
    out = TapConv3x3.apply(x, w, b)
    errors = [(out - ref).abs().max()]
    errors += [
        (a - c).abs().max() for a, c in zip(torch.autograd.grad(out, wanted, g), torch.autograd.grad(ref, wanted, g))
    ]
    return max(e.item() for e in errors)


def median_ms(f, n: int = 20) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for cin, cout in ((1, 32), (32, 1), (4, 32), (32, 4)):
        print(f"{cin} -> {cout}: largest difference from float64 conv2d {check(cin, cout):.1e}")
    for cin, cout, side in ((1, 32, 28), (32, 1, 28), (4, 32, 8), (32, 4, 8)):
        x = torch.randn(128, cin, side, side).contiguous(memory_format=torch.channels_last).requires_grad_(cin > cout)
        w, b = torch.randn(cout, cin, 3, 3, requires_grad=True), torch.randn(cout, requires_grad=True)
        g = torch.randn(128, cout, side, side).contiguous(memory_format=torch.channels_last)
        rows = {
            "oneDNN": lambda: F.conv2d(x, w, b, padding=1).backward(g),
            "taps": lambda: TapConv3x3.apply(x, w, b).backward(g),
            "oneDNN forward": lambda: F.conv2d(x, w, b, padding=1),
            "taps forward": lambda: TapConv3x3.apply(x, w, b),
        }
        for _ in range(2):
            print(
                f"{cin} -> {cout} at {side}x{side}: " + ", ".join(f"{k} {median_ms(f):.2f} ms" for k, f in rows.items())
            )
    backward = torch.ops.aten.convolution_backward
    for c, side in ((32, 28), (64, 14)):
        x = torch.randn(128, c, side, side).contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(c, c, 3, 3), torch.randn(c)
        g = torch.randn_like(F.conv2d(x, w, b, stride=2, padding=1)).contiguous(memory_format=torch.channels_last)

        def parts(mask):
            return lambda: backward(g, x, w, [c], [2, 2], [1, 1], [1, 1], False, [0, 0], 1, mask)

        rows = {
            "forward": lambda: F.conv2d(x, w, b, stride=2, padding=1),
            "backward": parts([True, True, True]),
            "input's gradient": parts([True, False, False]),
            "weight's and bias's": parts([False, True, True]),
        }
        print(
            f"stride 2, {c} channels at {side}x{side}: "
            + ", ".join(f"{k} {median_ms(f):.2f} ms" for k, f in rows.items())
        )


if __name__ == "__main__":
    main()
