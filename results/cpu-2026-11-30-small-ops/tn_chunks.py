"""g^T x for tall g (N, a) and x (N, b), the shape of a 1x1 convolution's weight gradient over a batch's pixels:
torch.mm against torch.bmm over k chunks of the rows then a sum, medians of 30 calls, two threads.

    PYTHONPATH=. python results/cpu-2026-11-30-small-ops/tn_chunks.py
"""

import sys

import torch

from ddpm.util.memory import keep_freed_memory

sys.path.insert(0, "results/cpu-2026-11-30-small-ops")
from thin_convs import median_ms  # noqa: E402


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    shapes = ((100352, 32, 32), (100352, 32, 96), (100352, 64, 32), (25088, 64, 64), (25088, 64, 128), (6272, 192, 64))
    for n, a, b in shapes + ((6272, 64, 64),):
        g, x = torch.randn(n, a), torch.randn(n, b)
        rows = {"mm": median_ms(lambda: g.t() @ x), "mm_swapped": median_ms(lambda: (x.t() @ g).t())}
        for k in (2, 4, 8, 16, 32, 64):
            rows[f"bmm{k}"] = median_ms(
                lambda: torch.bmm(g.view(k, n // k, a).transpose(1, 2), x.view(k, n // k, b)).sum(0)
            )
        print(n, a, b, {name: round(v, 2) for name, v in rows.items()}, flush=True)


if __name__ == "__main__":
    main()
