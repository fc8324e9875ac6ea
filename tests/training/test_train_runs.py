"""A training run's own guards (modes/train.py): one writer per log folder, and a batch its data can fill; each
step's gradient clipping and EMA against their formulas; and a run on a CUDA GPU end to end (pytest -m gpu)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TINY_TRAIN, assert_user_error, make_trainer, run_here
from PIL import Image

from ddpm.util.safe_files import run_lock

HOLD = (
    "import sys; sys.path.insert(0, {root!r}); from ddpm.util.safe_files import run_lock\n"
    "with run_lock({path!r}, flag='--log_dir'):\n"
    "    print('held', flush=True); sys.stdin.read()\n"
)


def test_a_second_live_run_writing_into_the_same_log_dir_is_refused_in_one_line(tmp_path):
    """Another process holds the log folder's lock as a live training run does (modes/train.run_locks); a run
    into another checkpoint but the same --log_dir stops before it reads any data, and writes nothing."""
    logs = tmp_path / "logs"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(root=str(ROOT), path=str(logs))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_here(*TINY_TRAIN, "--model_path", "b.pt", "--log_dir", "logs", cwd=tmp_path)
        assert_user_error(result, "another run is training into logs (it holds logs.lock)")
        assert "--log_dir" in result.stderr and str(tmp_path) not in result.stderr  # the path as typed
        assert not (tmp_path / "b.pt").exists() and not (logs / "metrics.csv").exists()
    finally:
        holder.communicate("", timeout=30)
    with run_lock(logs, flag="--log_dir"):  # the first run gone, its lock is gone with it
        pass
    assert not (tmp_path / "logs.lock").exists()


def test_a_batch_larger_than_the_dataset_is_refused_naming_both_numbers(tmp_path):
    data = tmp_path / "images"
    data.mkdir()
    for i in range(5):
        Image.new("L", (16, 16), color=i * 40).save(data / f"{i}.png")
    args = ["--mode", "train", "--dataset", "folder", "--data_dir", str(data), "--img_size", "16"]
    result = run_here(*args, "--model_path", "m.pt", "--max_steps", "2", cwd=tmp_path)
    assert_user_error(result, "--batch_size 64 is larger than the 5 folder training images")
    assert not (tmp_path / "m.pt").exists()
    digits = [a if a != "8" else "2000" for a in TINY_TRAIN]  # TINY_TRAIN's --batch_size 8
    result = run_here(*digits, "--model_path", "d.pt", cwd=tmp_path)
    assert_user_error(result, "--batch_size 2000 is larger than the 1797 digits training images")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_cuda_writes_its_preview_grid_and_the_export_reads_its_weights_back(tmp_path):
    """Found on an H200 while every CPU test passed: the preview's sampling plan was made on the CPU beside a
    model on cuda, and the export compared a cuda tensor with the CPU one it had written."""
    trained = run_here(*TINY_TRAIN, "--device", "cuda", "--model_path", "m.pt", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert list(tmp_path.glob("m_samples/step_*.png")), sorted(p.name for p in tmp_path.iterdir())
    export = ["--mode", "export", "--device", "cuda", "--model_path", "m.pt", "--format", "safetensors"]
    exported = run_here(*export, "--output", "m.safetensors", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "bit for bit" in exported.stdout


def test_a_warm_up_longer_than_a_run_of_epochs_is_refused_once_its_length_is_known(tmp_path):
    """With --max_steps the length is known with the flags (tests/cli/test_early_refusals.py); with --n_epochs only
    once the data say how many steps an epoch holds, before the first step."""
    args = [*TINY_TRAIN[: TINY_TRAIN.index("--max_steps")], *TINY_TRAIN[TINY_TRAIN.index("--max_steps") + 2 :]]
    result = run_here(*args, "--n_epochs", "1", "--warmup_steps", "100000", "--model_path", "m.pt", cwd=tmp_path)
    assert_user_error(result, "--warmup_steps 100,000 is longer than the run (1 epoch: ")
    assert not (tmp_path / "m.pt").exists()


def test_each_step_clips_the_gradients_to_grad_clip_and_records_their_norm_before(tmp_path):
    trainer = make_trainer(tmp_path, grad_clip=1e-3)  # far below a fresh model's gradient norm
    for _ in range(2):
        trainer.train_step()
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        assert trainer.grad_norm > 1e-2 and torch.isclose(clipped, torch.tensor(1e-3), rtol=1e-4), trainer.grad_norm


def test_after_each_step_the_ema_is_the_warmed_up_running_average_of_the_weights(tmp_path):
    """ema <- ema + (1 - d) (weights - ema) with d = min(ema_decay, (1 + k) / (10 + k)) at step k, from a copy of the
    initial weights."""
    trainer = make_trainer(tmp_path, ema_decay=0.9)
    expected = [p.detach().clone() for p in trainer.model.parameters()]
    for _ in range(4):
        k = trainer.step
        trainer.train_step()
        d = min(0.9, (1 + k) / (10 + k))
        expected = [e + (1 - d) * (p.detach() - e) for e, p in zip(expected, trainer.model.parameters())]
        for got, want in zip(trainer.ema.parameters(), expected, strict=True):
            torch.testing.assert_close(got, want)
