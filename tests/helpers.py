"""What the tests share: tiny configs, tiny models, and the command line run as a user runs it.

    from helpers import TINY_TRAIN, assert_user_error, perturbed_unet, run, run_here, tiny_unet_config

Fixtures live in conftest.py; everything else two test files need lives here, so no test file imports
another.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from basic_diffusion import UNet, UNetConfig
from ddpm.formats.exporters import ONNX_INSTALL
from noise_schedule import ScheduleConfig

ROOT = Path(__file__).resolve().parents[1]

# ----- tiny models -----------------------------------------------------------------------------------
# The U-Net most tests use: two levels, one residual block each, attention at 8x8, 16 channels wide.
TINY_UNET = dict(
    model_channels=16, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(8,), num_heads=2, dropout=0.0
)
TINY_SCHEDULE = ScheduleConfig(num_timesteps=50)


def tiny_unet_config(*, image_size: int = 16, in_channels: int = 1, **overrides) -> UNetConfig:
    """:data:`TINY_UNET` at ``image_size`` x ``in_channels``, with any field overridden."""
    return UNetConfig(image_size=image_size, in_channels=in_channels, **{**TINY_UNET, **overrides})


def perturbed_unet(config: UNetConfig, *, device: str | torch.device = "cpu", std: float = 0.05) -> UNet:
    """A U-Net of ``config`` (seed 0) in eval mode whose zero-initialized layers got small random
    weights, as benchmark mode builds it (sampling_bench.perturb_zero_init): its output layers would
    otherwise give eps = 0, and every implementation would agree trivially."""
    from ddpm.benchmarks.sampling_bench import perturb_zero_init

    torch.manual_seed(0)
    model = UNet(config)
    perturb_zero_init(model, seed=0, std=std)
    return model.to(device).eval()


def save_weights_only(path: Path, model: UNet) -> Path:
    """A checkpoint of ``model`` on TINY_SCHEDULE holding its configs and weights, no training state (no
    train_config: nor the dataset it would record)."""
    from ddpm.formats.checkpoints import save_checkpoint

    weights = model.state_dict()
    state = {"format_version": 1, "model_config": model.config.to_dict(), "schedule_config": vars(TINY_SCHEDULE)}
    save_checkpoint(path, state | {"model": weights, "ema": weights, "step": 0})
    return path


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by its path inside it: what a test compares to see that nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def make_trainer(tmp_path, *, total_steps=6, state=None, **overrides):
    """A tiny digits trainer (16x16, 100 timesteps) writing tmp_path/run.pt; ``overrides`` go to TrainConfig."""
    from ddpm.data.datasets import load_images
    from ddpm.training.trainer import TrainConfig, Trainer

    images = load_images("digits", data_dir="unused", image_size=16)
    config = TrainConfig(
        dataset="digits",
        total_steps=total_steps,
        batch_size=16,
        lr=1e-3,
        warmup_steps=2,
        checkpoint=str(tmp_path / "run.pt"),
        save_every=0,
        sample_every=0,
        preview_samples=4,
        preview_steps=2,
        **overrides,
    )
    model_config = tiny_unet_config(dropout=0.1)
    return Trainer(
        config, model_config, ScheduleConfig(num_timesteps=100), images=images, device="cpu", resume_state=state
    )


HAVE_ONNX = all(importlib.util.find_spec(name) for name in ("onnx", "onnxscript", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAVE_ONNX, reason=f"needs onnx, onnxscript and onnxruntime: {ONNX_INSTALL}")

# ----- the command line ------------------------------------------------------------------------------
TINY_TRAIN = [
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
    "50",
    "--max_steps",
    "3",
    "--batch_size",
    "8",
    "--sample_every",
    "0",
]
# A tiny distillation: 8 trajectories of 8 teacher steps, students trained on batches of 4.
TINY_DISTILL = ["--distill_samples", "8", "--teacher_steps", "8", "--batch_size", "4", "--seed", "3"]


def tiny_teacher(folder: Path, name: str, *args: str) -> Path:
    """folder/name: a :data:`TINY_TRAIN` digits checkpoint; ``args`` add flags (another --seed: another model)."""
    result = run_here(*TINY_TRAIN, "--model_path", name, *args, cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / name


def distill_here(folder: Path, teacher, *args: str, output: str = "student.pt") -> subprocess.CompletedProcess:
    """A :data:`TINY_DISTILL` run of ``teacher`` in ``folder`` (:func:`run_here`), writing ``output``."""
    return run_here(
        "--mode", "distill", "--model_path", str(teacher), "--output", output, *TINY_DISTILL, *args, cwd=folder
    )  # fmt: skip


def tiny_student(folder: Path, teacher: Path, name: str, *args: str) -> Path:
    """folder/name: a :data:`TINY_DISTILL` student of ``teacher``, one step; ``args`` add flags."""
    result = run_here(
        "--mode", "distill", "--model_path", str(teacher), "--output", name, *TINY_DISTILL, "--max_steps", "1", *args,
        cwd=folder,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return folder / name


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python main.py args`` in a new process, as a user runs it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "main.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def run_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``main.main(args)`` in this process, in ``cwd``, with its exit code and output captured (the same
    code without the seconds each new Python process spends importing torch)."""
    import main
    from ddpm.util import messages

    out, err, previous = io.StringIO(), io.StringIO(), os.getcwd()
    handlers = {sig: signal.getsignal(sig) for sig in messages.SIGNALS}  # main installs its own
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main.main(list(args))
            except SystemExit as exc:  # argparse's own errors and --help
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(previous)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def assert_user_error(result: subprocess.CompletedProcess, match: str) -> None:
    """Exit code 2, no traceback, one line on stderr that starts like every user error and says ``match``."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("main.py: error:"), result.stderr
    assert match in lines[0], lines[0]


# ----- references ------------------------------------------------------------------------------------
# A sampling trajectory's images from the fused runner against the original's, in fp32: each step's rounding is
# carried on, and the runner's F(4x4, 3x3) convolutions round more than oneDNN's direct sums, so its images drift
# from the exact U-Net's trajectory several times as far as the original's own fp32 ones (README: float tolerance).
TRAJECTORY_TOL = 1e-3


def outputs_and_grads(function, dtype: torch.dtype, inputs, grad: torch.Tensor) -> list:
    """function(*inputs) on copies of ``inputs`` in ``dtype`` (a None input stays None) and their gradients for the
    output's gradient ``grad``: [output, *gradients] (None for a None input)."""
    leaves = [None if t is None else t.to(dtype, copy=True).requires_grad_() for t in inputs]
    output = function(*leaves)
    output.backward(grad.to(dtype))
    return [output.detach(), *(None if leaf is None else leaf.grad for leaf in leaves)]


def conv3x3_case(shape: tuple[int, int, int, int, int], *, bias: bool = True) -> tuple:
    """(x, weight, bias, grad) in float64 for a 3x3 convolution of shape (B, Cin, Cout, H, W), seeded by the shape,
    the kernel scaled to keep the output near x's size; bias None where not asked."""
    B, cin, cout, H, W = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(B, cin, H, W, generator=gen, dtype=torch.float64)
    w = torch.randn(cout, cin, 3, 3, generator=gen, dtype=torch.float64) / (3 * cin**0.5)
    b = torch.randn(cout, generator=gen, dtype=torch.float64) if bias else None
    return x, w, b, torch.randn(B, cout, H, W, generator=gen, dtype=torch.float64)
