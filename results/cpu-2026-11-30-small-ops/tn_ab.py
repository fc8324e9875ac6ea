"""The 28x28 recipe's training step with the fused skips' weight gradients as one product (torch.mm) or as batched
row chunks (training/winograd.py's _tn), alternating step by step in one process (ab.py).

    PYTHONPATH=. python results/cpu-2026-11-30-small-ops/tn_ab.py [--side 28 --channels 1] [--rounds 40]
"""

from __future__ import annotations

import sys

from ddpm.training import winograd

sys.path.insert(0, "results/cpu-2026-11-30-small-ops")
from ab import alternate, arguments  # noqa: E402

MIN_ROWS = winograd._TN_MIN_ROWS


def chunks(trainer, on: bool) -> None:
    winograd._TN_MIN_ROWS = MIN_ROWS if on else 1 << 40


if __name__ == "__main__":
    print(alternate(arguments(40), chunks, ("one product", "chunks")))
