"""PyTorch files read safely (the one ``torch.load`` of this tool, strict weight loading), and the kind of model
file a path names (:func:`artifact_kind`: a checkpoint, ONNX, TorchScript, an engine, ...).

Checkpoints (formats/checkpoints.py) and autoencoders (latent/autoencoder.py) are both read here,
from bytes their callers read within a size limit (safe_files.read_limited):

* :func:`check_zip` holds a zip (a checkpoint, a TorchScript file) to its central directory before torch
  inflates anything: a directory of sane size, entries stored or deflated, a bounded inflated total
  (:func:`max_inflated_bytes`), and every entry's CRC-32, so a zip bomb or a flipped bit is refused
  unread, in one line;
* :func:`load_pt` refuses a TorchScript archive (a program) before torch sees it, loads everything
  else with ``weights_only=True`` (so no code from the file runs), and owns every failure: whatever
  torch or the zip and pickle readers raise on junk (``KeyError``, ``IndexError``, ``struct.error``,
  ``UnpicklingError``, ...) becomes one ValueError naming the file;
* :func:`load_weights` loads a state dict strictly, every mismatch with the model in one line.
"""

from __future__ import annotations

import io
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ddpm.choices import QUANTIZED
from ddpm.util.messages import clipped, first_line, format_bytes
from noise_schedule import short_repr

# torch.save and torch.jit.save store tensors uncompressed (only TorchScript's small code files are deflated), so
# a real file's entries inflate to less than the file itself. The bound leaves room for a file re-zipped with
# deflate (weights barely shrink, pickles several times) and for small files whose pickles compress well: what inflates
# beyond it is a zip bomb (one whose data.pkl inflated a thousandfold once took seconds and gigabytes to refuse).
MAX_INFLATION = 4  # inflated total / file size
INFLATION_ALLOWANCE = 16 << 20  # bytes any file may inflate to, whatever its size
MAX_INFLATED_BYTES = 4 << 30  # and never more than the largest checkpoint read at all (safe_files.MAX_FILE_BYTES)
# A checkpoint's directory holds ~100 bytes per tensor (a few thousand tensors); zipfile builds an object per
# entry (several times the entry's bytes), so a directory of millions of empty entries is refused before it is parsed.
MAX_ZIP_DIRECTORY_BYTES = 16 << 20
ZIP_MAGIC = b"PK\x03\x04"  # torch.load's own test of the zip format (anything else is its legacy pickle format)
_CHUNK = 1 << 20


def max_inflated_bytes(file_bytes: int) -> int:
    """The most a zip of ``file_bytes`` may inflate to: :data:`MAX_INFLATION` times its size plus
    :data:`INFLATION_ALLOWANCE`, at most :data:`MAX_INFLATED_BYTES`."""
    return min(MAX_INFLATION * file_bytes + INFLATION_ALLOWANCE, MAX_INFLATED_BYTES)


def check_zip(data: bytes, *, source: str, what: str = "a PyTorch file") -> None:
    """Refuse, in one ValueError naming ``source``, a zip that is not what PyTorch writes, before anything is
    inflated for torch: a central directory over :data:`MAX_ZIP_DIRECTORY_BYTES`, an entry neither stored nor
    deflated (the two methods torch's reader knows), a stored entry whose sizes differ, entries that would inflate
    beyond :func:`max_inflated_bytes` (their sizes come from the directory, and zipfile never inflates an entry
    past its size), or an entry whose bytes fail its CRC-32 (a flipped bit; torch's reader does not check it).
    ``what`` says what the file should be."""
    directory = _directory_bytes(data)
    if directory is not None and directory > MAX_ZIP_DIRECTORY_BYTES:
        raise ValueError(
            f"{source}: its zip directory is {format_bytes(directory)}, over the "
            f"{format_bytes(MAX_ZIP_DIRECTORY_BYTES)} a PyTorch file needs; refusing to read it"
        )
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 -- BadZipFile, a name that is not UTF-8, ...: the file's fault
        raise ValueError(
            f"{source} is corrupt or not {what} (its zip directory cannot be read, as in a copy cut short: "
            f"{_reason(exc).rstrip('.')}.)"
        ) from exc
    with archive:
        entries = archive.infolist()
        _check_entry_sizes(entries, file_bytes=len(data), source=source, what=what)
        for entry in entries:
            try:
                with archive.open(entry) as member:  # zipfile checks the CRC-32 when the entry's end is read
                    while member.read(_CHUNK):
                        pass
            except Exception as exc:  # noqa: BLE001 -- BadZipFile (a bad CRC-32, a bad header), zlib.error, EOFError
                problem = "fails its CRC-32 check" if "CRC" in str(exc) else f"cannot be read ({_reason(exc)})"
                raise ValueError(
                    f"{source} is corrupt or not {what} (its entry {short_repr(entry.filename)} {problem}.)"
                ) from exc


def _reason(exc: BaseException) -> str:
    """What a zip reader's error says, in a few words: zipfile's own message, else the exception's type."""
    return clipped(first_line(exc), limit=120) if isinstance(exc, zipfile.BadZipFile) else type(exc).__name__


def _check_entry_sizes(entries: list[zipfile.ZipInfo], *, file_bytes: int, source: str, what: str) -> None:
    """The sizes and methods :func:`check_zip` holds each entry to, from the directory alone."""
    for entry in entries:
        name = short_repr(entry.filename)
        if entry.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ValueError(
                f"{source} is corrupt or not {what} (its entry {name} uses zip method {entry.compress_type}; "
                "PyTorch's files are stored or deflated)"
            )
        if entry.compress_type == zipfile.ZIP_STORED and entry.compress_size != entry.file_size:
            raise ValueError(f"{source} is corrupt or not {what} (its stored entry {name} has two sizes)")
    inflated, bound = sum(entry.file_size for entry in entries), max_inflated_bytes(file_bytes)
    if inflated > bound:
        raise ValueError(
            f"{source}: its zip entries would inflate to {format_bytes(inflated)} from {format_bytes(file_bytes)}, "
            f"over the {format_bytes(bound)} a PyTorch file of its size can hold (torch stores tensors "
            "uncompressed); refused before inflating it"
        )


