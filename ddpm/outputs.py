"""Every file each mode writes, by flag (or by what it is, for files no flag names), and the kind of file it is.

    check_mode_outputs("benchmark", {"--json": "t.pt"}, inputs={})   # ValueError: --json writes a JSON file ...

One table, read by every check of a mode's outputs (cli/resolve.py before any work, the modes again once the
model file has named its own inputs): util/safe_files.check_outputs refuses an output whose name does not end
as its kind's files do (safe_files.check_kind) or that already holds a file of another kind. Folders (--log_dir,
--profile, a diffusers export) are checked as folders where they are written; the previews' folder, derived from
the checkpoint's name, with the checkpoint (:func:`check_previews_folder`), before anything is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ddpm.util.safe_files import Input, InputFolder, PathLike, check_outputs, resolved

PREVIEW = "the training preview"  # <checkpoint stem>_samples/step_NNNNNNN.png
CURVES = "--log_dir's metrics.csv"
RECONSTRUCTIONS = "the reconstructions PNG"
FIRST_STAGE = "--model_path's autoencoder"  # the digits recipe's latent model: <stem>_autoencoder.pt, trained first
EXPORT_METADATA = "--output's metadata"  # beside a TensorRT engine
EXPORT_DECODER = "--output's decoder"  # beside a latent model's export

# mode -> output -> kind. Export's --output and its decoder are of the kind --format writes (EXPORT_KINDS).
OUTPUTS: dict[str, dict[str, str]] = {
    "train": {
        "--model_path": "checkpoint",
        PREVIEW: "png",
        CURVES: "csv",
        FIRST_STAGE: "checkpoint",
        RECONSTRUCTIONS: "png",
    },
    "distill": {"--output": "checkpoint", PREVIEW: "png", CURVES: "csv"},
    "train_autoencoder": {"--model_path": "checkpoint", RECONSTRUCTIONS: "png"},
    "sample": {"--output": "png", "--save_npz": "npz"},
    "evaluate": {"--json": "json", "--chart": "png"},
    "benchmark": {"--json": "json", "--csv": "csv", "--chart": "png"},
    "export": {"--output": "by --format", EXPORT_METADATA: "json", EXPORT_DECODER: "by --format"},
}
# --format -> the kind of file it writes (diffusers: a folder, checked file by file as it is written).
EXPORT_KINDS = {"onnx": "onnx", "torchscript": "torchscript", "tensorrt": "tensorrt", "safetensors": "safetensors"}
# A latent model's decoder beside its export: of the same kind (ONNX beside ONNX, an engine beside an engine).
DECODER_KINDS = {"onnx": "onnx", "torchscript": "torchscript", "tensorrt": "tensorrt"}


def kinds_of(mode: str, *, fmt: str | None = None) -> dict[str, str]:
    """``mode``'s outputs and their kinds (export's for ``fmt``)."""
    table = dict(OUTPUTS[mode])
    if mode == "export":
        table = {
            "--output": EXPORT_KINDS.get(fmt),
            EXPORT_METADATA: "json",
            EXPORT_DECODER: DECODER_KINDS.get(fmt),
        }
    return {flag: kind for flag, kind in table.items() if kind is not None}


def check_mode_outputs(
    mode: str,
    outputs: Mapping[str, PathLike | None],
    *,
    inputs: Mapping[str, Input | None] | None = None,
    fmt: str | None = None,
):
    """util/safe_files.check_outputs of ``outputs``, each held to its kind in ``mode``'s table; a training run's
    checkpoint with the previews' folder derived from it (:func:`check_previews_folder`)."""
    unknown = set(outputs) - set(OUTPUTS[mode])
    if unknown:  # a programming error: every output of a mode is in its table
        raise KeyError(f"{sorted(unknown)} not in the outputs of --mode {mode} (ddpm/outputs.py)")
    checked = check_outputs(outputs, inputs=inputs, kinds=kinds_of(mode, fmt=fmt))
    if PREVIEW in OUTPUTS[mode]:
        for flag, path in outputs.items():
            if path is not None and OUTPUTS[mode][flag] == "checkpoint" and flag != FIRST_STAGE:  # it has none
                check_previews_folder(path, flag=flag, inputs=inputs or {})
    return checked


def reconstructions_path(checkpoint: str | Path) -> str:
    """The PNG beside a checkpoint: ``<stem>_reconstructions.png``."""
    path = Path(checkpoint)
    return str(path.with_name(f"{path.stem}_reconstructions.png"))


def previews_folder(checkpoint: PathLike) -> Path:
    """Where a training run's preview grids go: ``checkpoints/mnist.pt`` -> ``checkpoints/mnist_samples``."""
    path = Path(checkpoint)
    return path.with_name(f"{path.stem}_samples")


def check_previews_folder(checkpoint: PathLike, *, flag: str, inputs: Mapping[str, Input | None]) -> Path:
    """The previews' folder of a run writing ``checkpoint`` (named by ``flag``), a derived output checked with the
    named ones, before any data or model is read: refused in one line when it is a file, an input, or inside a
    folder an input names (a --data_dir, a diffusers model: a preview would join the data, or the model's files).
    Its existing preview files are checked again once the run's length is known (modes/train.check_previews)."""
    folder = previews_folder(checkpoint)
    where = f"the training previews of {flag} {checkpoint} go into {folder}"
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{where}, which is a file; move it, or choose another {flag}")
    target = resolved(folder)
    for in_flag, item in inputs.items():
        if item is None:
            continue
        root = resolved(item.root if isinstance(item, InputFolder) else item)
        if target == root or (isinstance(item, InputFolder) and target.is_relative_to(root)):
            raise ValueError(
                f"{where}, inside the folder {in_flag} reads; an input is never written: choose another {flag}"
            )
    return folder
