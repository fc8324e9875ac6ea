"""Folders a mode writes as a whole (a diffusers export): checked before any work, recognised by the marker the
export writes last (the sha256 of each file it wrote, so another tool's model under the same names is never
replaced), and replaced file by file through a new folder beside them, so a failure leaves the old export whole.

    replace = check_folder_output("--output", out, writes=names, writer="--format diffusers", inputs=..., overwrite=...)
    with replaced_files(out, names) as new:   # write every name into ``new``; the marker (last name) last
        ...
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from ddpm.util import messages
from ddpm.util.messages import first_line, printable
from ddpm.util.safe_files import (
    Input,
    InputFolder,
    PathLike,
    WriteError,
    _fsync_dir,
    atomic_write,
    missing_folders,
    parse_json,
    read_limited,
    remove_created,
    remove_stale_temporaries,
    resolved,
    sibling_temporary,
    write_error,
    write_failure,
)


def check_folder_output(
    flag: str,
    folder: PathLike,
    *,
    writes: Sequence[str],
    writer: str,
    inputs: Mapping[str, Input | None],
    overwrite: bool,
) -> bool:
    """A folder a mode writes as a whole (a model folder: ``writes``, its files' paths inside it, the folder's marker
    last), checked before any work. Refused in one line naming ``flag``: a path that is a file; the working folder
    or one that holds it; an input, a folder holding one or lying inside an input folder; a folder holding anything
    but ``writes`` and their folders (the user's files: never merged into, never removed); a folder holding an earlier
    export, unless ``overwrite``. Returns whether it holds files of an earlier export (replaced by
    :func:`replaced_files`, which touches nothing else)."""
    raw = os.fspath(folder)
    if not raw:
        raise ValueError(f"{flag} is an empty path; give a folder name")
    target = resolved(raw)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {raw} is a file; {writer} writes a folder")
    if resolved(os.getcwd()).is_relative_to(target):
        what = "is the working folder" if resolved(os.getcwd()) == target else "holds the working folder"
        raise ValueError(f"{flag} {raw} {what}; {writer} writes a folder of its own: name a new one")
    for in_flag, item in inputs.items():
        if item is None:
            continue
        root = resolved(item.root if isinstance(item, InputFolder) else item)
        if root == target:
            raise ValueError(
                f"{flag} {raw} is the model {in_flag} names; an input is never written: choose another {flag}"
            )
        if root.is_relative_to(target):
            raise ValueError(f"{flag} {raw} holds {in_flag}, an input, never written: choose another {flag}")
        if isinstance(item, InputFolder) and target.is_relative_to(root):
            raise ValueError(f"{flag} {raw} is inside the folder {in_flag} reads, never written: choose another {flag}")
    try:
        foreign = _foreign_entries(target, writes=writes)
    except OSError as exc:
        raise ValueError(f"{flag} {raw}: cannot list what it holds ({exc.strerror or first_line(exc)})") from exc
    if foreign:
        more = f" and {len(foreign) - 1}{'+' if len(foreign) == FOREIGN_SHOWN else ''} more" if len(foreign) > 1 else ""
        raise ValueError(
            f"{flag} {raw} holds {printable(foreign[0])}{more}, which {writer} does not write; it writes a new folder "
            f"or replaces its own earlier export, never touching other files: choose another {flag}"
        )
    earlier = [name for name in writes if (target / name).is_file()]
    unrecognised = _unrecognised(target, writes=writes) if earlier else None
    if unrecognised is not None:
        raise ValueError(
            f"{flag} {raw} holds {printable(unrecognised)}, which {writer} did not write (its {writes[-1]} does not "
            f"record it): another tool's model is never replaced, even with --overwrite; choose another {flag}"
        )
    if earlier and not overwrite:
        raise ValueError(
            f"{flag} {raw} already holds an export ({earlier[0]}); pass --overwrite to replace its files, or choose "
            f"another {flag}"
        )
    return bool(earlier)


def file_sha256(path: PathLike) -> str:
    """The sha256 of a file, read in chunks (a model's weights)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def marker_bytes(folder: Path, names: Sequence[str], *, writer: str) -> bytes:
    """The marker of a folder export (the last of its names): the sha256 of every other file it wrote into
    ``folder``, so a later export recognises its own files by what they hold, never by their names (another tool
    saves a model under the same names)."""
    files = {name: [file_sha256(folder / name)] for name in names[:-1] if (folder / name).is_file()}
    return (json.dumps({"written_by": writer, "files": files}, indent=2, sort_keys=True) + "\n").encode()


def _recorded(marker: Path) -> dict[str, list[str]] | None:
    """What a folder's marker records, {name: [sha256, ...]}; None where it is missing or not one."""
    try:
        value = parse_json(read_limited(marker, kind="metadata"), source=marker)
    except (OSError, ValueError):
        return None
    files = value.get("files") if isinstance(value, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(hashes, list) and all(isinstance(h, str) for h in hashes) for hashes in files.values()
    ):
        return None
    return files


def _unrecognised(target: Path, *, writes: Sequence[str]) -> str | None:
    """The first of ``writes`` present in ``target`` that its marker (``writes[-1]``) does not record with the
    sha256 it holds now (every one, without a marker); None when all of them are the writer's own."""
    present = [name for name in writes[:-1] if (target / name).is_file()]
    recorded = _recorded(target / writes[-1])
    if recorded is None:
        return present[0] if present else writes[-1]
    try:
        return next((name for name in present if file_sha256(target / name) not in recorded.get(name, [])), None)
    except OSError:
        return present[0]


FOREIGN_SHOWN = 100  # the other entries of a folder output counted, at most (a home folder holds thousands)


def _foreign_entries(target: Path, *, writes: Sequence[str]) -> list[str]:
    """What ``target`` holds besides ``writes`` (regular files, never links), their folders and the writer's
    temporaries, as paths inside it (at most :data:`FOREIGN_SHOWN`; only the writer's own folders are walked)."""
    files = set(writes)
    folders = {str(parent) for name in writes for parent in Path(name).parents if str(parent) != "."}
    foreign: list[str] = []
    pending = [""]
    while pending and len(foreign) < FOREIGN_SHOWN:
        inside = pending.pop()
        try:
            entries = sorted(os.scandir(target / inside), key=lambda e: e.name)
        except FileNotFoundError:
            continue
        for entry in entries:
            name = f"{inside}/{entry.name}" if inside else entry.name
            if name in folders and entry.is_dir(follow_symlinks=False):
                pending.append(name)
            elif not (name in files and entry.is_file(follow_symlinks=False)) and not _is_temporary(name, files):
                foreign.append(name)
    return foreign[:FOREIGN_SHOWN]


def _is_temporary(name: str, files: set[str]) -> bool:
    """Whether ``name`` is an atomic write's temporary of one of ``files`` (``.<file>.tmp-<pid>-...``)."""
    head, _, base = name.rpartition("/")
    return any(base.startswith(f".{Path(file).name}.tmp-") and Path(file).parent == Path(head or ".") for file in files)


@contextlib.contextmanager
def replaced_files(target: PathLike, names: Sequence[str]) -> Iterator[Path]:
    """A new, empty folder beside ``target`` into which a block writes ``names`` (paths inside ``target``; the last
    is the folder's marker, :func:`marker_bytes`, written last). When the block ends without an exception, a
    ``target`` that does not exist is the new folder, renamed into place (with the folders above it this created);
    else each file replaces its namesake in ``target`` (the marker first records the old files and the new ones, and
    the new marker is put in place last, signals held meanwhile: at every moment the folder's files are recorded),
    and a name the block did not write is removed; nothing else in ``target`` is touched, nor ``target`` itself. On
    an exception the new folder vanishes, with any folder this created, and ``target`` stays as it was."""
    given, target = target, resolved(target)
    existed = target.exists()
    created = missing_folders(target.parent)
    remove_stale_temporaries(target)
    new = sibling_temporary(target)
    shutil.rmtree(new, ignore_errors=True)
    try:
        new.parent.mkdir(parents=True, exist_ok=True)
        new.mkdir()
    except OSError as exc:
        remove_created(created)
        failure = write_failure(exc)
        if failure is None:
            raise
        raise write_error(given, failure, existed=existed, what="folder") from exc
    try:
        yield new
    except BaseException as exc:
        shutil.rmtree(new, ignore_errors=True)
        remove_created(created)
        failure = write_failure(exc.__cause__ if isinstance(exc, WriteError) else exc)  # named the temporary folder
        if failure is None:
            raise
        raise write_error(given, failure, existed=existed, what="folder") from exc
    try:
        with messages.deferred():
            if existed:
                _move_files(new, target, names)
            else:
                os.rename(new, target)  # the whole folder at once: never half of one
                _fsync_dir(target.parent)
    except OSError as exc:
        if not existed:
            remove_created(created)
            raise write_error(given, exc, existed=False, what="folder") from exc
        raise WriteError(
            f"cannot write {given}: {exc.strerror or first_line(exc)}; it holds part of the new export, each file "
            "recorded in its marker: export again with --overwrite"
        ) from exc
    finally:
        shutil.rmtree(new, ignore_errors=True)


def _move_files(new: Path, target: Path, names: Sequence[str]) -> None:
    """``names`` moved from ``new`` into ``target`` (renames in one file system): the old marker (last) first
    records the new files too, so an interrupted move leaves a folder whose files are all recorded."""
    marker = target / names[-1]
    old, fresh = _recorded(marker), _recorded(new / names[-1])
    if old is not None and fresh is not None:
        both = {name: sorted({*old.get(name, []), *fresh.get(name, [])}) for name in {*old, *fresh}}
        data = (json.dumps({"files": both}, indent=2, sort_keys=True) + "\n").encode()
        atomic_write(marker, lambda f: f.write(data))
    else:
        marker.unlink(missing_ok=True)  # read as no export's folder until the new marker is in place
    for name in names:
        source, destination = new / name, target / name
        if source.is_file():
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, destination)
        else:
            destination.unlink(missing_ok=True)
        _fsync_dir(destination.parent)
