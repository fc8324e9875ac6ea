"""``--compile`` for training: the U-Net's forward through ``torch.compile`` with static shapes, tried on the first
step and replaced by the eager forward, in one line naming the cause, when compiling fails.

    trial = CompileTrial(model)          # trainer.forward = trial.compiled until the first step settles it
    loss = trial.first_step(trainer)     # the compiled step, or (after one line) the same step eagerly

Shapes are static (``dynamic=False``), since a run's batch has one shape; compiling happens during the first step's
forward and backward, so the whole first step is the trial.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from ddpm.util import distributed
from ddpm.util.messages import first_line


def failure_reason(exc: BaseException) -> str:
    """What a failed compile says in one line: the exception's type and its message's first line."""
    return f"{type(exc).__name__}: {first_line(exc)}"


class CompileTrial:
    """The compiled forward of ``eager`` and the outcome of its first step: ``failure`` (the exception that made the
    step fall back to eager, or None) and ``first_step_seconds`` (compiling included)."""

    def __init__(self, eager: nn.Module, *, on_fallback: Callable[[], None] = lambda: None) -> None:
        self.eager, self.on_fallback = eager, on_fallback  # on_fallback: what the eager step needs first
        self.compiled = torch.compile(eager, dynamic=False)
        self.pending = True
        self.failure: Exception | None = None
        self.first_step_seconds: float | None = None

    def first_step(self, trainer) -> float:
        """The first step of ``trainer`` (training/trainer.py's Trainer, which imports this module) through the
        compiled forward; if compiling (or the compiled step) raises, the random states the step drew from are put
        back and the same step runs eagerly, for the rest of the run."""
        states = _random_states(trainer.device, trainer.generator)
        started = time.perf_counter()
        try:
            loss = trainer.one_step()
        except Exception as exc:  # an Inductor or C++ compiler error: the run goes on eagerly
            self.failure = exc
            _restore_random_states(states, device=trainer.device, generator=trainer.generator)
            trainer.forward = self.eager
            self.on_fallback()
            distributed.say(f"--compile: torch.compile failed ({failure_reason(exc)}); training without it")
            loss = trainer.one_step()
        self.first_step_seconds = time.perf_counter() - started
        self.pending = False
        return loss


def _random_states(device: torch.device, generator: torch.Generator) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return generator.get_state(), torch.get_rng_state(), cuda


def _restore_random_states(states: tuple, *, device: torch.device, generator: torch.Generator) -> None:
    own, cpu, cuda = states
    generator.set_state(own)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
