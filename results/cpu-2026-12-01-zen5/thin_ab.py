"""The CPU recipes' training step with the U-Net's first and last 3x3 convolutions on oneDNN (nn.Conv2d's forward) or
on the extension's direct kernels (training/winograd.py's ThinConv2d), alternating step by step in one process
(the small-ops folder's ab.py).

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/thin_ab.py [--side 8 --channels 4] [--rounds 40]
"""

from __future__ import annotations

import sys

from torch import nn

from ddpm.training.winograd import ThinConv2d

sys.path.insert(0, "results/cpu-2026-11-30-small-ops")
from ab import alternate, arguments  # noqa: E402


def direct(trainer, on: bool) -> None:
    """ThinConv2d's own forward (on) or nn.Conv2d's, on the same parameters (off)."""
    thin = [module for module in trainer.model.modules() if isinstance(module, ThinConv2d)]
    assert thin, "the trainer swapped no thin convolutions in"
    for conv in thin:
        if on:
            conv.__dict__.pop("forward", None)
        else:
            conv.forward = nn.Conv2d.forward.__get__(conv)


if __name__ == "__main__":
    print(alternate(arguments(40), direct, ("oneDNN", "direct")))
