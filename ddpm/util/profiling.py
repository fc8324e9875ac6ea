"""``--profile DIR``: a torch.profiler trace, an op summary and, on CUDA, a memory snapshot of a run.

Every run writes a new folder, so nothing is ever overwritten::

    DIR/<run_name>/plugins/profile/<YYYY_MM_DD_HH_MM_SS>[_N]/
        <host>.pt.trace.json     Chrome trace JSON ({"traceEvents": [...]}) of the active steps
        summary.txt              top ops by self CPU time (and by self CUDA time on CUDA)
        memory_snapshot.pickle   CUDA only: the caching allocator's history

Viewing it (none of these is needed to write it):

- TensorBoard: ``tensorboard --logdir DIR`` after ``pip install tensorboard torch-tb-profiler``. The
  plugin takes every folder holding a ``*.pt.trace.json`` as a run, so each one shows up as
  ``<run_name>/plugins/profile/<timestamp>`` with no file to move. (PyTorch calls this plugin
  deprecated and points to Perfetto; it still loads these traces.)
- Perfetto: open the ``.pt.trace.json`` at https://ui.perfetto.dev (chrome://tracing reads it too).
- Nsight Systems: ``nsys profile -t cuda,nvtx python main.py ...``; the phases wrapped in
  :meth:`Profiler.range` ("unet", "fused_step", "noise") appear as NVTX ranges.
- The memory snapshot: drop it on https://pytorch.org/memory_viz.

Schedule: call :meth:`Profiler.step` once at the end of every step. The first ``wait`` steps run
untraced, the next ``warmup`` are traced and discarded, the next ``active`` are recorded, once. With
``total_steps`` the schedule is shrunk to fit: ``wait`` goes first, then ``active`` down to 1, then
``warmup``. A run that stops inside the active window still writes what it recorded; one that stops
before it writes nothing and says so in one line. A Ctrl-C (any ``BaseException`` that is not an
``Exception``) stops the profiler and writes nothing more; an error still writes, since a trace and a
memory snapshot leading up to an out-of-memory error are what one profiles for.

A write the file system refuses (a full disk) ends in the one line of every refused write
(util/safe_files.write_error), the trace's and the summary's as the run's own (a checkpoint's): the profile
folder the run created is removed, with the folders above it that it created, so nothing partial is left.
The trace is exported to a temporary name beside it, then renamed: torch.profiler's writer stops short on
a full disk without a word, leaving no file, which is named as the full disk it is when ``os.statvfs``
shows no room.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from ddpm.util import phases, safe_files

TRACE_SUFFIX = ".pt.trace.json"  # what torch-tb-profiler looks for (it also takes .pt.trace.json.gz)
SUMMARY_ROWS = 15
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept by the CUDA memory snapshot


@dataclass(frozen=True)
class ProfileConfig:
    directory: str  # DIR given by --profile
    run_name: str  # one folder name under DIR: "train", "sample-cuda", ...
    wait: int = 1
    warmup: int = 1
    active: int = 3
    record_memory: bool = True  # profile_memory + record_shapes (+ the CUDA memory snapshot)
    total_steps: int | None = None  # steps the caller will run, if known: the schedule is fitted to them

    def __post_init__(self) -> None:
        if not self.run_name or self.run_name in {".", ".."} or re.search(r"[/\\]", self.run_name):
            raise ValueError(f"profile run name must be one folder name, got {self.run_name!r}")
        for name in ("wait", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"profile {name} must be >= 0, got {getattr(self, name)}")
        if self.active < 1:
            raise ValueError(f"profile active must be >= 1, got {self.active}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"profile total_steps must be >= 1, got {self.total_steps}")

    @property
    def sessions_root(self) -> Path:
        return Path(self.directory) / self.run_name / "plugins" / "profile"

    def fitted(self) -> tuple[int, int, int]:
        """(wait, warmup, active), shrunk to fit ``total_steps``: wait first, active down to 1, then warmup."""
        wait, warmup, active = self.wait, self.warmup, self.active
        if self.total_steps is None:
            return wait, warmup, active
        excess = max(0, wait + warmup + active - self.total_steps)
        cut = min(excess, wait)
        wait, excess = wait - cut, excess - cut
        cut = min(excess, active - 1)
        active, excess = active - cut, excess - cut
        return wait, warmup - excess, active  # excess <= warmup here, as total_steps >= 1


class Profiler:
    """Context manager around ``torch.profiler.profile``; see the module docstring for what it writes."""

    def __init__(
        self, config: ProfileConfig, *, device: torch.device | str, log: Callable[[str], None] = print
    ) -> None:
        root = config.sessions_root
        for path in (root, *root.parents):  # refused before any work starts
            if path.exists() and not path.is_dir():
                raise ValueError(f"profile directory {path} exists and is not a directory")
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cpu":  # kineto's start/stop probes and its "no GPU" error are noise on a CPU run
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._log = log  # receives the summary table and one line on what was written: pass tqdm.write
        self._cuda = self.device.type == "cuda"
        self._snapshotting = self._cuda and config.record_memory
        self._prof: profile | None = None
        self._steps = 0
        self._keep = True  # False after Ctrl-C or a refused write: write nothing more
        self._failed = False  # a write of this profile's own was refused
        self._created: list[Path] = []  # the folders above the session folder that this run made
        self.folder: Path | None = None
        self.trace_path: Path | None = None
        self.summary_path: Path | None = None
        self.memory_snapshot_path: Path | None = None

    @property
    def written(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.trace_path, self.summary_path, self.memory_snapshot_path) if p is not None)

    def __enter__(self) -> Profiler:  # noqa: PYI034 (typing.Self is 3.11+; setup.py allows 3.10)
        self._created = safe_files.missing_folders(self.config.sessions_root)
        self.folder = _new_session_folder(self.config.sessions_root)
        wait, warmup, active = self.config.fitted()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self._cuda else [])]
        with warnings.catch_warnings():  # a run of one or two steps has no warm-up step to spare: said in the docstring
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            steps = schedule(wait=wait, warmup=warmup, active=active, repeat=1)
        self._prof = profile(
            activities=activities,
            schedule=steps,
            on_trace_ready=self._write_trace,
            record_shapes=self.config.record_memory,
            profile_memory=self.config.record_memory,
            with_stack=False,
        )
        self._prof.__enter__()
        phases.active = self
        if self._snapshotting:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        return self

    def step(self) -> None:
        """Mark the end of one training or sampling step."""
        if self._prof is None:
            raise RuntimeError("Profiler.step() called outside its with-block")
        self._steps += 1  # first: prof.step() may call _write_trace, which reads it
        self._prof.step()

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        """A named phase: a range in the torch trace and, on CUDA, an NVTX range for Nsight Systems."""
        nvtx = torch.cuda.nvtx.range(name) if self._cuda else contextlib.nullcontext()
        with record_function(name), nvtx:
            yield

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        phases.active = None
        # A refused write, this profile's or the run's own (a checkpoint on a full disk): nothing partial is left.
        refused = exc is not None and (
            self._failed or isinstance(exc, safe_files.WriteError) or safe_files.write_failure(exc) is not None
        )
        self._keep = (exc_type is None or issubclass(exc_type, Exception)) and not refused
        assert self._prof is not None and self.folder is not None
        try:
            try:
                self._prof.__exit__(exc_type, exc, tb)  # flushes a run that stopped inside the active window
            finally:
                if self._snapshotting:
                    try:
                        if self._keep:
                            snapshot = self.folder / "memory_snapshot.pickle"
                            torch.cuda.memory._dump_snapshot(str(snapshot))
                            self.memory_snapshot_path = snapshot
                    finally:
                        torch.cuda.memory._record_memory_history(enabled=None)
            if self._keep:
                self._report()
        except Exception:
            self._discard()
            raise
        if refused:
            self._discard()

    def _discard(self) -> None:
        """The session folder (this run's own: made by an exclusive mkdir) and the folders above it that this run
        created, removed: what a run whose writes were refused leaves of its profile."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        safe_files.remove_created(self._created)
        self.trace_path = self.summary_path = self.memory_snapshot_path = None

    def _write_trace(self, prof: profile) -> None:
        wait, warmup, _ = self.config.fitted()
        if not self._keep or self._steps <= wait + warmup:  # stopped before one active step completed
            return
        assert self.folder is not None
        host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"  # a "." would end the worker name
        path = self.folder / f"{host}{TRACE_SUFFIX}"
        temporary = safe_files.sibling_temporary(path)  # not a trace name, so never read half-written
        try:
            prof.export_chrome_trace(str(temporary))
            if not temporary.is_file():  # kineto's writer stops short on a full disk without raising
                raise FileNotFoundError(errno.ENOENT, "torch.profiler wrote no trace", str(temporary))
            os.replace(temporary, path)
        except Exception as exc:
            failure = (
                safe_files.write_failure(exc) or safe_files.full_disk(self.folder) or exc
            )  # before the removal frees the room
            for left in (temporary, temporary.with_name(f"{temporary.name}.tmp")):  # kineto writes <name>.tmp first
                left.unlink(missing_ok=True)
            self._failed = True
            raise safe_files.write_error(path, failure, existed=False) from exc
        self.trace_path = path

    def _report(self) -> None:
        assert self._prof is not None and self.folder is not None
        if self.trace_path is None:
            wait, warmup, _ = self.config.fitted()
            self._log(
                f"profile: no trace written: the run ended after {self._steps} step(s), before the first "
                f"active one (wait {wait} + warmup {warmup}); run more steps or pass total_steps"
            )
        else:
            sorts = ["self_cpu_time_total", *(["self_device_time_total"] if self._cuda else [])]
            averages = self._prof.key_averages()
            table = "\n\n".join(f"sorted by {k}:\n{averages.table(sort_by=k, row_limit=SUMMARY_ROWS)}" for k in sorts)
            summary = (table + "\n").encode()
            self.summary_path = safe_files.atomic_write(self.folder / "summary.txt", lambda f: f.write(summary))
            self._log(table)
        if self.written:  # on CUDA the memory snapshot is written even without a trace
            self._log(
                f"profile: wrote {', '.join(map(str, self.written))}; view: {tensorboard_hint(self.config.directory)}"
            )


class NullProfiler:
    """What ``make_profiler(None, ...)`` gives: the same calls, doing nothing."""

    folder = trace_path = summary_path = memory_snapshot_path = None
    written: tuple[Path, ...] = ()

    def __enter__(self) -> NullProfiler:  # noqa: PYI034
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def step(self) -> None:
        return None

    def range(self, name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def make_profiler(
    config: ProfileConfig | None, *, device: torch.device | str, log: Callable[[str], None] = print
) -> Profiler | NullProfiler:
    """``with make_profiler(cfg_or_None, device=device) as prof:`` with no branch at the call site."""
    return NullProfiler() if config is None else Profiler(config, device=device, log=log)


def tensorboard_hint(directory: str) -> str:
    return f"tensorboard --logdir {directory} (pip install tensorboard torch-tb-profiler)"


def _new_session_folder(root: Path) -> Path:
    """A new ``root/<timestamp>[_N]``; mkdir without exist_ok, so two runs never share a folder."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y_%m_%d_%H_%M_%S")
    for n in itertools.count():
        folder = root / (stamp if n == 0 else f"{stamp}_{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")
