"""Checkpoints, atomic file writes, and the small file/error helpers the other modules share.

A checkpoint is one file holding everything a run needs: the model and schedule configs, the
model and EMA weights, the optimizer, LR schedule and grad-scaler states, the step and the RNG
states. It is written atomically (a temporary file in the same folder, flushed and fsynced, then
renamed over the target), so a crash never leaves a half-written checkpoint, and it is read with
``torch.load(weights_only=True)``, so loading one never runs code from it.
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "model_config", "schedule_config", "model", "ema", "step")


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write a file through ``write(f)`` so that ``path`` holds either the old or the whole new file."""
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual mode instead
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def check_output_file(path: str | Path) -> Path:
    """An output path must name a file, not a folder; call it before the work that produces the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"output path {path} is a folder; give a file name")
    return path


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it is to set it
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Atomically write ``state`` (see :data:`REQUIRED_KEYS`) to ``path``."""
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise KeyError(f"checkpoint state lacks {missing}")  # a programming error, not a user one
    return atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu") -> dict:
    """Read a checkpoint this tool wrote; anything else is refused with a ValueError."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist (train one with --mode train, or pass --model_path)")
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is not a file")
    try:
        with open(path, "rb") as f:
            state = torch.load(io.BytesIO(f.read()), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" not in str(exc).lower():  # not a forbidden class or function: just broken bytes
            raise ValueError(f"checkpoint {path} is corrupt or not a PyTorch file ({first_line(exc)})") from exc
        raise ValueError(
            f"checkpoint {path} holds objects beyond tensors and plain data, so it is refused "
            "(it was not written by this tool, and loading it could run code)"
        ) from exc
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ValueError(f"checkpoint {path} is corrupt or not a PyTorch file ({first_line(exc)})") from exc
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        raise ValueError(f"{path} is not a checkpoint written by this tool (missing model, EMA or config)")
    if state["format_version"] != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {state['format_version']}; this tool reads {FORMAT_VERSION}")
    return state


def first_line(exc: BaseException) -> str:
    """The first non-blank line of an exception's message (its type name if there is none)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
