"""Trust: no good file is lost, no TorchScript runs without consent, signals end in one line.

Specification, as a careless user would meet it: every refused run exits 2 with one line on stderr
and leaves the file it would have destroyed byte-identical (an input named as an output, two outputs
on one path, a read-only file, a FIFO, an existing checkpoint without --resume/--overwrite, a
checkpoint another run is training into); outputs through a symlink replace the file the link
points to and keep the link; Ctrl-C and SIGTERM end with one line and 130/143, a second signal
does not cut the interrupt save, SIGKILL during saves never leaves an unloadable checkpoint and
the next start removes the stale temporaries; sampling streams batches into the .npz.
Most runs call ``main.main`` in this process (no interpreter start-up); the signal tests use
subprocesses.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import ROOT, assert_user_error, run_here
from PIL import Image

import main
from ddpm.backends import registry
from ddpm.formats.checkpoints import load_checkpoint, save_checkpoint
from ddpm.modes import train as train_mode
from ddpm.util import messages, model_folders, safe_files
from ddpm.util.estimates import phase_line, seconds_per_call
from ddpm.util.safe_files import KINDS, check_kind, check_outputs, expected_kind, found_kind, remove_stale_temporaries

TINY_SAVES = [
    "--mode",
    "train",
    "--dataset",
    "digits",
    "--img_size",
    "16",
    "--model_channels",
    "16",
    "--num_res_blocks",
    "1",
    "--timesteps",
    "10",  # the end-of-run preview samples every timestep (up to 100): few, so it is cheap
    "--batch_size",
    "8",
    "--sample_every",
    "0",
    "--save_every",
    "0",
]
SAMPLE = ["--mode", "sample", "--sampling_steps", "2", "--n_samples", "4"]


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """main.main installs its SIGINT/SIGTERM handlers; give pytest its own back after each test."""
    handlers = {sig: signal.getsignal(sig) for sig in messages.SIGNALS}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run main.main in this process, in a folder; returns (exit code, stderr)."""

    def run(*args: str, cwd: Path) -> tuple[int, str]:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = main.main([str(a) for a in args])
        return code, capsys.readouterr().err

    return run


