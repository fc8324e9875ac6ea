"""The 3x3 convolutions of the 28x28 recipe's step whose weight gradient runs in Winograd's domain: (Cin, Cout,
side), batch 128, what this folder's scripts time."""

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
