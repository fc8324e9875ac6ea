"""--compile in training: a static-shape compiled step that trains as the eager one does, or one line and eager."""

from __future__ import annotations

import pytest
import torch
from helpers import make_trainer


class _Refusing(torch.nn.Module):
    """What torch.compile gives where Inductor cannot build the step: the first call raises."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("InductorError: CppCompileError: C++ compile error\nCommand:\n g++ ... (the rest)")


def test_a_failing_compile_falls_back_to_the_eager_step_in_one_line(tmp_path, monkeypatch, capsys):
    eager = make_trainer(tmp_path / "eager")
    expected = [eager.train_step() for _ in range(3)]
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: _Refusing())
    trainer = make_trainer(tmp_path / "compiled", compile=True)
    capsys.readouterr()
    losses = [trainer.train_step() for _ in range(3)]
    out = capsys.readouterr()
    # The failed try drew nothing the eager retry does not draw again: the same losses to the bit.
    assert losses == expected
    assert out.out.splitlines() == [
        "--compile: torch.compile failed (RuntimeError: InductorError: CppCompileError: C++ compile error); "
        "training without it"
    ]
    assert "Traceback" not in out.err
    assert trainer.forward is trainer.model and isinstance(trainer.compile_trial.failure, RuntimeError)


@pytest.mark.slow  # compiling a forward and a backward: a minute or two on 2 cores
def test_a_compiled_step_trains_as_the_eager_step_without_recompiling(tmp_path, monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # the same batch shape: one build
    torch._dynamo.reset()
    overrides = dict(total_steps=3)
    reference = make_trainer(tmp_path / "eager", **overrides)
    reference.model.apply(_no_dropout)
    compiled = make_trainer(tmp_path / "compiled", compile=True, **overrides)
    compiled.model.apply(_no_dropout)  # dropout masks differ between Inductor's RNG and the eager op's
    for _ in range(3):
        want, got = reference.train_step(), compiled.train_step()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert compiled.compile_trial.failure is None
    assert compiled.forward is compiled.compile_trial.compiled


def _no_dropout(module: torch.nn.Module) -> None:
    if hasattr(module, "p") and isinstance(module.p, float):
        module.p = 0.0
