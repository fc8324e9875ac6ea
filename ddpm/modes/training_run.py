"""What train, distill and train_autoencoder share: one training run's skeleton, from the locks to the
closed curves.

    with training_run(request.checkpoint, flag="--model_path", overwrite=..., resume=..., log_dir=...):
        trainer = resumed_trainer(request) if request.resume else new_trainer(request)
        train_logged(trainer, request, inputs=run_inputs(trainer, request))   # previews, curves, the loop

Each mode builds its own trainer (a U-Net on images, a student on a teacher's trajectories) or runs its own
loop (the autoencoder); what a run holds and refuses around that is here, once: the advisory locks on the
checkpoint and the log folder, an existing checkpoint never replaced without --resume or --overwrite,
curves a previous run left, the preview grids and curves checked as outputs against the run's inputs, and
Ctrl-C or SIGTERM saving a whole step before exit code 130 or 143.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from ddpm.outputs import PREVIEW, check_mode_outputs, check_previews_folder
from ddpm.training.curves import TrainingLog, refuse_previous_curves
from ddpm.util import distributed, messages
from ddpm.util.profiling import ProfileConfig, make_profiler
from ddpm.util.safe_files import run_lock


@contextlib.contextmanager
def training_run(
    checkpoint: str,
    *,
    flag: str,
    overwrite: bool,
    resume: bool = False,
    continues: str | None = None,
    log_dir: str | None = None,
):
    """The run's locks held for the whole block, and what is refused before anything is read: an existing
    ``checkpoint`` (named by ``flag``) without ``resume`` or ``overwrite`` (the line offers --resume to continue
    ``continues``; None: the mode cannot resume), and curves a previous run left in ``log_dir``."""
    with run_locks(checkpoint, flag=flag, log_dir=log_dir):
        if Path(checkpoint).exists() and not (resume or overwrite):
            again = f"--resume to continue {continues}, or " if continues is not None else ""
            raise ValueError(
                f"{flag} {checkpoint} already holds a checkpoint; pass {again}--overwrite to start over and replace it"
            )
        if log_dir is not None:  # before the data are read: a new run never mixes its curves with another's
            refuse_previous_curves(log_dir, resume=resume, overwrite=overwrite)
        yield


def train_logged(trainer, request, *, inputs: dict) -> None:
    """The loop of a built ``trainer`` with its previews and curves, each checked as an output against the run's
    ``inputs`` (every file it reads) before the first step; the curves closed however the loop ends (removed with
    the log folder this run created when it fails: curves.py)."""
    check_previews(trainer, inputs=inputs, flag="--output" if "--output" in inputs else "--model_path")
    curves = training_log(trainer, request, inputs=inputs)
    failed = False
    try:
        train(trainer, profile=request.profile, curves=curves)
    except Exception:  # not Ctrl-C or SIGTERM: train() saved that run, and its curves go with the checkpoint
        failed = True
        raise
    finally:
        if curves is not None:
            curves.close(failed=failed)  # a failed run leaves no log folder it created (its line: nothing partial)


@contextlib.contextmanager
def run_locks(checkpoint: str, *, flag: str = "--model_path", log_dir: str | None = None):
    """A second run on this checkpoint (named by ``flag``), or writing curves into this --log_dir, is refused until
    this one ends (rank 0 writes both, so rank 0 holds the locks)."""
    with contextlib.ExitStack() as locks:
        if distributed.current().is_main:
            locks.enter_context(run_lock(checkpoint, flag=flag))
            if log_dir is not None:
                locks.enter_context(run_lock(log_dir, flag="--log_dir"))
        yield


# --resume: how the rest of the run goes may change (its end, --max_steps, and these); what it learns may not.
RESUME_HONOURS = ("precision", "compile", "save_every", "sample_every")
# The recipe flags of train and distill, each compared on --resume with the checkpoint's TrainConfig field of its
# name (a mode that does not read one is never given it: the parser refuses it).
RESUME_KEEPS = ("batch_size", "lr", "warmup_steps", "ema_decay", "min_snr_gamma", "grad_clip", "cond_drop", "seed")


def resumed_config(state: dict, request, *, checkpoint: str, kept: Callable, start_over: str, **overrides):
    """The checkpoint's TrainConfig as a --resume continues it, for train and distill alike: the flags of
    RESUME_HONOURS given now replace the checkpoint's (so do ``overrides``: the run's end, its ranks), and every
    other flag given that shapes the run is compared with the checkpoint, a difference refused in one line naming
    both values: RESUME_KEEPS, and the mode's own (``kept(config)`` -> {flag: (ours, the checkpoint's)}: a model's
    shape and data, a student's teacher trajectories). ``start_over``: how the line offers a new run instead."""
    from ddpm.training.trainer import resume_config

    honoured = {flag: getattr(request, flag) for flag in RESUME_HONOURS if flag in request.given}
    config = resume_config(state, checkpoint=checkpoint, **honoured, **overrides)
    compared = {flag: (getattr(request, flag), getattr(config, flag)) for flag in RESUME_KEEPS if flag in request.given}
    compared.update(kept(config))
    contradicted = [
        f"--{flag} {ours} (the checkpoint's {theirs})"
        for flag, (ours, theirs) in compared.items()
        if flag in request.given and ours != theirs
    ]
    if contradicted:
        raise ValueError(
            f"{checkpoint} is resumed with its own settings, and {'; '.join(contradicted)} differ from them; "
            f"drop those flags, or {start_over}"
        )
    return config


