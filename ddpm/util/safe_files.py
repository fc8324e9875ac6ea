"""Reading and writing files without ever losing a good one: bounded reads, output checks, atomic writes, run locks.

Four rules, applied by every mode before any work starts:

* :func:`read_limited` reads a file only if it is a regular file within :data:`MAX_FILE_BYTES` for its
  kind (checked with ``os.stat`` first), and :func:`parse_json` reads metadata size- and depth-limited.
  A file a model folder holds (or a side file an export names) is read only if :func:`check_inside` finds
  its real path inside that folder: nothing is followed outside it.

* :func:`check_outputs` resolves every output path (following symlinks) and refuses, with the flag
  and the path in one line, an output that is the same file as an input or as another output, an
  existing path that is not a regular file (a folder, a device, a FIFO), a read-only file (its mode
  is respected, even by root), or a folder that cannot be written. An input may be a folder of data
  (:class:`InputFolder`): no output may lie inside it, existing or not, nor be (through a link) a file
  it reads; and an existing file's kind must be the output's (check_kind, below).
* :func:`atomic_write` writes through a temporary file in the target's folder (flushed, fsynced,
  then renamed over the target), so a file holds either its old or its whole new content; signals
  arriving during the write wait until the rename is done. A symlinked output keeps its link: the
  file it points to is replaced. Temporaries are named ``.<name>.tmp-<pid>-<random>``; the next
  check of that output removes those whose process is gone (a killed save). A write the file system
  refuses (a full disk, a read-only or failing one; also torch.save's RuntimeError wrapping it) ends in
  one :class:`WriteError` line naming the output and saying that the previous file is untouched.
  A model folder a mode writes is checked and replaced by util/model_folders.py on the same rules.
* :func:`run_lock` takes an advisory lock beside a checkpoint, so two training runs never write
  into the same file; the lock file goes when the run ends.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ddpm.util import messages
from ddpm.util.messages import first_line, format_bytes

PathLike = str | os.PathLike


def resolved(path: PathLike) -> Path:
    """The absolute path with every symlink followed (the file a write would really change)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def as_typed(raw: PathLike, folder: Path) -> str:
    """``folder`` (a resolved folder on the way to ``raw``'s target) as the user wrote it: the part of ``raw`` that
    resolves to it ("." for the working folder), so a message names no path of the machine the user did not type;
    ``folder`` itself where a symlink took the path elsewhere."""
    return next((str(typed) for typed in Path(os.fspath(raw)).parents if resolved(typed) == folder), str(folder))


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of an existing path, so hard links and bind mounts compare equal."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_target(path: PathLike, *, flag: str = "output") -> Path:
    """Refuse a path that a write must not replace; returns the resolved path. ValueError names ``flag``."""
    raw = os.fspath(path)
    if not raw:
        raise ValueError(f"{flag} is an empty path; give a file name")
    if raw.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):  # resolved() would drop it: "x.png/" -> x.png
        raise ValueError(f"{flag} {raw} ends in a slash, which names a folder; {flag} names a file: drop the slash")
    target = resolved(raw)
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # the folder check below says which part is wrong
        st = None
    except OSError as exc:
        raise ValueError(f"{flag} {raw}: cannot inspect it ({exc.strerror})") from exc
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{flag} {raw} is a folder; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{flag} {raw} is not a regular file (a device, FIFO or socket); refusing to replace it")
        if not st.st_mode & 0o222 or not os.access(target, os.W_OK):
            raise ValueError(
                f"{flag} {raw} is read-only (mode {stat.S_IMODE(st.st_mode):04o}); refusing to replace it "
                "(make it writable, or choose another path)"
            )
    folder = target.parent
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ValueError(f"{flag} {raw}: {as_typed(raw, existing)} is not a folder, so the file cannot be written")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {raw}: the folder {as_typed(raw, existing)} is not writable")
    return target


@dataclass(frozen=True)
class InputFolder:
    """A folder a run reads data from: the files under ``root`` with one of ``suffixes`` (None: all of them)."""

    root: PathLike
    suffixes: tuple[str, ...] | None = None

    def holds(self, target: Path) -> bool:
        """Whether ``target`` (resolved) is inside this folder, existing or not (an input folder is never written
        into: a model folder would load another model, a dataset would read the run's own files, and its readers
        walk every sub-folder), or, elsewhere, an existing file the reader reads (a hard link to one, or what a
        symlink in it names)."""
        root = resolved(self.root)
        if target.is_relative_to(root):
            return True
        if not target.is_file():
            return False
        identity = _identity(target)
        # The readers' own walk (data/datasets.py, data/volumes.py); only for outputs that already exist.
        return any(self.reads(path) and _identity(resolved(path)) == identity for path in root.rglob("*"))

    def reads(self, path: Path) -> bool:
        return self.suffixes is None or path.suffix.lower() in self.suffixes


