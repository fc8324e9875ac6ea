"""Training curves: metrics.csv always, TensorBoard event files when the tensorboard package is installed.

    python main.py --mode train --dataset digits --max_steps 1500        # -> checkpoints/digits_logs/
    tensorboard --logdir checkpoints/digits_logs

Every ``every`` steps (and at the run's last step) one row goes into ``<log dir>/metrics.csv``:

    step,loss,lr,grad_norm,images_per_s,skipped_steps,wall_time

``loss`` and ``grad_norm`` are the means over the steps since the previous row (their finite values;
``nan`` if every one was skipped), ``lr`` the rate of the row's step, ``images_per_s`` the training
throughput of those steps (optimizer steps only: previews and checkpoints are not counted),
``skipped_steps`` how many of them were skipped as non-finite, ``wall_time`` seconds since the epoch.
The same values go to TensorBoard as ``train/<column>`` scalars, with the preview grids as images and
the run's configuration as a text table.

Nothing is written before the first training step ends. A new run refuses a folder that already holds curves
unless it replaces them (``overwrite``); a resumed run keeps the rows up to its checkpoint's step and appends. A run
that fails (``close(failed=True)``) removes the log folder it created.

    log = TrainingLog("checkpoints/digits_logs", start_step=0, every=10, inputs={"--model_path": "ck.pt"})
    log.add_step(1, loss=0.8, lr=2e-4, grad_norm=1.3, images=64, seconds=0.05)   # a row every 10 steps
    log.close()                                                                  # the last partial window
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ddpm.requests import CURVES, check_mode_outputs
from ddpm.util.safe_files import Input, atomic_write, missing_folders, remove_created

COLUMNS = ("step", "loss", "lr", "grad_norm", "images_per_s", "skipped_steps", "wall_time")
HEADER = ",".join(COLUMNS)
CSV_NAME = "metrics.csv"
EVENTS_GLOB = "events.out.tfevents.*"  # the names SummaryWriter gives its files (and only it)
TENSORBOARD_INSTALL = "pip install tensorboard"
FORMATS = {"loss": ".7g", "lr": ".6g", "grad_norm": ".6g", "images_per_s": ".6g", "wall_time": ".3f"}


def default_log_dir(checkpoint: str) -> str:
    """``checkpoints/mnist.pt`` -> ``checkpoints/mnist_logs`` (beside the checkpoint, like its ``_samples``)."""
    path = Path(checkpoint)
    return str(path.with_name(f"{path.stem}_logs"))


def previous_curves(directory: str | Path) -> list[Path]:
    """The curve files a run left in ``directory``: its metrics.csv and TensorBoard event files."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    return [
        path for path in (folder / CSV_NAME, *sorted(folder.glob(EVENTS_GLOB))) if path.exists() or path.is_symlink()
    ]


def refuse_previous_curves(directory: str | Path, *, resume: bool, overwrite: bool) -> None:
    """A new run (neither ``resume`` nor ``overwrite``) may not mix its curves with another run's."""
    if resume or overwrite:
        return
    found = previous_curves(directory)
    if found:
        raise ValueError(
            f"--log_dir {directory} already holds the training curves of another run ({found[0].name}); pass "
            "--overwrite "
            "to replace them, or choose another --log_dir"
        )


def _format(name: str, value: float | None) -> str:
    if value is None:
        return ""
    if name in ("step", "skipped_steps"):
        return str(int(value))
    return "nan" if not math.isfinite(value) else format(value, FORMATS[name])


