"""The 3x3 convolutions of the 28x28 recipe's step whose weight gradient runs in Winograd's domain: (Cin, Cout,
side), batch 128, what this folder's scripts time, and their inputs."""

import torch

SHAPES = (
    (32, 32, 28),
    (64, 32, 28),
    (96, 32, 28),
    (64, 64, 28),
    (32, 64, 14),
    (64, 64, 14),
    (96, 64, 14),
    (128, 64, 14),
    (64, 64, 7),
    (128, 64, 7),
)


def inputs(cin: int, cout: int, side: int, *, batch: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A convolution's input x (batch, Cin, side, side) and output gradient (batch, Cout, side, side), channels-last,
    drawn in that order from torch's generator."""
    x = torch.randn(batch, cin, side, side).contiguous(memory_format=torch.channels_last)
    g = torch.randn(batch, cout, side, side).contiguous(memory_format=torch.channels_last)
    return x, g
