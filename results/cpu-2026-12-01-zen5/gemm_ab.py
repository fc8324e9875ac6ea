"""The CPU recipes' fp32 training step with the 1x1 convolutions on maps past 8x8 on oneDNN (AVX-512's rule,
GemmConv1x1.max_side 8) or as GEMMs on every map (max_side None, AVX2's rule), alternating step by step in one
process (the small-ops folder's ab.py).

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/gemm_ab.py [--side 8 --channels 4] [--rounds 40]
"""

from __future__ import annotations

import sys

from ddpm.training.winograd import GemmConv1x1
from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-small-ops")
from ab import alternate, arguments  # noqa: E402


def every_map(trainer, on: bool) -> None:
    """GEMMs on every map (on) or on maps up to 8x8 (off)."""
    convs = [module for module in trainer.model.modules() if isinstance(module, GemmConv1x1)]
    assert convs, "the trainer swapped no 1x1 GEMMs in"
    for conv in convs:
        conv.max_side = None if on else 8


if __name__ == "__main__":
    keep_freed_memory()
    print(alternate(arguments(rounds=40), every_map, ("up to 8x8", "every map")))
