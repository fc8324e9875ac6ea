"""cli/checks.py: single flag values, checked while a request is built (a ValueError naming the flag)."""

import pytest

from ddpm.cli import checks


def test_lists_parse_and_bad_items_are_named():
    assert checks.parse_list("ddpm,ddim", kind=str, flag="--sampler", choices=("ddpm", "ddim")) == ["ddpm", "ddim"]
    assert checks.parse_list("5,10", kind=int, flag="--sampling_steps") == [5, 10]
    assert checks.parse_list(None, kind=int, flag="--sampling_steps") == [None]
    with pytest.raises(ValueError, match="--sampling_steps"):
        checks.parse_list("5,x", kind=int, flag="--sampling_steps")


def test_counts_and_steps_name_the_flag():
    checks.check_positive(n_samples=1, batch_size=None)  # None: the flag was left out
    with pytest.raises(ValueError, match="--n_samples must be a positive integer, got 0"):
        checks.check_positive(n_samples=0)
    with pytest.raises(ValueError, match="--warmup_steps"):
        checks.check_not_negative(warmup_steps=-1)
