"""Training curves (ddpm/training/curves.py, --log_dir): metrics.csv always, TensorBoard event files when
tensorboard is installed, continued by --resume without duplicates, and checked as outputs before any step.

Runs go through ``main.main`` in this process (helpers.run_here): a few steps of a tiny digits U-Net with
10 timesteps, so the preview grid each run writes at its end costs 10 U-Net passes."""

from __future__ import annotations

import csv
import errno
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_TRAIN, assert_user_error, run_here

from ddpm.training.curves import COLUMNS, TrainingLog

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TRAIN = [*TINY_TRAIN, "--timesteps", "10", "--device", "cpu"]  # the last --timesteps wins: a cheap end-of-run preview


def rows(csv_path: Path) -> list[dict[str, str]]:
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def event_accumulator(log_dir: Path):
    """The folder's TensorBoard events, read back as TensorBoard reads them (purges applied), nothing sampled away."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in event_accumulator(log_dir).Scalars(tag)]


def test_a_run_writes_a_csv_row_per_logged_step_and_the_same_tensorboard_scalars(tmp_path):
    result = run_here(*TRAIN, "--max_steps", "5", "--log_every", "2", "--model_path", "ck/m.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    log_dir = tmp_path / "ck" / "m_logs"  # the default: beside the checkpoint
    with open(log_dir / "metrics.csv") as f:
        assert f.readline().strip() == "step,loss,lr,grad_norm,images_per_s,skipped_steps,wall_time"
    table = rows(log_dir / "metrics.csv")
    assert [int(row["step"]) for row in table] == [2, 4, 5]  # every 2 steps, and the run's last step
    for row in table:
        values = {name: float(row[name]) for name in COLUMNS}
        assert all(math.isfinite(value) for value in values.values()), row
        assert values["loss"] > 0 and values["lr"] > 0 and values["grad_norm"] > 0 and values["images_per_s"] > 0
        assert values["skipped_steps"] == 0
    events = event_accumulator(log_dir)
    for name in ("loss", "lr", "grad_norm", "images_per_s", "skipped_steps"):
        logged = [(event.step, event.value) for event in events.Scalars(f"train/{name}")]
        assert [step for step, _ in logged] == [2, 4, 5]
        assert [value for _, value in logged] == pytest.approx([float(row[name]) for row in table], rel=1e-5)
    assert [image.step for image in events.Images("samples")] == [5]  # the end-of-run preview grid
    assert "config/text_summary" in events.Tags()["tensors"]  # the run's configuration, once


def test_resume_appends_from_the_checkpoints_step_and_drops_what_a_killed_run_wrote_past_it(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    first = run_here(*TRAIN, "--max_steps", "3", "--log_every", "1", "--model_path", "m.pt", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    log_dir = tmp_path / "m_logs"
    before = rows(log_dir / "metrics.csv")
    # A run killed after logging steps 4-5 but before saving them: rows and events past the checkpoint's step 3,
    # the last row cut short mid-line.
    with open(log_dir / "metrics.csv", "a") as f:
        f.write("4,99,0.001,99,100.0,0,1\n5,99,0.0")
    (first_file,) = log_dir.glob("events.out.tfevents.*")
    with SummaryWriter(str(log_dir)) as killed:
        for step in (4, 5):
            killed.add_scalar("train/loss", 99.0, global_step=step)
    # TensorBoard reads a folder's event files in name order: second, host, pid. Written in the first run's second
    # by a process whose pid sorts first, the killed run's file would be read before the first run's, which no
    # killed run's is; named after the first run's, it sorts between it and the resumed run's.
    (killed_file,) = set(log_dir.glob("events.out.tfevents.*")) - {first_file}
    killed_file.rename(log_dir / f"{first_file.name}.killed")
    resumed = run_here(
        "--mode",
        "train",
        "--resume",
        "--model_path",
        "m.pt",
        "--max_steps",
        "5",
        "--log_every",
        "1",
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    text = (log_dir / "metrics.csv").read_text()
    assert text.count("step,loss") == 1 and text.endswith("\n")  # one header; whole lines only
    after = rows(log_dir / "metrics.csv")
    assert after[:3] == before  # the first run's rows, untouched
    assert [int(row["step"]) for row in after] == [1, 2, 3, 4, 5]
    assert all(float(row["loss"]) < 99 for row in after)  # the killed run's rows are gone
    logged = scalars(log_dir, "train/loss")
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5]  # TensorBoard continues the same curve, purged past step 3
    assert [value for _, value in logged] == pytest.approx([float(row["loss"]) for row in after], rel=1e-5)


NOTHING_LEFT = "no file was created and nothing partial was left"


@pytest.mark.parametrize("log_dir", [None, "logs"])
def test_a_failed_run_removes_the_log_folder_it_created_and_only_that(tmp_path, monkeypatch, log_dir):
    """Found by the adversarial pass: a run failing at its save (a full disk) said nothing partial was left and left
    m_logs/ with its rows; now a folder the run created goes, one that was there keeps what it held."""
    if log_dir is not None:
        (tmp_path / log_dir).mkdir()
        (tmp_path / log_dir / "notes.txt").write_text("mine")

    def full(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    flags = ["--log_dir", log_dir] if log_dir is not None else []
    result = run_here(*TRAIN, "--max_steps", "2", "--log_every", "1", "--model_path", "m.pt", *flags, cwd=tmp_path)
    last = result.stderr.strip().splitlines()[-1]  # after the progress bar
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert last == f"main.py: error: cannot write m.pt: {os.strerror(errno.ENOSPC)}; {NOTHING_LEFT}"
    assert not (tmp_path / "m_logs").exists()
    if log_dir is not None:
        assert (tmp_path / log_dir / "notes.txt").read_text() == "mine"


def test_a_log_dir_that_is_a_file_is_refused_in_one_line_before_anything_is_written(tmp_path):
    (tmp_path / "logs").write_text("not a folder")
    result = run_here(*TRAIN, "--model_path", "m.pt", "--log_dir", "logs", cwd=tmp_path)
    assert_user_error(result, "--log_dir logs is a file")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["logs"]
    assert (tmp_path / "logs").read_text() == "not a folder"


def test_a_metrics_csv_that_is_an_input_or_a_folder_is_refused_before_the_first_step(tmp_path):
    assert run_here(*TRAIN, "--model_path", "m.pt", "--log_every", "1", cwd=tmp_path).returncode == 0
    checkpoint, csv_path = tmp_path / "m.pt", tmp_path / "m_logs" / "metrics.csv"
    saved = checkpoint.read_bytes()
    csv_path.unlink()
    csv_path.symlink_to(checkpoint)  # appending rows would write into the checkpoint it resumes
    resume = ("--mode", "train", "--resume", "--model_path", "m.pt", "--max_steps", "5", "--device", "cpu")
    # (refused while the request is built: the curves and the checkpoint are both outputs of the run)
    assert_user_error(run_here(*resume, cwd=tmp_path), "metrics.csv and --model_path both name")
    csv_path.unlink()
    csv_path.mkdir()
    assert_user_error(run_here(*resume, cwd=tmp_path), "metrics.csv is a folder")
    assert checkpoint.read_bytes() == saved  # no step was taken


def test_a_new_run_refuses_another_runs_curves_and_overwrite_replaces_them(tmp_path):
    assert run_here(*TRAIN, "--model_path", "m.pt", "--log_dir", "logs", cwd=tmp_path).returncode == 0
    old_events = sorted((tmp_path / "logs").glob("events.out.tfevents.*"))
    (tmp_path / "logs" / "notes.txt").write_text("mine")
    (tmp_path / "m.pt").unlink()  # no checkpoint to protect any more, but its curves are still there
    refused = run_here(*TRAIN, "--model_path", "m.pt", "--log_dir", "logs", cwd=tmp_path)
    assert_user_error(refused, "--log_dir logs already holds the training curves of another run")
    assert not (tmp_path / "m.pt").exists()
    again = run_here(
        *TRAIN,
        "--model_path",
        "m.pt",
        "--log_dir",
        "logs",
        "--overwrite",
        "--max_steps",
        "2",
        "--log_every",
        "1",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert [int(row["step"]) for row in rows(tmp_path / "logs" / "metrics.csv")] == [1, 2]  # a fresh CSV
    new_events = sorted((tmp_path / "logs").glob("events.out.tfevents.*"))
    assert len(new_events) == 1 and new_events != old_events  # the replaced run's event files are gone ...
    assert (tmp_path / "logs" / "notes.txt").read_text() == "mine"  # ... and nothing else is touched


def test_without_tensorboard_the_csv_is_written_and_an_explicit_log_dir_gets_one_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import torch.utils.tensorboard -> ImportError
    asked = run_here(*TRAIN, "--model_path", "a.pt", "--log_dir", "curves", "--log_every", "1", cwd=tmp_path)
    assert asked.returncode == 0, asked.stderr
    assert [int(row["step"]) for row in rows(tmp_path / "curves" / "metrics.csv")] == [1, 2, 3]
    assert not list((tmp_path / "curves").glob("events.out.tfevents.*"))
    hints = [line for line in asked.stdout.splitlines() if "pip install tensorboard" in line]
    assert hints == [
        "tensorboard is not installed: curves/metrics.csv is written, TensorBoard event files are not (pip install "
        "tensorboard)"
    ]
    default = run_here(*TRAIN, "--model_path", "b.pt", cwd=tmp_path)
    assert default.returncode == 0, default.stderr
    assert (tmp_path / "b_logs" / "metrics.csv").is_file()
    assert "tensorboard" not in default.stdout + default.stderr  # the default folder is silent


@pytest.mark.parametrize("flag", [["--log_dir", "logs"], ["--log_every", "5"]])
def test_the_curve_flags_are_refused_outside_training(tmp_path, flag):
    result = run_here("--mode", "sample", "--model_path", "m.pt", *flag, cwd=tmp_path)
    assert_user_error(result, f"{flag[0]} is read by --mode train and distill, not sample")


def test_log_every_must_be_positive_and_is_refused_while_resolving():
    from ddpm.cli import resolve

    with pytest.raises(ValueError, match="--log_every must be a positive integer, got 0"):
        resolve.parse([*TRAIN, "--log_every", "0"])


def test_a_window_averages_its_finite_steps_counts_the_skipped_ones_and_writes_nothing_before_a_step(tmp_path):
    log = TrainingLog(tmp_path / "logs", every=3)
    log.close()
    assert not (tmp_path / "logs").exists()  # a run stopped before its first step leaves no trace
    log = TrainingLog(tmp_path / "logs", every=3, overwrite=True)
    log.add_step(1, loss=1.0, lr=1e-3, grad_norm=2.0, images=8, seconds=0.5)
    log.add_step(2, loss=math.nan, lr=1e-3, grad_norm=math.inf, images=8, seconds=0.5)
    log.add_step(3, loss=3.0, lr=5e-4, grad_norm=4.0, images=8, seconds=1.0)
    log.add_step(4, loss=math.nan, lr=2e-4, grad_norm=math.nan, images=8, seconds=1.0)
    log.close()
    first, last = rows(tmp_path / "logs" / "metrics.csv")
    assert (first["step"], first["loss"], first["lr"], first["grad_norm"]) == ("3", "2", "0.0005", "3")
    assert (first["images_per_s"], first["skipped_steps"]) == ("12", "1")  # 24 images in 2 s; one step skipped
    assert (last["step"], last["loss"], last["grad_norm"], last["skipped_steps"]) == ("4", "nan", "nan", "1")


def test_only_rank_0_keeps_the_curves(monkeypatch):
    from ddpm.modes import train
    from ddpm.requests import TrainRequest
    from ddpm.util.distributed import Ranks

    monkeypatch.setattr(train.distributed, "current", lambda: Ranks(rank=1, world_size=2))
    request = TrainRequest(
        device=None, precision="fp32", checkpoint="m.pt", resume=False, overwrite=False, model=None, log_dir="logs"
    )
    assert train.training_log(trainer=None, request=request, inputs={}) is None