def refused(result: tuple[int, str], match: str) -> None:
    code, err = result
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("main.py: error:"), err
    assert match in lines[0], lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder holding a tiny trained checkpoint, m.pt."""
    folder = tmp_path_factory.mktemp("trust")
    handlers = {sig: signal.getsignal(sig) for sig in messages.SIGNALS}
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        assert main.main([*TINY_SAVES, "--max_steps", "2", "--model_path", "m.pt"]) == 0
    finally:
        os.chdir(cwd)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return folder


@contextlib.contextmanager
def unchanged(*paths: Path):
    """Assert the files are byte-identical (and keep their mode) after the block."""
    before = {p: (p.read_bytes(), p.stat().st_mode) for p in paths}
    yield
    for p, (data, mode) in before.items():
        assert p.read_bytes() == data, f"{p} was changed"
        assert p.stat().st_mode == mode


# ----- outputs never destroy inputs or other outputs -------------------------------------------------
def test_sample_output_onto_the_model_is_refused(cli, work):
    (work / "grid.png").unlink(missing_ok=True)
    (work / "grid.png").symlink_to(work / "m.pt")  # a .png name that is really the model
    with unchanged(work / "m.pt"):
        refused(cli(*SAMPLE, "--model_path", "m.pt", "--output", "grid.png", cwd=work), "same file as --model_path")
        refused(cli(*SAMPLE, "--model_path", "m.pt", "--output", "m.pt", cwd=work), "same file as --model_path")
        refused(cli(*SAMPLE, "--model_path", "m.pt", "--output", "other.pt", cwd=work), "ending in .png")
    (work / "grid.png").unlink()


def test_npz_onto_the_model_and_colliding_outputs_are_refused(cli, work):
    (work / "m.npz").unlink(missing_ok=True)
    (work / "m.npz").symlink_to(work / "m.pt")
    with unchanged(work / "m.pt"):
        refused(cli(*SAMPLE, "--model_path", "m.pt", "--save_npz", "m.npz", cwd=work), "same file as --model_path")
    (work / "m.npz").unlink()
    (work / "g.npz").write_bytes(b"keep")
    with unchanged(work / "g.npz"):
        refused(  # two outputs of different kinds cannot share a name: the grid's must end in .png
            cli(*SAMPLE, "--model_path", "m.pt", "--output", "g.npz", "--save_npz", "g.npz", cwd=work),
            "--output writes a PNG image and needs a file name ending in .png, got g.npz",
        )


def test_benchmark_outputs_onto_the_model_or_each_other_are_refused(cli, work):
    bench = ["--mode", "benchmark", "--model_path", "m.pt", "--rows", "original", "--sampling_steps", "2"]
    with unchanged(work / "m.pt"):
        refused(cli(*bench, "--json", "m.pt", cwd=work), "--json m.pt is the same file as --model_path")
        refused(cli(*bench, "--chart", "m.pt", cwd=work), "same file as --model_path")
        refused(cli(*bench, "--json", "r.json", "--csv", "r.json", cwd=work), "both name r.json")
    assert not (work / "r.json").exists()


def test_export_onto_its_source_is_refused(cli, work):
    (work / "m.onnx").unlink(missing_ok=True)
    (work / "m.onnx").symlink_to(work / "m.pt")
    with unchanged(work / "m.pt"):
        refused(
            cli("--mode", "export", "--model_path", "m.pt", "--output", "m.onnx", cwd=work), "same file as --model_path"
        )
    (work / "m.onnx").unlink()


def test_read_only_fifo_and_folder_outputs_are_refused(cli, work):
    ro = work / "ro.png"
    ro.write_bytes(b"precious")
    ro.chmod(0o444)
    fifo = work / "pipe.png"
    with contextlib.suppress(FileExistsError):
        os.mkfifo(fifo)
    with unchanged(ro):
        refused(cli(*SAMPLE, "--model_path", "m.pt", "--output", "ro.png", cwd=work), "read-only")
    refused(cli(*SAMPLE, "--model_path", "m.pt", "--output", "pipe.png", cwd=work), "not a regular file")
    assert fifo.exists() and not fifo.is_file()
    (work / "afile").write_bytes(b"")
    refused(cli(*SAMPLE, "--model_path", "m.pt", "--output", "afile/g.png", cwd=work), "is not a folder")


def test_an_output_through_a_symlink_replaces_the_target_and_keeps_the_link(cli, work):
    target = work / "real.png"
    target.write_bytes(b"\x89PNG\r\n\x1a\nold")  # an older grid
    link = work / "link.png"
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    code, err = cli(*SAMPLE, "--model_path", "m.pt", "--output", "link.png", cwd=work)
    assert code == 0, err
    assert link.is_symlink() and target.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "args, flag, name",
    [
        ([*SAMPLE, "--model_path", "m.pt", "--output", "x.png/"], "--output", "x.png"),
        ([*SAMPLE, "--model_path", "m.pt", "--no_grid", "--save_npz", "s.npz/"], "--save_npz", "s.npz"),
        (["--mode", "export", "--format", "onnx", "--model_path", "m.pt", "--output", "t.onnx/"], "--output", "t.onnx"),
        ([*TINY_SAVES, "--max_steps", "1", "--model_path", "n.pt/"], "--model_path", "n.pt"),
    ],
)
def test_a_file_output_ending_in_a_slash_is_refused_and_writes_nothing(cli, work, args, flag, name):
    """Found by the adversarial pass: --output x.png/ and t.onnx/ (a folder's spelling) wrote the files x.png and
    t.onnx; a slash names a folder, and a file output is refused with it, before any work."""
    before = sorted(p.name for p in work.iterdir())
    refused(cli(*args, cwd=work), f"{flag} {name}/ ends in a slash, which names a folder")
    assert sorted(p.name for p in work.iterdir()) == before


# ----- training never replaces a checkpoint by accident ----------------------------------------------
def test_training_onto_an_existing_checkpoint_needs_resume_or_overwrite(cli, work):
    with unchanged(work / "m.pt"):
        refused(cli(*TINY_SAVES, "--max_steps", "1", "--model_path", "m.pt", cwd=work), "--resume")
        refused(cli(*TINY_SAVES, "--max_steps", "1", "--model_path", "m.pt", cwd=work), "--overwrite")
        refused(
            cli(*TINY_SAVES, "--max_steps", "1", "--model_path", "m.pt", "--resume", "--overwrite", cwd=work),
            "choose one",
        )
    copy = work / "copy.pt"
    copy.write_bytes((work / "m.pt").read_bytes())
    code, err = cli(*TINY_SAVES, "--max_steps", "1", "--model_path", "copy.pt", "--overwrite", cwd=work)
    assert code == 0, err
    assert load_checkpoint(copy)["step"] == 1


def test_a_read_only_checkpoint_is_not_replaced_even_with_overwrite(cli, work):
    ro = work / "ro.pt"
    ro.write_bytes((work / "m.pt").read_bytes())
    ro.chmod(0o444)
    with unchanged(ro):
        refused(cli(*TINY_SAVES, "--max_steps", "1", "--model_path", "ro.pt", "--overwrite", cwd=work), "read-only")
        refused(cli(*TINY_SAVES, "--max_steps", "3", "--model_path", "ro.pt", "--resume", cwd=work), "read-only")


def test_a_second_run_on_a_locked_checkpoint_is_refused(cli, work):
    import fcntl

    with open(work / "locked.pt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a running training process holds it
        refused(cli(*TINY_SAVES, "--max_steps", "1", "--model_path", "locked.pt", cwd=work), "another run")
    assert not (work / "locked.pt").exists()


def test_no_training_run_leaves_its_lock_file_behind(cli, work):
    # Done, and refused once the lock is held (a --resume whose checkpoint is not one).
    code, err = cli(*TINY_SAVES, "--max_steps", "1", "--model_path", "fresh.pt", cwd=work)
    assert code == 0, err
    torch.save({"step": "not a checkpoint"}, work / "junk.pt")  # a torch file (so its kind passes), not a checkpoint
    refused(cli(*TINY_SAVES, "--max_steps", "3", "--model_path", "junk.pt", "--resume", cwd=work), "junk.pt")
    code, err = cli(
        "--mode",
        "train_autoencoder",
        "--dataset",
        "digits",
        "--max_steps",
        "1",
        "--batch_size",
        "4",
        "--model_path",
        "ae.pt",
        cwd=work,
    )
    assert code == 0, err
    assert [name for name in ("fresh.pt.lock", "junk.pt.lock", "ae.pt.lock") if (work / name).exists()] == []


def test_a_run_that_opens_the_lock_file_as_its_holder_removes_it_still_gets_one_lock(tmp_path, monkeypatch):
    """The race the removal opens: B opens the file, A removes it and ends, C creates a new one. B must lock
    the path's current file (the one C locks), not the removed one, or B and C would both train."""
    import fcntl

    opened = []
    real_open = os.open

    def open_then_lose_the_race(path, *args):
        fd = real_open(path, *args)
        if not opened:  # the first open: the holder removes the file now, and a third run locks a new one
            opened.append(fd)
            os.unlink(path)
            third = real_open(path, os.O_RDWR | os.O_CREAT)
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
            opened.append(third)
        return fd

    monkeypatch.setattr(os, "open", open_then_lose_the_race)
    with pytest.raises(ValueError, match="another run"), safe_files.run_lock(tmp_path / "m.pt"):
        pass
    os.close(opened[1])


# ----- TorchScript needs consent ----------------------------------------------------------------------
def test_sampling_a_torchscript_file_needs_trust_torchscript(cli, work):
    code, err = cli("--mode", "export", "--format", "torchscript", "--model_path", "m.pt", "--output", "m.ts", cwd=work)
    assert code == 0, err
    refused(cli(*SAMPLE, "--model_path", "m.ts", cwd=work), "--trust_torchscript")
    refused(cli("--mode", "benchmark", "--model_path", "m.ts", cwd=work), "checkpoint (.pt)")
    code, err = cli(*SAMPLE, "--model_path", "m.ts", "--trust_torchscript", "--output", "ts.png", cwd=work)
    assert code == 0, err


# ----- numbers -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,match",
    [
        (["--grad_clip", "nan"], "--grad_clip: must be a finite number"),
        (["--lr", "inf"], "--lr: must be a finite number"),
        (["--seed", "-1"], "--seed: must be between 0 and 2**63 - 1"),
        (["--mode", "paint"], "invalid choice"),
    ],
)
def test_bad_numbers_and_choices_end_in_one_line(args, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main.main(args)
    refused((exit_info.value.code, capsys.readouterr().err), match)


def test_a_seed_out_of_range_ends_in_one_line_from_the_shell(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "--seed", str(2**63)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    refused((result.returncode, result.stderr), "--seed: must be between 0 and 2**63 - 1")


# ----- bounded memory ------------------------------------------------------------------------------------
def test_sampling_streams_batches_and_the_first_batch_matches_a_single_batch_run(cli, work):
    code, err = cli(
        *SAMPLE,
        "--model_path",
        "m.pt",
        "--n_samples",
        "10",
        "--batch_size",
        "4",
        "--no_grid",
        "--save_npz",
        "many.npz",
        cwd=work,
    )
    assert code == 0, err
    code, err = cli(
        *SAMPLE,
        "--model_path",
        "m.pt",
        "--n_samples",
        "4",
        "--batch_size",
        "4",
        "--save_npz",
        "one.npz",
        "--output",
        "one.png",
        cwd=work,
    )
    assert code == 0, err
    many, one = np.load(work / "many.npz")["images"], np.load(work / "one.npz")["images"]
    assert many.shape == (10, 16, 16, 1) and many.dtype == np.uint8
    assert np.array_equal(many[:4], one)
    assert not np.array_equal(many[4:8], one)  # later batches continue the random stream


def test_a_grid_too_large_for_one_png_is_refused_before_work(cli, work):
    refused(cli(*SAMPLE, "--model_path", "m.pt", "--n_samples", "1000000", cwd=work), "--no_grid")
    refused(cli(*SAMPLE, "--model_path", "m.pt", "--no_grid", cwd=work), "--save_npz")


def test_an_npz_larger_than_the_free_disk_is_refused(work, monkeypatch):
    import shutil

    from ddpm.data import image_files

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(ValueError, match="GiB free"):
        image_files.SampleOutputs(100_000, (1, 16, 16), npz=work / "big.npz").check()


def test_a_failed_sampling_run_leaves_no_partial_files(work):
    from ddpm.data import image_files

    with pytest.raises(RuntimeError, match="boom"):
        with image_files.SampleWriter(
            image_files.SampleOutputs(8, (1, 4, 4), grid=work / "p.png", npz=work / "p.npz")
        ) as out:
            out.add(torch.zeros(4, 1, 4, 4))
            raise RuntimeError("boom")
    assert not (work / "p.png").exists() and not (work / "p.npz").exists()
    assert not list(work.glob(".p.*"))


# ----- signals -------------------------------------------------------------------------------------------
def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "main.py"), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize(
    "sig,code,name",
    [
        # Slow: both signals reach one handler (messages.py); Ctrl-C's 130 is checked while sampling below.
        pytest.param(signal.SIGINT, 130, "Ctrl-C", marks=pytest.mark.slow),
        (signal.SIGTERM, 143, "SIGTERM"),
    ],
)
def test_a_signal_in_training_saves_a_whole_step_and_exits_128_plus_its_number(tmp_path, sig, code, name):
    proc = start([*TINY_SAVES, "--max_steps", "100000", "--model_path", "ck.pt"], tmp_path)
    assert proc.stdout.readline().startswith("training")  # printed just before the loop starts
    time.sleep(1.0)  # some steps in (a step of this U-Net: tens of ms)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    step = load_checkpoint(tmp_path / "ck.pt")["step"]
    assert step > 0 and f"{name}: stopped at step {step};" in stderr


# SIGTERM only: both signals reach the same handler (messages.py), and Ctrl-C's 130 is checked while sampling
# below (and in the U-Net's training, with make test-slow).
@pytest.mark.parametrize("sig,code,name", [(signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_in_autoencoder_training_saves_what_was_trained(tmp_path, sig, code, name):
    proc = start(
        [
            "--mode",
            "train_autoencoder",
            "--dataset",
            "digits",
            "--max_steps",
            "100000",
            "--batch_size",
            "8",
            "--model_path",
            "ae.pt",
        ],
        tmp_path,
    )
    assert proc.stdout.readline().startswith("training")  # printed just before the loop starts
    time.sleep(1.0)  # some steps in (a step of this autoencoder: milliseconds)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()[-1:]) == 1
    from ddpm.latent.autoencoder import load_autoencoder

    loaded = load_autoencoder(tmp_path / "ae.pt", device="cpu")  # a whole, loadable first stage
    step = torch.load(tmp_path / "ae.pt", weights_only=True)["step"]
    assert loaded.latent_scale > 0 and step > 0 and f"{name}: stopped at step {step} of 100000; saved ae.pt" in stderr
    assert (tmp_path / "ae_reconstructions.png").is_file() and not list(tmp_path.glob("*.lock"))


def test_ctrl_c_while_sampling_exits_130_and_writes_nothing(work, tmp_path):
    proc = start(
        [
            *SAMPLE,
            "--model_path",
            str(work / "m.pt"),
            "--sampling_steps",
            "10",
            "--n_samples",
            "512",
            "--batch_size",
            "8",
            "--save_npz",
            "s.npz",
            "--output",
            "s.png",
        ],
        tmp_path,
    )
    seen = ""  # past the imports, into the batches (64 of them: seconds on 2 cores): tqdm draws its bar
    while "batches" not in seen:
        char = proc.stderr.read(1)
        assert char, seen  # the run ended before its first batch
        seen += char
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    stderr = seen + rest
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == "main.py: Ctrl-C: stopped"
    assert list(tmp_path.iterdir()) == []  # no grid, no .npz, no temporary file


NO_FLAGS = SimpleNamespace(profile=None, log_dir=None)  # a TrainRequest's fields the loop reads, none given


def test_a_second_signal_does_not_cut_the_interrupt_save(tmp_path):
    class Trainer:
        step = 6
        config = SimpleNamespace(checkpoint=str(tmp_path / "m.pt"), total_steps=10, sample_every=0)
        device = "cpu"

        def run(self, **options):  # (profiler=..., curves=...: the real Trainer.run's keywords)
            self.step += 1
            raise messages.Interrupted(signal.SIGINT)

        def save(self):
            os.kill(os.getpid(), signal.SIGINT)  # the impatient second Ctrl-C, mid-save
            time.sleep(0.1)
            (tmp_path / "saved").write_text("whole")
            return tmp_path / "saved"

    messages.install()
    with pytest.raises(SystemExit) as exit_info:
        train_mode.train(Trainer(), NO_FLAGS, inputs={})
    assert exit_info.value.code == 130
    assert (tmp_path / "saved").read_text() == "whole"
    assert messages.pending() is None


def test_a_run_stopped_before_its_first_step_replaces_nothing(tmp_path, capsys):
    class Trainer:
        step = 0
        config = SimpleNamespace(checkpoint=str(tmp_path / "m.pt"), total_steps=10, sample_every=0)
        device = "cpu"

        def run(self, **options):
            raise messages.Interrupted(signal.SIGTERM)  # the mistaken --overwrite run, stopped at once

        def save(self):
            raise AssertionError("nothing may be saved")

    with pytest.raises(SystemExit) as exit_info:
        train_mode.train(Trainer(), NO_FLAGS, inputs={})
    assert exit_info.value.code == 143
    assert "stopped before the first step; nothing was saved" in capsys.readouterr().err


KILLED_SAVER = """
import sys, torch
sys.path.insert(0, {root!r})
from ddpm.formats.checkpoints import save_checkpoint
state = {{"format_version": 1, "model_config": {{}}, "schedule_config": {{}}, "ema": {{}}, "step": 0,
          "model": {{"w": torch.randn(1_000_000)}}}}
print("ready", flush=True)
for step in range(1, 10**6):
    state["step"] = step
    save_checkpoint({path!r}, state)
"""


def test_sigkill_during_saves_never_leaves_a_broken_checkpoint(tmp_path):
    path = tmp_path / "k.pt"
    rng = np.random.default_rng(0)
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_SAVER.format(root=str(ROOT), path=str(path))],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3 + rng.uniform(0, 0.7))
        proc.kill()
        proc.wait()
        if path.exists():  # the first saves may not have landed yet
            state = torch.load(path, weights_only=True)
            assert state["model"]["w"].shape == (1_000_000,)
    assert path.exists()
    check_outputs({"--model_path": path})  # the next run's start
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.pt"]


def test_stale_temporaries_of_live_processes_are_kept(tmp_path):
    mine = tmp_path / f".k.pt.tmp-{os.getpid()}-abc"
    mine.write_bytes(b"in progress")
    assert remove_stale_temporaries(tmp_path / "k.pt") == []
    assert mine.exists()


def test_non_finite_steps_most_of_a_run_end_non_zero(tmp_path):
    from helpers import make_trainer  # the tiny digits trainer

    from ddpm.util.messages import TrainingDiverged

    trainer = make_trainer(tmp_path, total_steps=15)
    clean = trainer.images.batch_with_labels

    def poisoned(step, **kwargs):  # 13 of 15 batches are NaN, never 20 in a row
        images, labels = clean(step, **kwargs)
        return images * (1.0 if step in (0, 7) else float("nan")), labels

    trainer.images.batch_with_labels = poisoned
    with pytest.raises(TrainingDiverged, match="13 of the 15 steps"):
        trainer.run(progress=False)


def test_check_outputs_refuses_hard_links_to_inputs(tmp_path):
    (tmp_path / "m.pt").write_bytes(b"model")
    os.link(tmp_path / "m.pt", tmp_path / "h.png")
    with pytest.raises(ValueError, match="same file as --model_path"):
        check_outputs({"--output": tmp_path / "h.png"}, inputs={"--model_path": tmp_path / "m.pt"})


def test_save_checkpoint_names_the_path_on_os_errors(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a folder"):
        save_checkpoint(
            tmp_path / "file" / "x.pt",
            {"format_version": 1, "model_config": {}, "schedule_config": {}, "model": {}, "ema": {}, "step": 0},
        )


def ended_in_one_line(result: tuple[int, str], match: str) -> None:
    """A run that failed once at work (after its progress bars): exit 2, its last line the one error, no traceback."""
    code, err = result
    assert code == 2, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("main.py: error:"), err
    assert match in err.strip().splitlines()[-1] and err.count("main.py: error:") == 1, err


class FullDisk:
    """A file whose disk fills after ``room`` bytes: every later write raises ENOSPC, as a real full disk's does."""

    def __init__(self, file, *, room: int = 4096, error: int = errno.ENOSPC) -> None:
        self.file, self.room, self.error = file, room, error

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(self.error, os.strerror(self.error))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def test_a_full_disk_during_a_checkpoint_save_ends_in_one_line_and_keeps_the_previous_checkpoint(
    cli, work, tmp_path, monkeypatch
):
    """torch.save meeting a full disk raised "RuntimeError: [enforce fail at inline_container.cc]" (a traceback,
    exit 1): one line naming the checkpoint as typed and what is intact; the old checkpoint is byte-identical."""
    (tmp_path / "ck.pt").write_bytes((work / "m.pt").read_bytes())
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *args, **kwargs: save(obj, FullDisk(f), *args, **kwargs))
    with unchanged(tmp_path / "ck.pt"):
        result = cli(*TINY_SAVES, "--max_steps", "2", "--model_path", "ck.pt", "--overwrite", cwd=tmp_path)
    ended_in_one_line(result, "cannot write ck.pt: No space left on device; the previous file is untouched and nothing")
    assert str(tmp_path) not in result[1] and "enforce fail" not in result[1]
    assert not list(tmp_path.glob(".ck.pt.tmp-*"))


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO])
@pytest.mark.parametrize("existing", [True, False])
def test_a_refused_write_ends_in_one_line_naming_the_output_and_leaves_nothing_partial(
    tmp_path, monkeypatch, error, existing
):
    """Any write (a grid, an ONNX graph, a report) whose file system refuses it: one WriteError line naming the
    output as given and saying what is intact; the previous file is untouched, no temporary is left."""
    monkeypatch.chdir(tmp_path)
    if existing:
        Path("out.onnx").write_bytes(b"old graph")

    def write(f) -> None:
        disk = FullDisk(f, room=4, error=error)
        disk.write(b"part")
        disk.write(b"the rest of the graph")

    with pytest.raises(safe_files.WriteError) as info:
        safe_files.atomic_write("out.onnx", write)
    intact = "the previous file is untouched" if existing else "no file was created"
    assert str(info.value) == f"cannot write out.onnx: {os.strerror(error)}; {intact} and nothing partial was left"
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out.onnx"] if existing else [])
    if existing:
        assert Path("out.onnx").read_bytes() == b"old graph"