class TrainingLog:
    """The curves of one run, written by rank 0 (the trainer calls :meth:`add_step` after every step)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        start_step: int = 0,
        every: int = 10,
        resume: bool = False,
        overwrite: bool = False,
        inputs: Mapping[str, Input | None] | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"--log_every must be a positive integer, got {every}")
        self.directory, self.every, self.start_step = Path(directory), every, start_step
        self.csv = self.directory / CSV_NAME
        self.resume = resume
        # An output like every other: never an input (the checkpoint, the autoencoder, the data), a folder or read-only.
        check_mode_outputs("train", {CURVES: self.csv}, inputs=inputs)
        refuse_previous_curves(self.directory, resume=resume, overwrite=overwrite)
        # The rows to write under a new header before appending ([]: a new CSV); None: append to the CSV as it is.
        self.kept_rows = self._rows_to_keep() if resume else []
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: the CSV is the record; say so once, if the user asked for curves
            SummaryWriter = None
            if say is not None:
                say(
                    f"tensorboard is not installed: {self.csv} is written, TensorBoard event files are not "
                    f"({TENSORBOARD_INSTALL})"
                )
        self._writer_class, self._writer, self._file = SummaryWriter, None, None
        self._created: list[Path] = []  # the log folder and those above it, when this run made them
        self._pending_text: list[tuple[str, str]] = []
        self._window: list[
            tuple[float, float, int, float]
        ] = []  # (loss, grad norm, images, seconds) since the last row
        self._last_step, self._last_lr, self._last_time = start_step, math.nan, 0.0

    # ----- what the trainer calls -----------------------------------------------------------------
    def add_step(self, step: int, *, loss: float, lr: float, grad_norm: float, images: int, seconds: float) -> None:
        """One finished optimizer step (``step`` counts it); a row is written every ``every`` steps."""
        self._window.append((loss, grad_norm, images, seconds))
        self._last_step, self._last_lr, self._last_time = step, lr, time.time()
        if step % self.every == 0:
            self._write_window()

    def log(self, step: int, **scalars: float) -> None:
        """One row of ``metrics.csv`` (columns not given are left empty; ``wall_time`` defaults to now) and the
        same TensorBoard scalars."""
        unknown = set(scalars) - set(COLUMNS[1:])
        if unknown:
            raise ValueError(f"no training-curve column named {', '.join(sorted(unknown))}; the columns are {HEADER}")
        self._open()
        wall_time = scalars.pop("wall_time", None) or time.time()
        row = {"step": step, **scalars, "wall_time": wall_time}
        self._file.write(",".join(_format(name, row.get(name)) for name in COLUMNS) + "\n")
        self._file.flush()  # a whole line reaches the file, or nothing does
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(f"train/{name}", value, global_step=step, walltime=wall_time)

    def image(self, step: int, tag: str, grid: str | Path) -> None:
        """A preview grid (the PNG the trainer wrote) as a TensorBoard image; nothing without tensorboard."""
        if self._writer_class is None:
            return
        import numpy as np
        from PIL import Image

        self._open()
        with Image.open(grid) as picture:
            pixels = np.asarray(picture.convert("RGB"))  # (H, W, 3) uint8
        self._writer.add_image(tag, pixels, global_step=step, dataformats="HWC")

    def hparams(self, config: Mapping[str, object]) -> None:
        """The run's configuration, once, as a TensorBoard text table (``name | value``; nested dicts flattened)."""
        flat: dict[str, object] = {}
        for key, value in config.items():
            if isinstance(value, Mapping):
                flat.update({f"{key}.{inner}": item for inner, item in value.items()})
            else:
                flat[key] = value
        table = "\n".join(
            ["| name | value |", "| --- | --- |", *(f"| {key} | {value} |" for key, value in flat.items())]
        )
        if self._writer is not None:
            self._writer.add_text("config", table, global_step=self.start_step)
        else:  # written with the first row: no file before the first step
            self._pending_text.append(("config", table))

    def close(self, *, failed: bool = False) -> None:
        """Write the steps since the last row (the run's last step), then close the files. A ``failed`` run (or one
        whose last row cannot be written) writes nothing more and removes the log folder if it created it."""
        try:
            if self._window and not failed:
                self._write_window()
        except BaseException:
            failed = True
            raise
        finally:
            if self._writer is not None:
                self._writer.close()
            if self._file is not None:
                self._file.close()
            self._writer = self._file = None
            if failed and self._created:
                shutil.rmtree(self._created[0], ignore_errors=True)  # this run's own folder: only its curves
                remove_created(self._created[1:])

    # ----- files ------------------------------------------------------------------------------------
    def _write_window(self) -> None:
        losses = [loss for loss, _, _, _ in self._window if math.isfinite(loss)]
        norms = [norm for _, norm, _, _ in self._window if math.isfinite(norm)]
        images, seconds = sum(w[2] for w in self._window), sum(w[3] for w in self._window)
        self.log(
            self._last_step,
            loss=sum(losses) / len(losses) if losses else math.nan,
            lr=self._last_lr,
            grad_norm=sum(norms) / len(norms) if norms else math.nan,
            images_per_s=images / seconds if seconds > 0 else math.nan,
            skipped_steps=len(self._window) - len(losses),
            wall_time=self._last_time,  # when the step ended (not when a window cut short at the end is written)
        )
        self._window = []

    def _rows_to_keep(self) -> list[str] | None:
        """A resumed run's existing rows up to its checkpoint's step; None when the file is fine as it is."""
        if not self.csv.exists():
            return []
        try:
            text = self.csv.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.csv} cannot be read ({exc}); move it, or choose another --log_dir") from exc
        if not text:
            return []
        lines = text.split("\n")
        if lines[0].rstrip("\r") != HEADER:
            raise ValueError(
                f"{self.csv} is not this tool's training curves (its first line is not {HEADER}); move it, or choose "
                "another --log_dir"
            )
        rows = lines[1:-1]  # the last item is "" after a final newline, or a line a killed run cut short
        kept = [row for row in rows if _step_of(row) is not None and _step_of(row) <= self.start_step]
        return None if kept == rows and text.endswith("\n") else kept

    def _open(self) -> None:
        """Start the files at the first write: the CSV (fresh, trimmed or appended to) and the event writer."""
        if self._file is not None:
            return
        self._created = missing_folders(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            # --overwrite: remove the replaced run's event files too, or TensorBoard would draw both curves.
            for events in self.directory.glob(EVENTS_GLOB):
                if not events.is_dir():
                    events.unlink()
        if self.kept_rows is not None:  # a new CSV, or one trimmed to the checkpoint's step (written whole, atomically)
            content = "".join(f"{line}\n" for line in (HEADER, *self.kept_rows)).encode()
            atomic_write(self.csv, lambda f: f.write(content))
        self._file = open(self.csv, "a", encoding="utf-8", buffering=1)  # noqa: SIM115  (line-buffered appends, all run long)
        if self._writer_class is not None:
            # A resumed run: TensorBoard discards the events after the checkpoint's step (those of a killed run),
            # as the CSV does; events at or before it stay (TensorBoard keeps steps < purge_step).
            purge = self.start_step + 1 if self.resume else None
            self._writer = self._writer_class(log_dir=str(self.directory), purge_step=purge)
            for tag, text in self._pending_text:
                self._writer.add_text(tag, text, global_step=self.start_step)


def _step_of(row: str) -> int | None:
    head = row.split(",", 1)[0]
    return int(head) if head.isdigit() else None
