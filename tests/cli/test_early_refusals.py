"""Every flag of every mode, given a value no run can take, is refused in one line naming the flag before the
mode starts: before any model file is read, any dataset loaded, any trajectory drawn, any export or compile.

The walk covers the whole flag table (cli/flags.py): a flag added without an entry here fails the first test,
so each new flag is given its invalid value (or named a switch, which has none). The hook is the mode itself:
main.run_mode is replaced by one that fails the test, so a refusal that comes later is caught by what it
reached, not by how long it took.
"""

from __future__ import annotations

import pytest
from helpers import assert_user_error, run_here

import main
from ddpm.cli.flags import FLAGS, MODES, flags_of

# A value of each flag that no run can take, whatever its files hold ({mode: value} where modes differ).
INVALID: dict[str, object] = {
    "mode": "paint",
    "device": "tpu",
    "seed": "-1",
    "precision": {"train": "int8", "distill": "int8", "train_autoencoder": "bf16", None: "fp4"},
    "profile": "a_file",
    "model_path": "",
    "dataset": "imagenet",
    "data_dir": "",
    "img_size": "0",
    "channels": "0",
    "model_preset": "huge",
    "model_channels": "0",
    "num_res_blocks": "0",
    "dropout": "1.5",
    "time_conditioning": "multiply",
    "patch_size": "0",
    "beta_schedule": "sigmoid",
    "timesteps": "0",
    "autoencoder": "",
    "n_epochs": "0",
    "max_steps": "0",
    "batch_size": "0",
    "lr": "0",
    "warmup_steps": "-1",
    "ema_decay": "2",
    "min_snr_gamma": "-1",
    "grad_clip": "-1",
    "timestep_sampling": "random",
    "cond_drop": "2",
    "save_every": "-1",
    "sample_every": "-1",
    "init_from": "",
    "log_dir": "a_file",
    "log_every": "0",
    "implementation": "fastest",
    "n_samples": "0",
    "sampler": "euler",
    "sampling_steps": {"distill": "3", None: "0"},
    "eta": "2",
    "class_label": "",
    "guidance_scale": "-1",
    "output": "",
    "save_npz": "",
    "grid_scale": "0",
    "opset": "5",
    "trt_backend": "onnx",
    "max_batch": "0",
    "trt_opt_level": "9",
    "format": "pickle",
    "calibration_samples": "0",
    "bench": "inference",
    "train_steps": "0",
    "repeats": "0",
    "warmup": "-1",
    "json": "",
    "csv": "",
    "chart": "",
    "rows": "original,warp_drive",
    "inception_weights": "missing_weights.pth",
    "students": "",
    "distill_samples": "0",
    "teacher_steps": "0",
    "latent_channels": "0",
    "downsample": "3",
    "ae_channels": "0",
    "kl_weight": "-1",
}
# Switches: present or not, never a wrong value (what they contradict is refused where it is read).
SWITCHES = {
    "class_cond",
    "compile",
    "grad_checkpoint",
    "resume",
    "overwrite",
    "no_clip",
    "no_ema",
    "no_grid",
    "trust_torchscript",
    "interleave",
}
# What each mode needs besides the flag under test (the files named need not exist: nothing is read).
BASE = {
    "train": ["--mode", "train", "--dataset", "digits"],
    "sample": ["--mode", "sample", "--model_path", "m.pt"],
    "evaluate": ["--mode", "evaluate", "--model_path", "m.pt"],
    "benchmark": ["--mode", "benchmark"],
    "export": ["--mode", "export", "--model_path", "m.pt"],
    "train_autoencoder": ["--mode", "train_autoencoder", "--dataset", "digits"],
    "distill": ["--mode", "distill", "--model_path", "t.pt"],
}
CASES = [(mode, name) for mode in MODES for name in flags_of(mode) if name not in SWITCHES]


def invalid(name: str, mode: str) -> str:
    value = INVALID[name]
    return value.get(mode, value.get(None)) if isinstance(value, dict) else value


def test_every_flag_has_an_invalid_value_or_is_a_switch():
    assert set(FLAGS) == set(INVALID) | SWITCHES
    assert not set(INVALID) & SWITCHES


@pytest.fixture
def no_mode_runs(monkeypatch):
    """main.run_mode fails the test: a refusal must come while the request is built, before the mode's work."""

    def reached(mode: str):
        def run(request):
            pytest.fail(f"--mode {mode} started its work ({type(request).__name__}) before refusing")

        return run

    monkeypatch.setattr(main, "run_mode", reached)


@pytest.mark.parametrize("mode,name", CASES)
def test_an_invalid_flag_is_refused_before_the_mode_starts(tmp_path, no_mode_runs, mode, name):
    (tmp_path / "a_file").write_text("not a folder\n")
    value = invalid(name, mode)
    result = run_here("--device", "cpu", *BASE[mode], f"--{name}", value, cwd=tmp_path)
    if result.stderr.startswith("usage:") or "(see --help)" in result.stderr:  # argparse's own refusal
        assert result.returncode == 2 and f"--{name}" in result.stderr, result.stderr
        return
    assert_user_error(result, f"--{name}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_a_benchmark_row_named_twice_is_refused_with_or_without_interleave(tmp_path, no_mode_runs):
    for extra in ([], ["--interleave"]):  # without --interleave, cuda was timed twice
        result = run_here("--device", "cpu", *BASE["benchmark"], "--rows", "original,cuda,cuda", *extra, cwd=tmp_path)
        assert_user_error(result, "--rows names cuda twice")