Input = PathLike | InputFolder


def as_input(path: PathLike | None) -> Input | None:
    """A path a flag names for reading, as an input of :func:`check_outputs`: a folder (a diffusers model)
    as an :class:`InputFolder` of every file in it, anything else as it is."""
    return InputFolder(path) if path and Path(path).is_dir() else path


def check_outputs(
    outputs: Mapping[str, PathLike | None],
    *,
    inputs: Mapping[str, Input | None] | None = None,
    kinds: Mapping[str, str] | None = None,
) -> dict[str, Path]:
    """Check every output before any work (see the module docstring); returns flag -> resolved path.

    ``outputs`` and ``inputs`` map a flag (``"--output"``) or a description (``"its autoencoder"``) to
    its path (an input may be an :class:`InputFolder`); None entries are skipped. ``kinds`` maps an output's
    flag to the kind of file it writes (check_kind; a mode's table is ddpm/requests.py's OUTPUTS): its name must
    end as that kind's do. Whatever the kind (else the one its ending names), an existing file of another kind
    is refused. Stale temporaries of each output (from a killed save) are removed.
    """
    inputs = {flag: path for flag, path in (inputs or {}).items() if path is not None}
    folders = {flag: folder for flag, folder in inputs.items() if isinstance(folder, InputFolder)}
    input_ids = {
        flag: (resolved(path), _identity(resolved(path))) for flag, path in inputs.items() if flag not in folders
    }
    checked: dict[str, Path] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        target = check_target(path, flag=flag)
        target_id = _identity(target)
        for in_flag, (in_path, in_id) in input_ids.items():
            if target == in_path or (target_id is not None and target_id == in_id):
                raise ValueError(
                    f"{flag} {path} is the same file as {in_flag}; it would be destroyed, choose another path"
                )
        for in_flag, folder in folders.items():
            if folder.holds(target):
                where = "inside the folder" if target.is_relative_to(resolved(folder.root)) else "one of the files"
                raise ValueError(
                    f"{flag} {path} is {where} {in_flag} reads; an input is never written, choose another path"
                )
        for out_flag, out_path in checked.items():
            if target == out_path:
                raise ValueError(f"{flag} and {out_flag} both name {path}; one would overwrite the other")
        check_kind(flag, path, kind=(kinds or {}).get(flag), target=target)  # after the others: they say more
        _probe_folder(target, flag=flag, raw=path)
        remove_stale_temporaries(target)
        checked[flag] = target
    return checked


def check_output_folder(flag: str, folder: PathLike | None, *, inputs: Mapping[str, Input | None]) -> None:
    """A folder a run writes into (--profile's traces, --log_dir's curves) never lies inside an input folder."""
    if folder is None:
        return
    target = resolved(folder)
    for in_flag, item in inputs.items():
        if isinstance(item, InputFolder) and target.is_relative_to(resolved(item.root)):
            raise ValueError(f"{flag} {folder} is inside the folder {in_flag} reads; choose another folder")


def _probe_folder(target: Path, *, flag: str, raw: PathLike) -> None:
    """Create and remove a temporary file beside ``target``: catches read-only file systems early."""
    if not target.parent.is_dir():
        return  # created when the file is written; its nearest existing ancestor was checked
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=temp_prefix(target))
    except OSError as exc:
        raise ValueError(f"{flag} {raw}: cannot write in {as_typed(raw, target.parent)} ({exc.strerror})") from exc
    os.close(fd)
    os.unlink(tmp)


def temp_prefix(target: Path) -> str:
    """The name every temporary file of ``target`` starts with; the writer's pid follows it."""
    return f".{target.name}.tmp-{os.getpid()}-"


def remove_stale_temporaries(target: PathLike) -> list[Path]:
    """Remove ``.<name>.tmp-<pid>-*`` files beside ``target`` whose writing process no longer runs."""
    target = resolved(target)
    removed = []
    if not target.parent.is_dir():
        return removed
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        pid = tmp.name[len(f".{target.name}.tmp-") :].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            with contextlib.suppress(OSError):
                if tmp.is_dir() and not tmp.is_symlink():  # a folder export's (model_folders.replaced_files)
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink()
                removed.append(tmp)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def sibling_temporary(target: PathLike) -> Path:
    """A name beside ``target`` for what will replace it (``.<name>.tmp-<pid>-new``); removed as stale once its
    process is gone (:func:`remove_stale_temporaries`)."""
    target = resolved(target)
    return target.with_name(f"{temp_prefix(target)}new")


