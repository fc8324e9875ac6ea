"""The one line said before a long phase (a distillation's teacher trajectories, an INT8 export's calibration,
an evaluation's rows): how many U-Net calls it makes, about how long they take and what memory it holds.

    seconds = seconds_per_call(lambda: model(x, t), device=device)       # one call, timed after one untimed
    print(phase_line("calibration", calls=4096, seconds=4096 * seconds, held_bytes=0, available_bytes=free))

The time is one timed call of the phase's own batch times the calls to come: an order-of-magnitude estimate, said
before the phase starts. The memory refusals are the phases' own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ddpm.util.messages import format_bytes, format_seconds


@torch.no_grad()
def seconds_per_call(call: Callable[[], object], *, device: torch.device) -> float:
    """Seconds of ``call()``, the second of two calls (the first pays for one-time setup)."""
    seconds = 0.0
    for _ in range(2):
        start = time.perf_counter()
        call()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # sync: the call's time, not its launch's
        seconds = time.perf_counter() - start
    return seconds


def phase_line(what: str, *, calls: int, seconds: float, held_bytes: int, available_bytes: int) -> str:
    """``"calibration: 4,096 U-Net calls, about 1 min 20 s; 12.0 MiB held, 20.0 GiB available"``."""
    return (
        f"{what}: {calls:,} U-Net calls, about {format_seconds(seconds)}; {format_bytes(held_bytes)} held, "
        f"{format_bytes(available_bytes)} available"
    )