def test_a_folder_replaced_on_a_full_disk_is_named_as_given_and_stays_as_it_was(tmp_path, monkeypatch):
    """A folder export's files (written beside the folder, then moved in) meeting a full disk name the folder as
    given, not the temporary one being written, and leave the old files whole."""
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()
    Path("d/unet.json").write_text("{}")
    with pytest.raises(safe_files.WriteError) as info:
        with model_folders.replaced_files("d", ["unet.json"]) as new:
            safe_files.atomic_write(new / "unet.json", lambda f: FullDisk(f, room=0).write(b"{new}"))
    assert str(info.value) == (
        "cannot write d: No space left on device; the previous folder is untouched and nothing partial was left"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and os.listdir("d") == ["unet.json"]
    assert Path("d/unet.json").read_text() == "{}"


def test_a_sample_grid_on_a_full_disk_ends_in_one_line(cli, work, tmp_path, monkeypatch):
    """PIL meeting a full disk while writing the grid: one line, exit 2, no partial PNG."""
    (tmp_path / "m.pt").write_bytes((work / "m.pt").read_bytes())
    save = Image.Image.save
    monkeypatch.setattr(
        Image.Image, "save", lambda self, f, *args, **kwargs: save(self, FullDisk(f, room=16), *args, **kwargs)
    )
    result = cli(*SAMPLE, "--model_path", "m.pt", "--output", "grid.png", cwd=tmp_path)
    ended_in_one_line(result, "cannot write grid.png: No space left on device; no file was created and nothing partial")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_cpu_out_of_memory_ends_in_one_line(cli, work, monkeypatch):
    def exhausted(*args, **kwargs):
        def draw(shape, generator, progress, guidance=None):
            torch.empty(2**62, dtype=torch.uint8)  # the allocator's own failure, raised at once

        return draw

    monkeypatch.setattr(registry, "make_drawer", exhausted)
    refused(cli(*SAMPLE, "--model_path", "m.pt", "--output", "oom.png", cwd=work), "the machine ran out of memory")
    assert not (work / "oom.png").exists()


@pytest.mark.parametrize("n,channels", [(9, 1), (7, 3), (1, 1)])
def test_the_grid_is_torchvisions_save_image_pixel_for_pixel(tmp_path, n, channels):
    from torchvision.utils import save_image

    from ddpm.data import image_files

    images = torch.rand(n, channels, 5, 6, generator=torch.Generator().manual_seed(n)) * 2.2 - 1.1  # some out of range
    ours = image_files.save_grid(images, tmp_path / "ours.png", scale=1)
    save_image((images.clamp(-1, 1) + 1) / 2, tmp_path / "theirs.png", nrow=image_files.grid_side(n))
    with Image.open(ours) as a, Image.open(tmp_path / "theirs.png") as b:
        assert a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


def test_the_default_grid_enlarges_small_tiles_pixel_for_pixel(tmp_path):
    from torchvision.utils import save_image

    from ddpm.data import image_files

    images = torch.rand(10, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ours = image_files.save_grid(images, tmp_path / "ours.png")  # 8x8 tiles -> x8 by default
    save_image((images + 1) / 2, tmp_path / "theirs.png", nrow=image_files.grid_side(10))
    with Image.open(ours) as a, Image.open(tmp_path / "theirs.png") as b:
        theirs = np.asarray(b).repeat(8, axis=0).repeat(8, axis=1)  # torchvision's grid, each pixel 8x8
        assert a.size == (8 * (4 * 10 + 2), 8 * (3 * 10 + 2)) and np.array_equal(np.asarray(a), theirs)


def test_the_default_grid_scale_shrinks_to_fit_one_png():
    from ddpm.data import image_files

    assert image_files.choose_grid_scale(64, height=28, width=28) == 3
    n = 10_000  # 100 x 100 tiles of 28 px: x1 fits in 4096^2 pixels, x2 would not
    assert image_files.choose_grid_scale(n, height=28, width=28) == 1
    assert image_files.grid_pixels(n, height=28, width=28) <= image_files.MAX_GRID_PIXELS


def written(tmp_path, name: str, write) -> object:
    path = tmp_path / name
    write(path)
    return path


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # a TorchScript file to find
def test_each_kind_is_found_from_its_content(tmp_path):
    files = {
        "png": written(tmp_path, "a.png", lambda p: Image.new("L", (2, 2)).save(p)),
        "checkpoint": written(tmp_path, "a.pt", lambda p: torch.save({"w": torch.zeros(2)}, p)),
        "torchscript": written(tmp_path, "a.ts", lambda p: torch.jit.script(torch.nn.ReLU()).save(str(p))),
        "npz": written(tmp_path, "a.npz", lambda p: np.savez(p, images=np.zeros(3, np.uint8))),
        "json": written(tmp_path, "a.json", lambda p: p.write_text(json.dumps({"rows": []}, indent=2))),
        "text": written(tmp_path, "a.csv", lambda p: p.write_text("step,loss\n1,0.5\n")),
    }
    if importlib.util.find_spec("safetensors"):
        from safetensors.torch import save_file

        files["safetensors"] = written(tmp_path, "a.safetensors", lambda p: save_file({"w": torch.zeros(2)}, p))
    if importlib.util.find_spec("onnx"):
        from onnx import helper

        graph = helper.make_graph([], "g", [], [])
        files["onnx"] = written(
            tmp_path, "a.onnx", lambda p: p.write_bytes(helper.make_model(graph).SerializeToString())
        )
    for kind, path in files.items():
        assert found_kind(path) == kind, (kind, path)
        if kind in KINDS:
            assert expected_kind(path) == kind
            check_kind("--out", path, kind=kind)  # its own kind may be replaced
    assert found_kind(written(tmp_path, "empty.json", lambda p: p.write_bytes(b""))) is None
    assert found_kind(written(tmp_path, "blob.engine", lambda p: p.write_bytes(b"\x00\x01ftrt" * 8))) == "binary"
    check_kind("--output", tmp_path / "blob.engine", kind="tensorrt")  # engines have no magic of their own
    check_kind("--csv", files["text"], kind="csv")


def test_a_file_of_another_kind_is_refused_whatever_its_name(tmp_path):
    buffer = io.BytesIO()
    torch.save({"model": {}}, buffer)
    disguised = written(tmp_path, "report.json", lambda p: p.write_bytes(buffer.getvalue()))
    with pytest.raises(ValueError, match="report.json already holds a PyTorch checkpoint, not a JSON file"):
        check_kind("--json", disguised, kind="json")
    with pytest.raises(ValueError, match="already holds a PyTorch checkpoint"):  # no kind given: the name's
        check_kind("the preview", disguised, kind=None)
    with pytest.raises(ValueError, match="--csv writes a CSV table and needs a file name ending in .csv, got r.JSON"):
        check_kind("--csv", "r.JSON", kind="csv")
    json_file = written(tmp_path, "r.csv", lambda p: p.write_text('{"a": 1}'))
    with pytest.raises(ValueError, match="already holds a JSON file, not a CSV table"):
        check_kind("--csv", json_file, kind="csv")


def test_the_estimate_line_says_calls_time_and_memory():
    line = phase_line("calibration", calls=4096, seconds=80, held_bytes=3 << 20, available_bytes=20 << 30)
    assert line == "calibration: 4,096 U-Net calls, about 1 min 20 s; 3.0 MiB held, 20.0 GiB available"
    calls = []
    assert seconds_per_call(lambda: calls.append(1), device=torch.device("cpu")) >= 0 and len(calls) == 2


def test_a_checkpoint_cut_short_is_found_truncated_and_named_so(tmp_path):
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(2048)}}, buffer)
    cut = written(tmp_path, "student.pt", lambda p: p.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2]))
    assert found_kind(cut) == "broken_zip"
    with pytest.raises(ValueError, match="student.pt already holds a truncated or corrupt zip archive"):
        check_kind("--output", cut, kind="checkpoint")


@pytest.mark.parametrize(
    "content,held",
    [(b"\x89PNG\r\n\x1a\n" + bytes(8), "holds a PNG image"), (b"notes\n", "holds a text file"), (b"", "is empty")],
)
def test_resuming_a_file_that_is_no_checkpoint_names_what_it_holds(tmp_path, content, held):
    """--resume reads --model_path before it writes it: a PNG or a text file there is no checkpoint to continue, not
    an output that "would be destroyed"; the file stays as it was."""
    (tmp_path / "ck.pt").write_bytes(content)
    result = run_here(*TINY_SAVES, "--resume", "--model_path", "ck.pt", cwd=tmp_path)
    assert_user_error(result, f"--model_path ck.pt is not a checkpoint (it {held}); --resume continues one")
    assert (tmp_path / "ck.pt").read_bytes() == content