def remove_created(folders: Sequence[Path]) -> None:
    """The folders a failed write created on the way to its output (nearest first), removed while empty (what
    :func:`missing_folders` listed before the write)."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


class WriteError(OSError):
    """A write the file system refused, in one line: the output as given, why, and that nothing was lost."""


# What a write meets when the file system refuses it: a full disk or quota, a file too large, a read-only or
# failing disk, a permission taken away meanwhile.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM})


def write_failure(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: ``exc`` itself, or the one a library's own error wraps (torch.save raises
    "RuntimeError: [enforce fail at inline_container.cc] ..." with the OSError its writer met as context); None
    for any other error, and for a :class:`WriteError` (already one line)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short chain; never a cycle
        if seen is None or isinstance(seen, WriteError) or not isinstance(seen, (OSError, RuntimeError)):
            return None
        if isinstance(seen, OSError) and seen.errno in WRITE_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


LOW_SPACE_BYTES = 1 << 20  # less room than this, and a write that stopped short without saying why met a full disk


def full_disk(folder: PathLike) -> OSError | None:
    """ENOSPC as an OSError when the file system holding ``folder`` has (almost) no room left (os.statvfs, the room
    this process may use), else None: for a library whose writer stops short without saying why (torch.profiler's
    and onnx's C++ writers leave a missing or cut file), so its failure is named as the full disk it is. Call it
    before removing what the failed write left, which frees the room."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # statvfs is POSIX-only
        return None
    free = st.f_bfree if hasattr(os, "geteuid") and os.geteuid() == 0 else st.f_bavail  # root may use the reserve
    if free * st.f_frsize >= LOW_SPACE_BYTES:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def missing_folders(path: PathLike) -> list[Path]:
    """``path`` and the folders above it that do not exist yet (nearest first): those a write creating ``path`` makes,
    for :func:`remove_created` to remove if it fails."""
    path = Path(path)
    return [folder for folder in (path, *path.parents) if not folder.exists()]


def write_error(path: PathLike, exc: BaseException, *, existed: bool, what: str = "file") -> WriteError:
    """One line for a write to ``path`` (as the user gave it) that failed with ``exc``, saying what is intact."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
    intact = f"the previous {what} is untouched" if existed else f"no {what} was created"
    return WriteError(f"cannot write {path}: {reason}; {intact} and nothing partial was left")


def atomic_write(path: PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Write a file through ``write(f)`` so that ``path`` holds either the old or the whole new file.

    Returns ``path`` as given. Signals arriving meanwhile are held until the file is in place.
    """
    with messages.deferred(), atomic_open(path) as f:
        write(f)
    return Path(path)


@contextlib.contextmanager
def atomic_open(path: PathLike) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` when the block ends without an exception (else it vanishes).

    For writes that span other work (a stream of samples); the final fsync and rename are not cut
    by signals. A write the file system refuses (:func:`write_failure`: a full disk, also through
    torch.save's RuntimeError), and any OSError of the final flush and rename (a vanished folder), end
    in one :class:`WriteError` naming ``path``, not the temporary file, which is removed.
    """
    target = check_target(path)
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=temp_prefix(target))
    except OSError as exc:
        raise write_error(path, exc, existed=existed) from exc
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual mode instead
        with os.fdopen(fd, "wb") as f:
            yield f
            with messages.deferred():
                try:
                    f.flush()
                    os.fsync(f.fileno())
                    os.replace(tmp, target)
                except OSError as exc:
                    raise write_error(path, exc, existed=existed) from exc
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        failure = write_failure(exc)  # the file's own close can fail too, after a failed write (its buffer)
        if failure is None:
            raise
        raise write_error(path, failure, existed=existed) from exc
    _fsync_dir(target.parent)


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


@contextlib.contextmanager
def run_lock(path: PathLike, *, flag: str = "--model_path") -> Iterator[Path]:
    """Hold an advisory lock on ``<path>.lock`` for the block; a second holder is refused (ValueError).

    The lock file is removed when the block ends (done, refused or interrupted), while it is still
    held; a run that opened the file just before that finds, once it has the lock, that the path
    names another file (or none), and takes the lock again on the path's current file, so two runs
    never both hold the lock. The lock dies with the process (a killed run leaves only an empty file).
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory locks, nothing to hold
        yield Path(path)
        return
    target = resolved(path)
    lock_path = target.with_name(f"{target.name}.lock")
    shown_lock = Path(as_typed(path, target.parent)) / lock_path.name  # as the user would write it
    created = missing_folders(lock_path.parent)  # removed again if the run leaves them empty (a refused run)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot create its lock file {shown_lock} ({exc.strerror})") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"another run is training into {path} (it holds {shown_lock}); wait for it, or choose another {flag}"
            ) from None
        if _identity(lock_path) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            break  # the lock is on the file the path names
        os.close(fd)  # the holder removed it as we opened it: lock the path's current file instead
    try:
        yield target
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)  # still held: no other run can hold this file's lock now
        os.close(fd)  # releases the lock
        remove_created(created)


# The largest file of each kind that is read at all, with a wide margin over the largest legitimate
# one: the ddpm_cifar10 preset's 35.7M fp32 parameters are 0.14 GB, so a checkpoint (model, EMA and
# AdamW's two moments) is 0.57 GB and a TorchScript, ONNX or engine file (one copy) 0.14 GB;
# metadata files are a few KB. Keys are formats.kinds.ARTIFACT_KINDS's kinds, plus "metadata" (JSON).
GiB, MiB = 1 << 30, 1 << 20
MAX_FILE_BYTES = {
    "checkpoint": 4 * GiB,
    "torchscript": 1 * GiB,
    "onnx": 1 * GiB,
    "tensorrt": 1 * GiB,
    "metadata": 1 * MiB,
}
MAX_JSON_DEPTH = 32  # the metadata written here nests 4 deep


# --------------------------------------------------------------------------------------------
# Reading files within limits
# --------------------------------------------------------------------------------------------


def check_file_size(path: str | Path, *, kind: str) -> int:
    """The size of ``path``, a regular file of at most ``MAX_FILE_BYTES[kind]``; stat only, no read."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({first_line(exc)})") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    limit = MAX_FILE_BYTES[kind]
    if info.st_size > limit:
        raise ValueError(
            f"{path} is {format_bytes(info.st_size)}, over the {format_bytes(limit)} limit for a {kind} file; "
            "refusing to read it"
        )
    return info.st_size


def read_limited(path: str | Path, *, kind: str, inside: PathLike | None = None) -> bytes:
    """The bytes of ``path`` after :func:`check_file_size`; never more than the limit (if it grows meanwhile).

    With ``inside`` (the model folder ``path`` belongs to) the file must also pass :func:`check_inside`.
    The file opened is the one checked: a name swapped for a FIFO or a symlink meanwhile is refused.
    """
    if inside is not None:
        path = check_inside(inside, path)
    check_file_size(path, kind=kind)
    limit = MAX_FILE_BYTES[kind]
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) if inside is not None else 0)
    try:
        fd = os.open(path, flags)  # non-blocking: a FIFO put in its place would otherwise wait for a writer
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{path} is not a regular file")
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({first_line(exc)})") from exc
    if len(data) > limit:
        raise ValueError(f"{path} grew beyond the {format_bytes(limit)} limit for a {kind} file while being read")
    return data


def check_inside(folder: PathLike, path: PathLike) -> Path:
    """``path`` (a file a model folder holds, or a side file beside an exported model) with every symlink
    followed, refused in one line naming ``path`` (never what it holds) when its real path leaves ``folder``'s
    real path, or when it is missing, a folder, a FIFO, a device or a socket. The one check for every loader
    that opens a file named relative to another: what a model folder holds stays inside it."""
    root, target = resolved(folder), resolved(path)
    if not target.is_relative_to(root):
        raise ValueError(
            f"{path} leads outside {folder} (through a symlink); a model's files are read only from its own folder"
        )
    try:
        mode = os.stat(target).st_mode
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({first_line(exc)})") from exc
    if stat.S_ISDIR(mode):
        raise ValueError(f"{path} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is not a regular file (a FIFO, device or socket); refusing to read it")
    return target


def parse_json(
    raw: str | bytes,
    *,
    source: str | Path,
    max_bytes: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
) -> object:
    """JSON metadata, refused (one-line ValueError naming ``source``) when larger than ``max_bytes``
    (default ``MAX_FILE_BYTES["metadata"]``), nested deeper than ``max_depth``, not JSON, or
    holding NaN or Infinity."""
    max_bytes = MAX_FILE_BYTES["metadata"] if max_bytes is None else max_bytes
    if len(raw) > max_bytes:
        size, limit = format_bytes(len(raw)), format_bytes(max_bytes)
        raise ValueError(f"{source}: its metadata is {size}, over the {limit} limit")

    def no_constants(name: str) -> object:
        raise ValueError(f"{name} is not a number this tool reads")

    try:
        value = json.loads(raw, parse_constant=no_constants)
    except RecursionError as exc:
        raise ValueError(f"{source}: its metadata nests deeper than {max_depth} levels") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too-long integers
        raise ValueError(f"{source}: its metadata is not valid JSON ({first_line(exc)})") from exc
    stack = [(value, 1)]
    while stack:  # no recursion: depth is what is being checked
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"{source}: its metadata nests deeper than {max_depth} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


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
