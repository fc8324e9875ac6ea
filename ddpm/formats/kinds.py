"""The files a U-Net lives in, told apart by their ending: checkpoint (.pt), TorchScript (.ts), ONNX
(.onnx) and TensorRT engine (.engine/.plan).

    artifact_kind("checkpoints/mnist.onnx")   # -> "onnx"

Loading them is backends/artifacts.py's; the implementation registry (backends/registry.py) says
which implementation runs which kind.
"""

from __future__ import annotations

from pathlib import Path

from ddpm.util.precision import QUANTIZED

# "diffusers" writes a folder (formats/diffusers_io.py): no suffix.
FORMAT_SUFFIXES = {
    "onnx": (".onnx",),
    "torchscript": (".ts",),
    "tensorrt": (".engine", ".plan"),
    "safetensors": (".safetensors",),
    "diffusers": ("",),
}
# Weights a PyTorch U-Net is rebuilt from are all "checkpoint"s to the implementations: a .pt checkpoint, a
# safetensors export, and a diffusers model folder (any folder; formats/diffusers_io.py says if it is not one).
ARTIFACT_KINDS = {
    ".pt": "checkpoint",
    ".safetensors": "checkpoint",
    ".ts": "torchscript",
    ".onnx": "onnx",
    ".engine": "tensorrt",
    ".plan": "tensorrt",
}
KIND_NAMES = {"checkpoint": "checkpoint", "torchscript": "TorchScript", "onnx": "ONNX", "tensorrt": "TensorRT engine"}
KIND_ARTICLES = {"torchscript": "a TorchScript program", "onnx": "an ONNX graph", "tensorrt": "a TensorRT engine"}


def artifact_kind(path: str | Path, *, flag: str = "--model_path") -> str:
    """The kind of model file ``path`` names, by its name alone (a folder: a diffusers model); a name of no kind is
    refused naming ``flag``, the flag that gave it."""
    if Path(path).is_dir():
        return "checkpoint"  # a diffusers model folder
    kind = ARTIFACT_KINDS.get(Path(path).suffix)
    if kind is None:
        raise ValueError(
            f"{flag} {path}: expected a diffusers model folder or a file ending in {', '.join(ARTIFACT_KINDS)}"
        )
    return kind


def default_output(source: str | Path, fmt: str, *, precision: str = "fp32") -> Path:
    """Where an export goes by default: beside its checkpoint, with the format's suffix (a diffusers
    folder: ``<stem>_diffusers``; a quantized graph: ``<stem>_int8.onnx``)."""
    source = Path(source)
    stem = source.stem if source.suffix else source.name
    if fmt == "diffusers":
        return source.with_name(f"{stem}_diffusers")
    if precision in QUANTIZED:
        return source.with_name(f"{stem}_{precision}{FORMAT_SUFFIXES[fmt][0]}")
    return source.with_suffix(FORMAT_SUFFIXES[fmt][0])
