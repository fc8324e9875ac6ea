"""cli/reads.py: single flag values, checked while a request is built (a ValueError naming the flag)."""

import pytest

from ddpm.cli import reads


def test_lists_parse_and_bad_items_are_named():
    assert reads.parse_list("ddpm,ddim", kind=str, flag="--sampler", choices=("ddpm", "ddim")) == ["ddpm", "ddim"]
    assert reads.parse_list("5,10", kind=int, flag="--sampling_steps") == [5, 10]
    assert reads.parse_list(None, kind=int, flag="--sampling_steps") == [None]
    with pytest.raises(ValueError, match="--sampling_steps"):
        reads.parse_list("5,x", kind=int, flag="--sampling_steps")


def test_counts_and_steps_name_the_flag():
    reads.check_positive(n_samples=1, batch_size=None)  # None: the flag was left out
    with pytest.raises(ValueError, match="--n_samples must be a positive integer, got 0"):
        reads.check_positive(n_samples=0)
    with pytest.raises(ValueError, match="--warmup_steps"):
        reads.check_not_negative(warmup_steps=-1)


def test_learning_rates_are_bounded_above_by_one():
    reads.check_training_numbers(lr=reads.MAX_LR)
    for lr in (0.0, 1.0001, 1e30, float("nan")):
        with pytest.raises(ValueError, match="--lr must be a learning rate above 0 and at most 1"):
            reads.check_training_numbers(lr=lr)


def test_a_student_named_twice_is_refused_however_it_is_spelled():
    assert reads.parse_students("a.pt,b.pt", teacher="t.pt") == ["a.pt", "b.pt"]
    with pytest.raises(ValueError, match="--students names a.pt twice; name each student once"):
        reads.parse_students("a.pt,a.pt", teacher="t.pt")
    with pytest.raises(ValueError, match=r"--students names a.pt twice \(a.pt and sub/../a.pt\)"):
        reads.parse_students("a.pt,sub/../a.pt", teacher="t.pt")


def test_a_log_dir_is_a_folder_of_its_own(tmp_path):
    reads.check_log_dir(str(tmp_path / "run_logs"), checkpoint=str(tmp_path / "run.pt"), flag="--model_path")
    with pytest.raises(ValueError, match="--log_dir .*run.pt and --model_path .*run.pt name the same path"):
        reads.check_log_dir(str(tmp_path / "run.pt"), checkpoint=str(tmp_path / "run.pt"), flag="--model_path")
