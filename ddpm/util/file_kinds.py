"""What kind of file a path holds, told by its ending and by its first bytes, so that no output replaces a
file it was not made for.

    expected_kind("bench.json")          # -> "json" (by the ending)
    found_kind("t.pt")                   # -> "checkpoint" (by the content: a torch zip with data.pkl)
    check_kind("--json", "t.pt", kind="json")   # ValueError: --json needs a file name ending in .json, got t.pt
    check_resumable("--model_path", "grid.pt")  # ValueError: --model_path grid.pt is not a checkpoint (it holds ...)

Every output of every mode has a kind (ddpm/outputs.py has the table); util/safe_files.check_outputs calls
:func:`check_kind` for each: the name must end as its kind's files do, and an existing file must already hold
that kind (or be empty) to be replaced. The sniffers read at most :data:`HEAD_BYTES` bytes (and a zip's
directory), so checking an output never reads a whole checkpoint.
"""

from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

HEAD_BYTES = 4096


@dataclass(frozen=True)
class FileKind:
    name: str  # said in messages: "a PNG image"
    suffixes: tuple[str, ...]  # the first is the one suggested


# The kinds this tool writes. A "text" file (no NUL bytes) is what a CSV is found as; "zip" is a zip archive of
# none of the kinds below; "broken_zip" a zip cut short or damaged; "binary" a file of no kind recognized here.
KINDS = {
    "json": FileKind("a JSON file", (".json",)),
    "csv": FileKind("a CSV table", (".csv",)),
    "png": FileKind("a PNG image", (".png",)),
    "npz": FileKind("a NumPy .npz archive", (".npz",)),
    "checkpoint": FileKind("a PyTorch checkpoint", (".pt",)),
    "torchscript": FileKind("a TorchScript program", (".ts",)),
    "onnx": FileKind("an ONNX graph", (".onnx",)),
    "tensorrt": FileKind("a TensorRT engine", (".engine", ".plan")),
    "safetensors": FileKind("a safetensors file", (".safetensors",)),
}
FOUND_NAMES = {
    "text": "a text file",
    "zip": "a zip archive",
    "broken_zip": "a truncated or corrupt zip archive (a checkpoint cut short?)",
    "binary": "a binary file",
}


def expected_kind(path: str | os.PathLike) -> str | None:
    """The kind a file of this name is expected to hold (by its ending, any case), or None for other endings."""
    suffix = Path(path).suffix.lower()
    return next((kind for kind, spec in KINDS.items() if suffix in spec.suffixes), None)


def _zip_kind(path: Path) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return "broken_zip"  # a zip's first bytes without its directory: cut short (a checkpoint's copy) or damaged
    if names and all(name.endswith(".npy") for name in names):
        return "npz"
    if any("/code/" in name for name in names):
        return "torchscript"
    if any(name.endswith("data.pkl") for name in names):
        return "checkpoint"
    return "zip"


def found_kind(path: str | os.PathLike) -> str | None:
    """What an existing regular file holds, from its first bytes: one of :data:`KINDS`, or "text", "zip",
    "broken_zip", "binary"; None for an empty file (nothing to lose)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if not head:
        return None
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _zip_kind(path)
    if head[:1] == b"\x80":  # a pickle (protocol 2+): torch.save's legacy format
        return "checkpoint"
    if len(head) >= 9 and head[8:9] == b"{":  # safetensors: a u64 header length, then the JSON header
        (length,) = struct.unpack("<Q", head[:8])
        if 0 < length < os.stat(path).st_size:
            return "safetensors"
    if head[:1] == b"\x08":  # a protobuf whose first field is 1 (varint): ModelProto.ir_version
        return "onnx"
    if b"\0" not in head:
        text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
        return "json" if text[:1] in (b"{", b"[") else "text"
    return "binary"


def _fits(found: str, kind: str) -> bool:
    """Whether a file found to be ``found`` may be replaced by a new file of ``kind``."""
    if found == kind:
        return True
    if kind == "csv":
        return found == "text"  # a CSV is text; JSON, though text too, is another kind
    if kind == "tensorrt":
        return found == "binary"  # engines have no magic bytes of their own
    return False


def check_kind(flag: str, raw: str | os.PathLike, *, kind: str | None, target: Path | None = None) -> None:
    """Refuse an output whose name does not end as ``kind``'s files do, or an existing file (``target``: the
    resolved path) holding another kind. ``kind`` None: the kind the name's ending says, if any."""
    if kind is not None:
        suffixes = KINDS[kind].suffixes
        if Path(raw).suffix.lower() not in suffixes:
            endings = " or ".join(suffixes)
            raise ValueError(f"{flag} writes {KINDS[kind].name} and needs a file name ending in {endings}, got {raw}")
    kind = kind or expected_kind(raw)
    target = Path(raw) if target is None else target
    if kind is None or not target.is_file():
        return
    try:
        found = found_kind(target)
    except OSError as exc:
        raise ValueError(f"{flag} {raw}: cannot inspect it ({exc.strerror})") from exc
    if found is not None and not _fits(found, kind):
        what = KINDS[found].name if found in KINDS else FOUND_NAMES[found]
        raise ValueError(
            f"{flag} {raw} already holds {what}, not {KINDS[kind].name}; it would be destroyed, choose another path"
        )


def check_resumable(flag: str, raw: str | os.PathLike) -> None:
    """Refuse a file that ``--resume`` would continue when it holds no checkpoint, naming what it holds: the run reads
    it first, so it is no output about to be destroyed (what :func:`check_kind` would say). A missing file is left to
    the loader, which names it."""
    target = Path(raw)
    if not target.is_file():
        return
    try:
        found = found_kind(target)
    except OSError as exc:
        raise ValueError(f"{flag} {raw}: cannot inspect it ({exc.strerror})") from exc
    if found != "checkpoint":
        what = "is empty" if found is None else f"holds {KINDS[found].name if found in KINDS else FOUND_NAMES[found]}"
        raise ValueError(f"{flag} {raw} is not a checkpoint (it {what}); --resume continues one")
