"""Named phases of a step ("unet", "noise", "step", ...) for the running profiler's trace: what the networks and
samplers mark, kept apart from the profiler itself (util/profiling.py) so the lowest modules import nothing else.

    with phase("unet"):
        eps = model(x_t, t)
"""

from __future__ import annotations

import contextlib
from typing import Protocol


class Ranges(Protocol):
    def range(self, name: str) -> contextlib.AbstractContextManager[None]: ...


active: Ranges | None = None  # the profiler whose with-block is running, if any (util/profiling.py sets it)


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """A named phase of a step for the running profiler's trace and NVTX; nothing (not even a record_function) when
    no profiler runs."""
    return active.range(name) if active is not None else contextlib.nullcontext()
