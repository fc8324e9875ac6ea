"""Checks of single flag values that several requests share: positive counts, non-negative steps, file
suffixes, comma-separated lists, the --profile folder. Each failure is a ValueError naming the flag
(main.py prints it in one line, exit code 2); cli/resolve.py calls them while it builds a request.
Below them, the argparse types that check a value's form while parsing (a finite number, a seed in
range, names from a list), which cli/flags.py gives its flags."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")


def check_at_most(limit: int, why: str, **values: int | None) -> None:
    """Counts a run could never finish: refused in one line, naming the limit and why it is there."""
    for name, value in values.items():
        if value is not None and value > limit:
            raise ValueError(f"--{name} must be at most {limit:,} ({why}), got {value:,}")


def check_not_negative(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 0:
            raise ValueError(f"--{name} must be 0 or more, got {value}")


def check_suffix(flag: str, path: str | None, suffix: str) -> None:
    """A file name's ending; a folder is left to safe_files.check_outputs, which says so."""
    if path is not None and Path(path).suffix.lower() != suffix and not Path(path).is_dir():
        raise ValueError(f"{flag} needs a file name ending in {suffix}, got {path}")


def parse_list(text: str | int | None, *, kind: Callable, flag: str, choices: Sequence | None = None) -> list:
    """ "ddpm,ddim" -> ["ddpm", "ddim"]; "5,10" -> [5, 10]; one line naming ``flag`` on a bad item."""
    if text is None:
        return [None]
    if isinstance(text, int):
        return [text]
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ValueError(f"{flag} is empty")
    try:
        values = [kind(item) for item in items]
    except ValueError:
        raise ValueError(f"{flag} takes a comma-separated list, got {text!r}") from None
    if choices is not None and any(v not in choices for v in values):
        raise ValueError(
            f"{flag}: {', '.join(str(v) for v in values if v not in choices)} not one of {', '.join(choices)}"
        )
    return values


def check_profile_dir(profile: str | None) -> None:
    """--profile DIR: a folder (made if missing), never a file (the modes that read it: cli/flags.py)."""
    if profile is None:
        return
    if Path(profile).exists() and not Path(profile).is_dir():
        raise ValueError(f"--profile {profile} is a file; it names the folder the traces go into")
    existing = Path(profile).absolute()
    while not existing.exists():  # the folder, or the nearest one that exists (the rest is made)
        existing = existing.parent
    try:  # a probe, as for every output: modes, read-only file systems and /proc all answer it
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".profile-probe-")
    except OSError as exc:
        raise ValueError(f"--profile {profile}: cannot write into {existing} ({exc.strerror})") from exc
    os.close(fd)
    os.unlink(probe)


# ----- argparse types: a value's form, checked while parsing -----------------------------------------
SEED_MAX = 2**63 - 1


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def name_list(choices):
    """An argparse type: one name from ``choices``, or a comma-separated list of them (kept as text)."""

    def parse(text: str) -> str:
        names = [n.strip() for n in text.split(",")]
        if not all(names) or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), got {text!r}")
        return ",".join(names)

    return parse


def int_list(text: str) -> str:
    """An argparse type: an integer, or a comma-separated list of them (kept as text; the request checks
    that each is positive)."""
    items = [n.strip() for n in text.split(",")]
    try:
        [int(n) for n in items]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer or a comma-separated list of them, got {text!r}"
        ) from None
    return ",".join(items)


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**63 - 1, got {text}")
    return value
