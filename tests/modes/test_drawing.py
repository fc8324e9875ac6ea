"""modes/drawing.py: what sample and evaluate share when they open a model file: that --dataset may not
contradict the training data the file records, in sample as in evaluate (one check: check_recorded_dataset); and
what they draw with where --sampler is left out (issue 59: SDE-DPM-Solver++ in 20 steps, a student's own sampler),
said in one line (sampling_line)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_user_error, run_here, tiny_student, tiny_teacher


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    return tiny_teacher(tmp_path_factory.mktemp("drawing"), "digits.pt")


@pytest.mark.parametrize("mode", ["sample", "evaluate"])
def test_a_dataset_that_contradicts_the_model_file_is_refused_before_drawing(digits_model, tmp_path, mode):
    result = run_here(
        "--device", "cpu", "--mode", mode, "--model_path", str(digits_model), "--dataset", "mnist",
        "--n_samples", "2", cwd=tmp_path,
    )  # fmt: skip
    assert_user_error(result, f"--dataset mnist contradicts {digits_model}, which was trained on digits")
    assert list(tmp_path.iterdir()) == []  # no grid, no report


def test_the_dataset_the_model_records_is_accepted_by_sample(digits_model, tmp_path):
    result = run_here(
        "--device", "cpu", "--mode", "sample", "--model_path", str(digits_model), "--dataset", "digits",
        "--n_samples", "2", "--sampler", "ddim", "--sampling_steps", "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "samples.png").is_file()


# ----- issue 59: few calls by default -----------------------------------------------------------------------------
def draw(model, folder, name: str, *flags: str):
    """``--mode sample`` of ``model`` (seed 0, 2 images): its stdout and its images (uint8)."""
    result = run_here(
        "--device", "cpu", "--mode", "sample", "--model_path", str(model), "--n_samples", "2", "--seed", "0",
        "--no_grid", "--save_npz", f"{name}.npz", *flags, cwd=folder,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout, np.load(folder / f"{name}.npz")["images"]


def test_sample_without_a_sampler_draws_sde_dpm_solver_in_20_steps_and_says_so(digits_model, tmp_path):
    out, default = draw(digits_model, tmp_path, "default")
    # The tiny model has T = 50: DDPM would take 50 calls, the default 20.
    assert "sampling: dpm_solver_sde, 20 steps (default; --sampler ddpm for the 50-step DDPM)" in out.splitlines()
    assert "(2 samples, dpm_solver_sde, 20 steps)" in out
    _, named = draw(digits_model, tmp_path, "named", "--sampler", "dpm_solver_sde", "--sampling_steps", "20")
    assert np.array_equal(default, named)  # the same plan and noise: the same bytes
    out, ddpm = draw(digits_model, tmp_path, "ddpm", "--sampler", "ddpm")  # as named: DDPM in all T steps
    assert "sampling: ddpm, 50 steps" in out.splitlines() and "(2 samples, ddpm, 50 steps)" in out
    assert not np.array_equal(default, ddpm)


def test_sampling_steps_without_a_sampler_are_the_default_samplers(digits_model, tmp_path):
    out, stepped = draw(digits_model, tmp_path, "stepped", "--sampling_steps", "5")
    assert "sampling: dpm_solver_sde, 5 steps (the default sampler; --sampler ddpm for DDPM)" in out.splitlines()
    _, named = draw(digits_model, tmp_path, "named", "--sampler", "dpm_solver_sde", "--sampling_steps", "5")
    assert np.array_equal(stepped, named)


def test_evaluate_without_a_sampler_has_one_row_sde_dpm_solver_in_20_steps(digits_model, tmp_path):
    result = run_here(
        "--device", "cpu", "--mode", "evaluate", "--model_path", str(digits_model), "--n_samples", "2",
        "--json", "e.json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "sampling: dpm_solver_sde, 20 steps (default; --sampler ddpm for the 50-step DDPM)" in result.stdout
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [(row["sampler"], row["steps"], row["calls"]) for row in rows] == [("dpm_solver_sde", 20, 20)]


def test_the_requests_leave_the_sampler_to_the_model_and_benchmark_keeps_ddpm():
    from ddpm.cli import resolve
    from ddpm.requests import own_sampling
    from noise_schedule import NoiseSchedule, ScheduleConfig

    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=50))
    _, evaluate = resolve.parse(["--device", "cpu", "--mode", "evaluate", "--sampling_steps", "3,5"])
    assert (evaluate.samplers, evaluate.sampling_steps) == ([None], [3, 5])  # None: the model's own, or the default
    assert own_sampling(schedule.config, sampler=None, sampling_steps=5) == ("dpm_solver_sde", None)
    _, sample = resolve.parse(["--device", "cpu", "--mode", "sample"])
    plan = sample.sampling.plan(schedule, device="cpu")
    assert (sample.sampling.sampler, plan.sampler, plan.num_steps) == (None, "dpm_solver_sde", 20)
    _, run = resolve.parse(["--device", "cpu", "--mode", "benchmark", "--img_size", "16", "--channels", "1"])
    plan = run.sampling.plan(schedule, device="cpu")
    assert (plan.sampler, plan.num_steps) == ("ddpm", 50)  # benchmark times DDPM (its quick plan may respace it)


def test_a_student_without_a_sampler_still_draws_with_its_own(digits_model, tmp_path):
    student = tiny_student(tmp_path, digits_model, "student.pt", "--sampling_steps", "2")
    out, _ = draw(student, tmp_path, "student")
    assert "sampling: consistency, 2 steps (the student's own)" in out.splitlines()
    result = run_here(
        "--device", "cpu", "--mode", "evaluate", "--model_path", str(student), "--n_samples", "2",
        "--json", "e.json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "sampling: consistency, 2 steps (the student's own)" in result.stdout
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [(row["sampler"], row["steps"]) for row in rows] == [("consistency", 2)]