PREVIEW_NAME = re.compile(r"step_(\d{7,})\.png")


def check_previews(trainer, *, inputs: dict, flag: str = "--model_path") -> None:
    """The preview grids this run will write (<model_path stem>_samples/step_NNNNNNN.png, every
    --sample_every steps and at the end) are outputs too: checked before the first step against the
    run's ``inputs`` (:func:`run_inputs`), like every other output (their folder was checked with the flags:
    outputs.check_previews_folder; again here, against the inputs the model file named). Only names that
    already exist can be an input (through a symlink or a hard link)."""
    check_preview_outputs(trainer.config, start=trainer.step, inputs=inputs, flag=flag)


def check_preview_outputs(config, *, start: int, inputs: dict, flag: str = "--model_path") -> None:
    """:func:`check_previews` for a run of ``config`` (a TrainConfig) from step ``start``, before its trainer
    exists (distill checks its previews before the teacher's trajectories); ``flag`` names the checkpoint."""
    folder = check_previews_folder(config.checkpoint, flag=flag, inputs=inputs)
    if not folder.is_dir():
        return
    end, every = config.total_steps, config.sample_every

    def planned(step: int) -> bool:
        return start < step <= end and (step == end or (every > 0 and step % every == 0))

    existing = [
        entry for entry in folder.iterdir() if (match := PREVIEW_NAME.fullmatch(entry.name)) and planned(int(match[1]))
    ]
    for entry in existing:
        check_mode_outputs("train", {PREVIEW: entry}, inputs=inputs)


def training_log(trainer, request, *, inputs: dict) -> TrainingLog | None:
    """Rank 0's training curves (training/curves.py) in --log_dir, checked as outputs against the run's ``inputs``
    (:func:`run_inputs`) before the first step; None on the other ranks."""
    if request.log_dir is None or not distributed.current().is_main:
        return None
    config = trainer.config
    explicit = "log_dir" in request.given  # the tensorboard hint only for a user who asked for curves
    curves = TrainingLog(
        request.log_dir,
        start_step=trainer.step,
        every=request.log_every,
        resume=request.resume,
        overwrite=request.overwrite,
        inputs=inputs,
        say=distributed.say if explicit else None,
    )
    model, schedule = trainer.model_config.to_dict(), asdict(trainer.schedule_config)
    curves.hparams({"train": asdict(config), "model": model, "schedule": schedule})
    return curves


def train(trainer, *, profile: str | None = None, curves: TrainingLog | None = None) -> None:
    """Run the training loop; on Ctrl-C or SIGTERM save a whole step's state, then exit 130 or 143.

    A run stopped before its first step saves nothing, so the file it would replace stays as it was.
    With ``profile`` (--profile DIR) a few steps of the run are traced (profiling.py); with ``curves``
    (training_log's) every step is recorded.
    """

    start, ranks = trainer.step, distributed.current()
    try:
        if profile and trainer.config.total_steps > start:
            run_name = f"train-rank{ranks.rank}" if ranks.distributed else "train"
            config = ProfileConfig(profile, run_name=run_name, total_steps=trainer.config.total_steps - start)
            with make_profiler(config, device=trainer.device, log=tqdm.write) as profiler:
                trainer.run(profiler=profiler, curves=curves)
        else:
            trainer.run(curves=curves)
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, messages.Interrupted) else messages.Interrupted()
        if trainer.step == start:
            if ranks.is_main:
                print(f"\n{stop.name}: stopped before the first step; nothing was saved", file=sys.stderr)
            raise SystemExit(stop.exit_code) from None
        with messages.deferred(reraise=False):  # a second signal does not cut this save
            path = trainer.save()  # rank 0 writes; every rank stopped after the same step
        if ranks.is_main:
            print(
                f"\n{stop.name}: stopped at step {trainer.step}; saved {path} (continue with --resume)", file=sys.stderr
            )
        raise SystemExit(stop.exit_code) from None