def _directory_bytes(data: bytes) -> int | None:
    """The size of a zip's central directory, as its end record says (zip64's where the classic field
    overflows); None without an end record (zipfile then says the file is not a zip)."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - 22 - 0xFFFF))  # the record, then a comment of <= 64 KiB
    if end < 0 or end + 22 > len(data):
        return None
    size = int.from_bytes(data[end + 12 : end + 16], "little")
    record = end - 20 - 56  # zip64: its end record (56 bytes) and locator (20) precede the classic one
    if size == 0xFFFFFFFF and record >= 0 and data[record : record + 4] == b"PK\x06\x06":
        size = int.from_bytes(data[record + 40 : record + 48], "little")
    return size


def is_torchscript_archive(data: bytes) -> bool:
    """Whether ``data`` is a TorchScript zip (it has ``constants.pkl``, as torch.load's own test)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return any(name.split("/", 1)[-1] == "constants.pkl" for name in archive.namelist())
    except Exception:  # noqa: BLE001 -- not a readable zip (the legacy format, or junk): not an archive
        return False


def load_pt(data: bytes, *, source: str, kind: str, program_hint: str = "") -> object:
    """What ``torch.load(weights_only=True)`` reads from ``data``, or one ValueError naming ``source``.

    A TorchScript archive is refused unread: it is not ``kind`` (``program_hint`` says what to do instead); objects
    beyond tensors and plain data are refused (loading them could run code); anything torch cannot
    read is "corrupt or not a PyTorch file", whatever exception the readers raised on it.
    """
    if data[:4] == ZIP_MAGIC:
        check_zip(data, source=source)
    if is_torchscript_archive(data):
        raise ValueError(f"{source} is a TorchScript archive (a program), not {kind}, and was not loaded{program_hint}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on odd files: a failure is reported below, in one line
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- junk makes the readers raise anything (KeyError, struct.error, ...)
        text = str(exc)
        if isinstance(exc, pickle.UnpicklingError) and "global" in text.lower():
            raise ValueError(
                f"{source} holds objects beyond tensors and plain data, so it is refused "
                "(it was not written by this tool, and loading it could run code)"
            ) from exc
        # torch's own advice on weights-only failures (retry without weights_only) is the one thing not to do.
        # KeyError('x'), struct.error and the like say nothing a user can act on: only the readers' own words are kept.
        readable = isinstance(
            exc, (RuntimeError, ValueError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile)
        )
        reason = f" ({clipped(first_line(exc))})" if readable and text and "weights_only" not in text else ""
        raise ValueError(f"{source} is corrupt or not a PyTorch file{reason}") from exc


def check_dense(tensors: object, *, source: str) -> None:
    """Refuse in one line naming ``source`` a tensor of ``tensors`` (a dict read from a file) that is not dense,
    strided and on the CPU: a sparse, meta or nested tensor cannot be checked for NaN or loaded into a U-Net."""
    for name, tensor in tensors.items() if isinstance(tensors, Mapping) else ():
        if isinstance(tensor, torch.Tensor) and (tensor.layout != torch.strided or tensor.device.type != "cpu"):
            raise ValueError(
                f"{source}: {short_repr(name)} is a {str(tensor.layout).removeprefix('torch.')} tensor on "
                f"{tensor.device.type}; only dense CPU tensors are read"
            )


def load_weights(model: nn.Module, state_dict: object, *, source: str, assign: bool = False) -> None:
    """Load ``state_dict`` into ``model`` strictly; any mismatch is one ValueError naming ``source``.

    Every key, shape, dtype and layout must be the model's. ``assign=True`` makes the model hold
    ``state_dict``'s tensors instead of copying them: for a model built on the meta device, so that a
    config read from a file allocates nothing until its weights are known to fit it.
    """
    problems = weight_mismatches(model.state_dict(), state_dict)
    if problems:
        raise ValueError(f"{source}: its weights do not match its model config ({'; '.join(problems)})")
    try:
        model.load_state_dict(state_dict, strict=True, assign=assign)
    except RuntimeError as exc:  # not expected after the checks above; still one line
        raise ValueError(f"{source}: its weights cannot be loaded ({first_line(exc)})") from exc


def weight_mismatches(expected: Mapping[str, torch.Tensor], found: object) -> list[str]:
    """How a loaded state dict differs from a model's (``model.state_dict()``), one phrase per kind."""
    if not isinstance(found, Mapping):
        return [f"they are a {type(found).__name__}, not a dict of tensors"]
    problems = []
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    if missing:
        problems.append(f"{len(missing)} missing, e.g. {short_repr(missing[0])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected, e.g. {short_repr(unexpected[0])}")
    differences = []
    for name, want in expected.items():
        got = found.get(name)
        if got is None:
            continue
        if not isinstance(got, torch.Tensor):
            differences.append(f"{name!r} is a {type(got).__name__}, not a tensor")
        elif got.shape != want.shape:
            differences.append(f"shape of {name!r} is {list(got.shape)} but the config makes {list(want.shape)}")
        elif got.dtype != want.dtype or got.layout != want.layout:
            differences.append(f"{name!r} is {got.dtype} {got.layout}, the model's {want.dtype} {want.layout}")
    if differences:
        more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
        problems.append(differences[0] + more)
    return problems


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
