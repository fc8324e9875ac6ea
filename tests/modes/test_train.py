"""modes/train.py's training_run: the run train, distill and train_autoencoder share. An existing checkpoint is never
replaced without --resume or --overwrite (the line names the mode's flag and the way out), a second run on the
same checkpoint or log folder is refused while the first holds it, and every training mode goes through it."""

import ast
import inspect

import pytest

from ddpm.modes import distill, train
from ddpm.modes.train import training_run

# (mode, how its run is opened): the flag naming its checkpoint, and what --resume continues (None: no --resume).
MODES = [
    ("train", dict(flag="--model_path", continues="it")),
    ("distill", dict(flag="--output", continues="its distillation")),
    ("train_autoencoder", dict(flag="--model_path", continues=None)),
]


@pytest.mark.parametrize("mode,run", MODES)
def test_an_existing_checkpoint_is_refused_without_resume_or_overwrite(tmp_path, mode, run):
    checkpoint = tmp_path / "m.pt"
    checkpoint.write_bytes(b"an earlier run")
    again = f"--resume to continue {run['continues']}, or " if run["continues"] else ""
    line = (
        f"{run['flag']} {checkpoint} already holds a checkpoint; pass {again}--overwrite to start over and replace it"
    )
    with pytest.raises(ValueError) as refused, training_run(str(checkpoint), overwrite=False, **run):
        pytest.fail("the block ran")
    assert str(refused.value) == line
    assert checkpoint.read_bytes() == b"an earlier run"
    with training_run(str(checkpoint), overwrite=True, **run):
        pass
    if run["continues"]:
        with training_run(str(checkpoint), overwrite=False, resume=True, **run):
            pass


def test_a_second_run_on_the_same_checkpoint_or_log_folder_waits_for_the_first(tmp_path):
    checkpoint, logs = str(tmp_path / "m.pt"), str(tmp_path / "m_logs")
    with training_run(checkpoint, flag="--model_path", overwrite=False, log_dir=logs):
        with (
            pytest.raises(ValueError, match="another run is training into .*m.pt"),
            training_run(checkpoint, flag="--model_path", overwrite=False),
        ):
            pass
        with (
            pytest.raises(ValueError, match="choose another --log_dir"),
            training_run(str(tmp_path / "other.pt"), flag="--model_path", overwrite=False, log_dir=logs),
        ):
            pass
    with training_run(checkpoint, flag="--model_path", overwrite=False, log_dir=logs):  # released when it ended
        pass
    assert not (tmp_path / "m.pt.lock").exists()


@pytest.mark.parametrize(
    "entry", [train.run_train, distill.run_distill, train.run_train_autoencoder], ids=lambda f: f.__name__
)
def test_every_training_mode_runs_inside_the_shared_skeleton(entry):
    source = inspect.getsource(entry)
    opened = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.With)
        for item in node.items
        if isinstance(item.context_expr, ast.Call) and getattr(item.context_expr.func, "id", "") == "training_run"
    ]
    assert len(opened) == 1
