"""The 28x28 recipe's training step with its attention blocks by scaled_dot_product_attention (the fused CPU kernel)
or by two matmuls and a softmax (AttentionBlock.float32_softmax: in fp32 just that), alternating step by step in one
process (ab.py).

    PYTHONPATH=. python results/cpu-2026-11-30-small-ops/attention_ab.py [--side 28 --channels 1] [--rounds 16]
"""

from __future__ import annotations

import sys

from basic_diffusion import AttentionBlock

sys.path.insert(0, "results/cpu-2026-11-30-small-ops")
from ab import alternate, arguments  # noqa: E402


def matmuls(trainer, on: bool) -> None:
    for block in trainer.model.modules():
        if isinstance(block, AttentionBlock):
            block.float32_softmax = on


if __name__ == "__main__":
    print(alternate(arguments(16), matmuls, ("sdpa", "matmuls")))
