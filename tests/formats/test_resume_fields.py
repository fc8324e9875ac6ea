"""--resume reads a checkpoint's training state defensively: every field it restores is checked for its kind and
shape, and a crafted one ends in one line naming the field (issue 67), never a traceback from torch.

    pytest tests/formats/test_resume_fields.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TINY_TRAIN, assert_user_error, make_trainer, run_here

from ddpm.formats.checkpoints import load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny trainer's state after one step (so AdamW holds its moments)."""
    trainer = make_trainer(tmp_path_factory.mktemp("run"), total_steps=2)
    trainer.train_step()
    return trainer.state_dict()


def _first_moment(state):
    return next(iter(state["optimizer"]["state"].values()))


CRAFTED = {
    "rng.torch": lambda s: s["rng"].update(torch=s["rng"]["torch"].float()),
    "rng.generator": lambda s: s["rng"].update(generator=s["rng"]["generator"][:10]),
    "rng.cuda": lambda s: s["rng"].update(cuda="junk"),
    "rng": lambda s: s.update(rng=[1, 2]),
    "optimizer.param_groups[0]": lambda s: s["optimizer"]["param_groups"][0].pop("betas"),
    "optimizer.param_groups[0].lr": lambda s: s["optimizer"]["param_groups"][0].update(lr="fast"),
    "optimizer.state[0].exp_avg": lambda s: _first_moment(s).update(exp_avg=torch.zeros(3)),
    "optimizer.state[0]": lambda s: _first_moment(s).pop("exp_avg_sq"),
    "optimizer.state[9999]": lambda s: s["optimizer"]["state"].update({9999: _first_moment(s)}),
    "optimizer": lambda s: s["optimizer"].pop("param_groups"),
    "grad_scaler": lambda s: s.update(grad_scaler=torch.zeros(2)),
}


@pytest.mark.parametrize("field", list(CRAFTED))
def test_a_crafted_training_field_is_refused_in_one_line_naming_it(trained, tmp_path, field):
    state = copy.deepcopy(trained)
    CRAFTED[field](state)
    with pytest.raises(ValueError) as info:
        make_trainer(tmp_path, total_steps=4, state=state)
    message = str(info.value)
    assert "\n" not in message and f"cannot be resumed: its {field} " in message, message


def test_the_untouched_state_resumes(trained, tmp_path):
    assert make_trainer(tmp_path, total_steps=4, state=copy.deepcopy(trained)).step == 1


def test_an_importance_samplers_state_resumes_and_a_non_finite_one_is_refused(tmp_path):
    """Its buffers are running losses (floats) and counts (integers): both kinds are a sampler's own."""
    trainer = make_trainer(tmp_path / "run", total_steps=2, timestep_sampling="importance")
    trainer.train_step()
    state = trainer.state_dict()
    assert not state["timestep_sampler"]["counts"].is_floating_point()
    resumed = make_trainer(
        tmp_path / "again", total_steps=4, timestep_sampling="importance", state=copy.deepcopy(state)
    )
    assert resumed.step == 1
    state["timestep_sampler"]["losses"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="cannot be resumed: its timestep_sampler "):
        make_trainer(tmp_path / "nan", total_steps=4, timestep_sampling="importance", state=state)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    assert run_here(*TINY_TRAIN, "--max_steps", "1", "--model_path", "m.pt", cwd=folder).returncode == 0
    return folder / "m.pt"


def _resume(checkpoint, tmp_path, change) -> str:
    state = load_checkpoint(checkpoint)
    change(state)
    save_checkpoint(tmp_path / "m.pt", state)
    before = (tmp_path / "m.pt").read_bytes()
    result = run_here(*TINY_TRAIN, "--max_steps", "2", "--model_path", "m.pt", "--resume", cwd=tmp_path)
    assert (tmp_path / "m.pt").read_bytes() == before  # nothing written
    return result


def test_resume_names_the_crafted_rng_on_the_command_line(checkpoint, tmp_path):
    result = _resume(checkpoint, tmp_path, lambda s: s["rng"].update(torch=torch.zeros(7, dtype=torch.int64)))
    assert_user_error(result, "m.pt cannot be resumed: its rng.torch is torch.int64 of shape (7,)")


@pytest.mark.parametrize(
    "change,said",
    [
        (lambda s: s.pop("train_config"), "m.pt holds no train_config, so --resume cannot continue it"),
        (lambda s: s["train_config"].update(lr="fast"), "its train_config is unusable (lr must be a finite number"),
        (lambda s: s["train_config"].update(extra=1), "its train_config is unusable (unknown key 'extra')"),
    ],
    ids=["missing", "mistyped", "unknown"],
)
def test_resume_says_what_is_wrong_with_the_train_config_not_was_it_exported(checkpoint, tmp_path, change, said):
    """Found by the adversarial pass: a crafted train_config got "was it exported?" when the user asked to resume."""
    result = _resume(checkpoint, tmp_path, change)
    assert_user_error(result, said)
    assert "exported" not in result.stderr
