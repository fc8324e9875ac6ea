"""The files a U-Net lives in, told apart by their ending: checkpoint (.pt), TorchScript (.ts), ONNX
(.onnx) and TensorRT engine (.engine/.plan).

    artifact_kind("checkpoints/mnist.onnx")   # -> "onnx"

Loading them is backends/artifacts.py's; the implementation registry (backends/registry.py) says
which implementation runs which kind.
"""

from __future__ import annotations

from pathlib import Path

FORMATS = ("onnx", "torchscript", "tensorrt")
FORMAT_SUFFIXES = {"onnx": (".onnx",), "torchscript": (".ts",), "tensorrt": (".engine", ".plan")}
ARTIFACT_KINDS = {
    ".pt": "checkpoint",
    ".ts": "torchscript",
    ".onnx": "onnx",
    ".engine": "tensorrt",
    ".plan": "tensorrt",
}
KIND_NAMES = {"checkpoint": "checkpoint", "torchscript": "TorchScript", "onnx": "ONNX", "tensorrt": "TensorRT engine"}


def artifact_kind(path: str | Path) -> str:
    kind = ARTIFACT_KINDS.get(Path(path).suffix)
    if kind is None:
        raise ValueError(f"--model_path {path}: expected a file ending in {', '.join(ARTIFACT_KINDS)}")
    return kind


def default_output(source: str | Path, fmt: str) -> Path:
    """Where an export goes by default: beside its checkpoint, with the format's suffix."""
    return Path(source).with_suffix(FORMAT_SUFFIXES[fmt][0])
