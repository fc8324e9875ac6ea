"""The latent recipe's training step (4x8x8, batch 128) in fp32 (Winograd, 1x1 GEMMs, thin convolutions) against
bf16 (the mixed path's Winograd convolutions), two trainers alternating step by step in one process, 60 rounds after
5 dropped: whether bf16 pays for the latent step on a CPU where the mixed path is taken.

    PYTHONPATH=. python results/cpu-2026-12-01-zen5/latent_bf16.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402


def main() -> None:
    keep_freed_memory()
    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        fp32 = recipe_trainer(side=8, channels=4, batch=128, folder=one, precision="fp32")
        bf16 = recipe_trainer(side=8, channels=4, batch=128, folder=two, precision="bf16")
        print(f"# fp32: {fp32.step_layout}\n# bf16: {bf16.step_layout}")
        times = {id(fp32): [], id(bf16): []}
        for r in range(65):
            for trainer in (fp32, bf16) if r % 2 == 0 else (bf16, fp32):
                start = time.perf_counter()
                trainer.train_step()
                times[id(trainer)].append(time.perf_counter() - start)
    a, b = times[id(fp32)][5:], times[id(bf16)][5:]
    ratio = statistics.median(y / x for x, y in zip(a, b))
    print(
        f"fp32 {1e3 * statistics.median(a):.1f} ms, bf16 {1e3 * statistics.median(b):.1f} ms a step; "
        f"bf16/fp32 {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
