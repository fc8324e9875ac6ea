"""The fused GroupNorm (+ scale-shift) + SiLU forward op alone at the 28x28 recipe's shapes, batch 128, channels-last
float32 (ms a call, medians of 31 after 3 warm-ups), its rate in ns an element and GB/s read and written, beside
PyTorch's GroupNorm then SiLU of the same (already concatenated) input.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-costs/norm_alone.py
"""

import sys

import torch

sys.path.insert(0, "results/cpu-2026-11-30-weight-grad-costs")

from timing import median_seconds  # noqa: E402

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory


def median_ms(call, n=31):
    return median_seconds(call, n=n, warmups=3) * 1e3


# The recipe's fused norms: (x's channels, the skip connection's, side, modulated by the time embedding).
SHAPES = ((32, 0, 28, True), (64, 32, 28, False), (64, 0, 14, True), (64, 0, 7, True))


def channels_last(*shape):
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


def norm_inputs(c1, c2, side, modulated):
    """Random x, x2 (or None), weight, bias, scale and shift (or None) of one of SHAPES, batch 128."""
    x = channels_last(128, c1, side, side)
    x2 = channels_last(128, c2, side, side) if c2 else None
    channels = c1 + c2
    weight, bias = torch.randn(channels), torch.randn(channels)
    scale = torch.randn(128, channels) * 0.1 if modulated else None
    shift = torch.randn(128, channels) * 0.1 if modulated else None
    return x, x2, weight, bias, scale, shift


def main() -> None:
    keep_freed_memory()
    torch.manual_seed(0)
    for c1, c2, side, modulated in SHAPES:
        x, x2, weight, bias, scale, shift = norm_inputs(c1, c2, side, modulated)
        channels = c1 + c2
        ours = median_ms(
            lambda: ops.group_norm_act(x, weight, bias, groups=32, x2=x2, scale=scale, shift=shift)  # noqa: B023
        )
        joined = torch.cat([x, x2], 1) if c2 else x
        norm = torch.nn.GroupNorm(32, channels)
        theirs = median_ms(lambda: torch.nn.functional.silu(norm(joined)))  # noqa: B023
        n = 128 * channels * side * side
        print(
            f"{c1}+{c2} ch {side}x{side} mod={modulated}: fwd {ours:.2f} ms = {ours * 1e6 / n:.2f} ns/elem, "
            f"{2 * n * 4 / ours / 1e6:.1f} GB/s (r+w); torch GN+SiLU {theirs:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
