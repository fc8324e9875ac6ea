"""PyTorch files read safely: the one ``torch.load`` of this tool, and strict weight loading.

Checkpoints (formats/checkpoints.py) and autoencoders (latent/autoencoder.py) are both read here,
from bytes their callers read within a size limit (safe_files.read_limited):

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

import torch
from torch import nn

from ddpm.util.messages import clipped, first_line
from noise_schedule import short_repr


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
