"""safetensors files: weights without pickle, read within limits (formats/diffusers_io.py's folders use it too).

    python main.py --mode export --format safetensors --model_path checkpoints/digits.pt   # -> digits.safetensors
    python main.py --mode sample --model_path checkpoints/digits.safetensors

A ``--format safetensors`` export holds the U-Net's weights under this tool's names and, in the file's
string metadata under ``"ddpm"``, the JSON an ONNX export carries (unet_io.artifact_metadata: configs,
which weights, class names); formats/checkpoints.py reads it back as a checkpoint's state. The
``safetensors`` package is imported only when such a file is read or written.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ddpm.util.messages import first_line
from ddpm.util.safe_files import atomic_write, parse_json, read_limited

INSTALL_HINT = "pip install safetensors"
MAX_HEADER_BYTES = 16 << 20  # a 35.7M-parameter U-Net's header is ~40 KB
METADATA_KEY = "ddpm"  # the entry of the file's metadata holding this tool's JSON


def import_safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ValueError(f"safetensors files need the safetensors package: {INSTALL_HINT}") from exc
    return safetensors.torch


def read_safetensors(
    path: Path, *, source: str, inside: Path | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the string metadata of a safetensors file, read within the checkpoint size limit (and,
    for a model folder's file, only from ``inside`` it); a truncated, lying or hostile file is one ValueError
    naming ``source``, never quoting its bytes."""
    st = import_safetensors()
    data = read_limited(path, kind="checkpoint", inside=inside)
    if len(data) < 8:
        raise ValueError(f"{source} is not a safetensors file (too short)")
    (header_len,) = struct.unpack(
        "<Q", data[:8]
    )  # the format: a little-endian u64 header size, the JSON header, the data
    if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"{source} is not a safetensors file (its header's length does not fit the file)")
    header = parse_json(data[8 : 8 + header_len], source=source, max_bytes=MAX_HEADER_BYTES)
    if not isinstance(header, dict):
        raise ValueError(f"{source} is not a safetensors file (its header is not a JSON object)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{source}: its safetensors metadata is not a map of strings")
    try:
        tensors = st.load(data)  # checks every tensor's dtype, shape and byte range against the data
    except Exception as exc:  # noqa: BLE001 -- SafetensorError and whatever else junk provokes: one line
        raise ValueError(f"{source} is not a readable safetensors file ({first_line(exc)})") from exc
    return tensors, metadata


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    st = import_safetensors()
    return st.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=dict(metadata))


def write_safetensors(model: nn.Module, output: Path, *, metadata: dict) -> Path:
    """The U-Net's weights with this tool's metadata (unet_io.artifact_metadata) as JSON under "ddpm", atomically."""
    data = safetensors_bytes(model.state_dict(), {METADATA_KEY: json.dumps(metadata), "format": "pt"})
    return atomic_write(output, lambda f: f.write(data))
