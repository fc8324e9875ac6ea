"""modes/drawing.py: what sample and evaluate share when they open a model file; here, that --dataset may not
contradict the training data the file records, in sample as in evaluate (one check: check_recorded_dataset)."""

from __future__ import annotations

import pytest
from helpers import assert_user_error, run_here, tiny_teacher


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
