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
from ddpm.cli.flags import FLAGS, flags_of
from ddpm.cli.parser import not_read_by_run
from ddpm.cli.reads import MODES, READ_BY_RUN

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
    "distill_method": "gan",
    "adv_weight": "0",
    "adv_real": "both",
    "dmd_weight": "-1",
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


# ----- issue 58: flags a run of the mode does not read, values no run can use, words that name the flag -----
def other_value(mode: str, selector: str, readers: tuple[str, ...]) -> str:
    """A value of ``selector`` (from its choices) whose runs do not read the flags ``readers`` read."""
    return next(str(v) for v in FLAGS[selector].options_for(mode)["choices"] if str(v) not in readers)


# A value each flag of reads.READ_BY_RUN takes (None: a switch), valid for the runs that read it.
VALID = {
    **dict.fromkeys(("trt_backend",), "native"),
    **dict.fromkeys(("max_batch", "sampling_steps", "calibration_samples", "batch_size", "n_samples"), "4"),
    **dict.fromkeys(("train_steps", "repeats"), "2"),
    "trt_opt_level": "2",
    "opset": "21",
    "adv_weight": "0.3",
    "adv_real": "data",
    "data_dir": "d",
    "dmd_weight": "2",
    "sampler": "ddim",
    "eta": "0.5",
    "guidance_scale": "2",
    "precision": "fp32",
    "csv": "t.csv",
    "chart": "t.png",
    "no_clip": None,
}
RUN_CASES = [(mode, name) for mode, table in READ_BY_RUN.items() for name in table]


def test_every_flag_read_by_some_runs_has_a_value_here():
    assert {name for _, name in RUN_CASES} == set(VALID)


@pytest.mark.parametrize("mode,name", RUN_CASES)
def test_a_flag_a_run_of_its_mode_does_not_read_is_refused_naming_it(tmp_path, no_mode_runs, mode, name):
    """The table walked whole: each flag given to a run (an export format, a bench kind, an implementation) that
    does not read it is refused in one line naming the flag and the runs that read it; those runs take it."""
    selector, readers = READ_BY_RUN[mode][name]
    written = [f"--{name}"] if VALID[name] is None else [f"--{name}", VALID[name]]
    other = other_value(mode, selector, readers)
    result = run_here("--device", "cpu", *BASE[mode], f"--{selector}", other, *written, cwd=tmp_path)
    assert_user_error(result, f"--{name} is read by --mode {mode} with --{selector} {' or '.join(readers)}")
    assert f"not --{selector} {other}" in result.stderr
    assert not_read_by_run(mode, {selector: readers[0]}, {name}) is None


@pytest.mark.parametrize(
    "args,named",
    [  # each as the adversarial pass found it (issue 58, item 7)
        (["--mode", "export", "--model_path", "m.pt", "--format", "onnx", "--trt_opt_level", "5"], "--trt_opt_level"),
        (["--mode", "export", "--model_path", "m.pt", "--format", "onnx", "--max_batch", "8"], "--max_batch"),
        (["--mode", "export", "--model_path", "m.pt", "--format", "onnx", "--sampler", "ddim"], "--sampler"),
        (["--mode", "export", "--model_path", "m.pt", "--format", "safetensors", "--opset", "20"], "--opset"),
        (["--mode", "benchmark", "--bench", "training", "--sampling_steps", "5"], "--sampling_steps"),
        (["--mode", "benchmark", "--train_steps", "5"], "--train_steps"),
        (["--mode", "benchmark", "--bench", "training", "--repeats", "5"], "--repeats"),
        (["--mode", "export", "--model_path", "m.pt", "--calibration_samples", "4"], "--calibration_samples"),
    ],
)
def test_flags_that_would_change_nothing_are_refused(tmp_path, no_mode_runs, args, named):
    result = run_here("--device", "cpu", *args, cwd=tmp_path)
    assert_user_error(result, f"{named} is read by")


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--mode", "train", "--dataset", "digits", "--lr", "1e30"],
            "--lr must be a learning rate above 0 and at most 1",
        ),
        (
            ["--mode", "distill", "--model_path", "t.pt", "--lr", "2"],
            "--lr must be a learning rate above 0 and at most 1",
        ),
        (
            ["--mode", "train_autoencoder", "--dataset", "digits", "--lr", "1e30"],
            "--lr must be a learning rate above 0 and at most 1",
        ),
        (
            ["--mode", "train", "--dataset", "digits", "--warmup_steps", "500", "--max_steps", "2"],
            "--warmup_steps 500 is longer than the run (--max_steps 2)",
        ),
        (
            ["--mode", "distill", "--model_path", "t.pt", "--warmup_steps", "500", "--max_steps", "2"],
            "--warmup_steps 500 is longer than the run (--max_steps 2)",
        ),
        (
            ["--mode", "train", "--dataset", "digits", "--resume", "--warmup_steps", "500", "--max_steps", "2"],
            "--warmup_steps 500 is longer than the run",
        ),
    ],
)
def test_absurd_learning_rates_and_warm_ups_are_refused(tmp_path, no_mode_runs, args, message):
    assert_user_error(run_here("--device", "cpu", *args, cwd=tmp_path), message)


