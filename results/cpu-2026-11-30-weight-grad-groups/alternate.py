"""What this folder's A/B scripts share: the extension's ops, and calls timed under settings of an environment variable
that a scratch build reads per call (or none), alternating call by call in rounds, and each one's median.

    from alternate import Arm, medians
    medians([Arm("today", "DDPM_WGRAD_PAD", None, op), Arm("padded", "DDPM_WGRAD_PAD", "1", op)])
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory


def kernels():
    """torch.ops.diffusion_kernels, loaded as the trainer runs it (glibc keeping freed memory)."""
    keep_freed_memory()
    ops.load_extension()
    return torch.ops.diffusion_kernels


@dataclass(frozen=True)
class Arm:
    """One setting: ``call`` run with ``variable`` set to ``value`` (None: unset; no variable: left as it is)."""

    label: str
    variable: str | None
    value: str | None
    call: Callable[[], object]

    def run(self) -> tuple[float, object]:
        """Seconds of one call under this setting, and what it returned."""
        if self.variable is not None and self.value is None:
            os.environ.pop(self.variable, None)
        elif self.variable is not None:
            os.environ[self.variable] = self.value
        start = time.perf_counter()
        out = self.call()
        return time.perf_counter() - start, out


def medians(arms: list[Arm], *, rounds: int = 40, warmups: int = 5) -> dict[str, float]:
    """Median microseconds of each arm over ``rounds`` rounds (after ``warmups``), the arms in order each round."""
    times: dict[str, list[float]] = {arm.label: [] for arm in arms}
    for round_ in range(warmups + rounds):
        for arm in arms:
            seconds, _ = arm.run()
            if round_ >= warmups:
                times[arm.label].append(seconds)
    return {label: statistics.median(values) * 1e6 for label, values in times.items()}