@pytest.mark.parametrize(
    "students,message",
    [
        ("a.pt,a.pt", "--students names a.pt twice; name each student once"),
        ("a.pt,./a.pt", "--students names a.pt twice (a.pt and ./a.pt)"),
        ("st4.png", "--students st4.png: expected a diffusers model folder or a file ending in"),
    ],
)
def test_students_are_refused_by_their_names_naming_students(tmp_path, no_mode_runs, students, message):
    result = run_here("--device", "cpu", *BASE["evaluate"], "--students", students, cwd=tmp_path)
    assert_user_error(result, message)
    assert "--model_path" not in result.stderr


@pytest.mark.parametrize("rows", ["all,original", "original,all", "all,fp32"])
def test_rows_all_in_a_list_says_all_stands_alone(tmp_path, no_mode_runs, rows):
    bench = ["--bench", "training"] if "fp32" in rows else []
    result = run_here("--device", "cpu", *BASE["benchmark"], *bench, "--rows", rows, cwd=tmp_path)
    assert_user_error(result, f"--rows {rows}: all names every row and stands alone")


@pytest.mark.parametrize("bench,row", [("sampling", "warp"), ("training", "warp")])
def test_an_unknown_row_lists_all_among_the_choices(tmp_path, no_mode_runs, bench, row):
    result = run_here("--device", "cpu", *BASE["benchmark"], "--bench", bench, "--rows", row, cwd=tmp_path)
    assert_user_error(result, "or all (alone)")


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--mode", "train", "--dataset", "digits", "--model_path", "same.pt", "--log_dir", "same.pt"],
            "--log_dir same.pt and --model_path same.pt name the same path",
        ),
        (
            ["--mode", "distill", "--model_path", "t.pt", "--output", "same.pt", "--log_dir", "./same.pt"],
            "--log_dir ./same.pt and --output same.pt name the same path",
        ),
    ],
)
def test_a_log_dir_that_is_the_checkpoint_says_the_two_flags_name_one_path(tmp_path, no_mode_runs, args, message):
    result = run_here("--device", "cpu", *args, cwd=tmp_path)
    assert_user_error(result, message)
    assert "another run" not in result.stderr


def test_a_truncated_checkpoint_is_called_truncated_not_a_binary_file(tmp_path, no_mode_runs):
    import torch

    torch.save({"weights": torch.zeros(4096)}, tmp_path / "whole.pt")
    whole = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])  # a copy cut short: no zip directory
    result = run_here(
        "--device", "cpu", "--mode", "distill", "--model_path", "t.pt", "--output", "cut.pt", cwd=tmp_path
    )
    assert_user_error(result, "--output cut.pt already holds a truncated or corrupt zip archive")
    assert "binary file" not in result.stderr


def test_messages_name_paths_as_typed_not_the_machines(tmp_path, no_mode_runs):
    (tmp_path / "afile").write_text("not a folder\n")
    result = run_here("--device", "cpu", *BASE["sample"], "--output", "afile/x.png", cwd=tmp_path)
    assert_user_error(result, "--output afile/x.png: afile is not a folder")
    assert str(tmp_path) not in result.stderr
