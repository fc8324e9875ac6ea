"""--mode train and --mode train_autoencoder, and the run every training mode shares (distill's too): from the
request to the saved checkpoint.

    python main.py --mode train --dataset digits --max_steps 1500
    torchrun --nproc_per_node 4 main.py --mode train --dataset cifar10 --batch_size 128
    python main.py --mode train_autoencoder --dataset digits

    with training_run(request.checkpoint, flag="--model_path", overwrite=..., resume=..., log_dir=...):
        trainer = resumed_trainer(request) if request.resume else new_trainer(request)
        train(trainer, request, inputs=run_inputs(trainer, request))   # previews, curves, the loop

The loop itself is training/trainer.py's. Each mode builds its own trainer here or in modes/distill.py (a U-Net
on images or latents, a student on a teacher's trajectories) or runs its own loop (the autoencoder); what a run
holds and refuses around that is here, once: the advisory locks on the checkpoint and the log folder, an existing
checkpoint never replaced without --resume or --overwrite, curves a previous run left, the preview grids and
curves checked as outputs against the run's inputs, and Ctrl-C or SIGTERM saving a whole step before exit code
130 or 143."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from tqdm.auto import tqdm

from basic_diffusion import count_parameters
from ddpm.backends.artifacts import load_model_parts
from ddpm.batch_memory import check_batch_fits
from ddpm.choices import DIGITS_RECIPE, LATENT_RECIPE, TRAIN_EPOCHS
from ddpm.data.datasets import data_input, load_images
from ddpm.formats.checkpoints import check_pixel_unet, load_checkpoint, read_configs, read_link
from ddpm.latent.autoencoder import encode_dataset, linked_first_stage, load_first_stage
from ddpm.requests import (
    FIRST_STAGE,
    PREVIEW,
    AutoencoderTrainRequest,
    NewModel,
    TrainRequest,
    check_mode_outputs,
    check_previews_folder,
)
from ddpm.training.autoencoder_trainer import train_autoencoder
from ddpm.training.curves import TrainingLog, refuse_previous_curves
from ddpm.training.trainer import TrainConfig, Trainer, check_warmup
from ddpm.util import distributed, messages
from ddpm.util.profiling import ProfileConfig, make_profiler
from ddpm.util.safe_files import as_input, run_lock


def run_train(request: TrainRequest) -> None:
    run = dict(overwrite=request.overwrite, resume=request.resume, continues="it", log_dir=request.log_dir)
    with training_run(request.checkpoint, flag="--model_path", **run):
        if request.digits_recipe:
            distributed.say(recipe_line(request))
        if request.first_stage is not None:
            train_first_stage(request.first_stage)
        trainer = resumed_trainer(request) if request.resume else new_trainer(request)
        train(trainer, request, inputs=run_inputs(trainer, request))
    distributed.say(f"checkpoint: {request.checkpoint}")


def recipe_line(request: TrainRequest) -> str:
    """What the digits recipe trains, in one line (the flags left it to choices.DIGITS_RECIPE)."""
    applied = DIGITS_RECIPE if request.first_stage is None else LATENT_RECIPE
    spec = request.model
    ran = {  # as the run takes them: a flag the recipe leaves to the user (--dropout, --min_snr_gamma) may be given
        "model_channels": spec.model_channels,
        "num_res_blocks": spec.num_res_blocks,
        "batch_size": request.batch_size,
        "lr": request.lr,
        "timestep_sampling": request.timestep_sampling,
        "dropout": spec.dropout,
        "min_snr_gamma": request.min_snr_gamma or 0,
    }
    recipe = ", ".join(
        f"--{name} {ran[name]:g}" if isinstance(ran[name], float) else f"--{name} {ran[name]}" for name in applied
    )
    if request.first_stage is None:
        return f"the CPU's recipe for digits (no model or recipe flag given): {recipe}"
    stage = request.first_stage
    return (
        f"the recipe for 28x28 digits (no model or recipe flag given): a latent model, first an autoencoder of "
        f"{stage.base_channels} base channels ({stage.max_steps} steps of {stage.batch_size}) into {stage.checkpoint}, "
        f"then the U-Net on its latents: {recipe}"
    )


def train_first_stage(stage: AutoencoderTrainRequest) -> None:
    """The digits recipe's autoencoder, trained before the U-Net in the same run: an existing one is replaced only with
    --overwrite; under torchrun rank 0 trains it while the others wait, then every rank reads it."""
    if distributed.current().is_main:
        with training_run(stage.checkpoint, flag=FIRST_STAGE, overwrite=stage.overwrite):
            train_autoencoder(stage)  # Ctrl-C: what was trained is saved, and the U-Net is not started
    distributed.barrier()


def check_batch_fills(batch_size: int, images, *, dataset: str) -> None:
    """A batch is drawn from the training images without repeats: more than they hold cannot be drawn."""
    if batch_size > len(images):
        raise ValueError(
            f"--batch_size {batch_size} is larger than the {len(images)} {dataset} training images; "
            f"use --batch_size {len(images)} or less, or more images"
        )


def run_inputs(trainer, request: TrainRequest) -> dict:
    """Every file a training run reads, for the output checks of what it writes besides its checkpoint (the
    previews, the curves): the checkpoint, the autoencoder (given or linked), the data, --init_from's model."""
    stage = trainer.first_stage
    return {
        "--model_path": request.checkpoint,
        "its autoencoder": stage.link.get("path") if stage is not None else None,
        "--data_dir": data_input(trainer.config.dataset, request.model.data_dir),
        "--init_from": as_input(request.init_from),
    }


def resumed_trainer(request: TrainRequest):
    checkpoint, device, ranks = request.checkpoint, request.device, distributed.current()
    state = load_checkpoint(checkpoint)  # validated: configs, sizes
    model_config, schedule_config = read_configs(state, source=f"checkpoint {checkpoint}")
    # Any number of ranks continues a run: the checkpoint holds no rank's own state. How the run goes on
    # (its end, precision, compile, checkpoint and preview cadence) may change; what it learns may not.
    config = resumed_config(
        state,
        request,
        checkpoint=checkpoint,
        kept=lambda config: model_kept(request, config, model_config, schedule_config),
        start_over="start a new run (another --model_path, or --overwrite)",
        total_steps=request.max_steps,
        world_size=ranks.world_size,
        grad_checkpoint=request.grad_checkpoint or None,  # memory, not math: a resumed run may turn it on
    )
    if request.timestep_sampling not in (None, config.timestep_sampling):
        raise ValueError(
            f"{checkpoint} trains with --timestep_sampling {config.timestep_sampling}, and a resumed run keeps it; "
            f"to train with {request.timestep_sampling}, start a new run (another --model_path, or --overwrite)"
        )
    if config.total_steps <= state["step"]:  # nothing to do: say so rather than exit 0 having done nothing
        raise ValueError(
            f"{checkpoint} is at step {state['step']} of {config.total_steps}; to train on, pass --max_steps above "
            f"{state['step']}"
        )
    check_batch_fits(
        model_config,
        batch_size=config.per_rank_batch(),
        device=device,
        training=True,
        grad_checkpoint=config.grad_checkpoint,
    )
    # A latent model: its autoencoder, checked against the one it trained with, encodes the data again
    # (the checkpoints this run writes name the autoencoder where it is now).
    stage, autoencoder = linked_first_stage(
        read_link(state, source=f"checkpoint {checkpoint}"),
        model_config=model_config,
        source=f"checkpoint {checkpoint}",
        device=device,
        override=request.autoencoder,
        folder=Path(checkpoint).parent,
    )
    if stage is None:
        images = training_images(
            config.dataset,
            data_dir=request.model.data_dir,
            image_size=model_config.image_size,
            channels=model_config.in_channels,
        )
    else:
        images = latent_images(replace(request.model, dataset=config.dataset), autoencoder)
    check_batch_fills(config.batch_size, images, dataset=config.dataset)
    trainer = Trainer(
        config, model_config, schedule_config, images=images, device=device, resume_state=state, first_stage=stage
    )
    distributed.say(f"resuming {checkpoint} at step {trainer.step} of {config.total_steps}{on_ranks(config)}")
    return trainer


def model_kept(request: TrainRequest, config, model_config, schedule_config) -> dict:
    """What --resume compares besides the recipe (resumed_config below), {flag: (ours, the
    checkpoint's)}: a resumed run keeps its data, model and schedule."""
    spec = request.model
    return {
        "dataset": (spec.dataset, config.dataset),
        "img_size": (spec.image_size, model_config.image_size),
        "channels": (spec.channels, model_config.in_channels),
        "model_channels": (spec.model_channels, model_config.model_channels),
        "num_res_blocks": (spec.num_res_blocks, model_config.num_res_blocks),
        "dropout": (spec.dropout, model_config.dropout),
        "timesteps": (spec.timesteps, schedule_config.num_timesteps),
        "beta_schedule": (spec.beta_schedule, schedule_config.kind),
    }


def training_images(dataset: str, **kwargs):
    """The training images; under torchrun rank 0 downloads them (if needed) before the others read them."""

    ranks = distributed.current()
    if ranks.is_main:
        images = load_images(dataset, **kwargs)
        distributed.barrier()  # the files are in place for the other ranks
        return images
    distributed.barrier()
    return load_images(dataset, download=False, **kwargs)


def latent_images(model: NewModel, autoencoder):
    """The training images at the autoencoder's size, encoded once into its scaled latents (latent/autoencoder.py)."""

    config = autoencoder.config
    images = training_images(
        model.dataset, data_dir=model.data_dir, image_size=config.image_size, channels=config.in_channels
    )
    distributed.say(f"encoding {len(images)} {model.dataset} images with {autoencoder.path} ...")
    return encode_dataset(images, autoencoder, source=autoencoder.path)


def on_ranks(config) -> str:
    """``" on 4 ranks (gloo), 32 images each"`` for a distributed run, ``""`` for one process."""

    if config.world_size == 1:
        return ""
    return f" on {config.world_size} ranks ({distributed.backend()}), {config.per_rank_batch()} images each"


def new_trainer(request: TrainRequest):
    spec, device, ranks = request.model, request.device, distributed.current()
    stage = None
    if request.autoencoder:  # a latent model: the U-Net's data are the autoencoder's latents
        stage, autoencoder = load_first_stage(request.autoencoder, device=device)
        channels, size = autoencoder.config.in_channels, autoencoder.config.image_size
        if spec.image_size not in (0, size) or spec.channels not in (0, channels):
            raise ValueError(
                f"--autoencoder {request.autoencoder} encodes {channels}x{size}x{size} images; drop --img_size and "
                "--channels "
                "(a latent model trains at its autoencoder's size), or train an autoencoder at the size you want"
            )
        latent_channels, latent_side = stage.latent_shape[0], stage.latent_shape[-1]
        spec = replace(spec, image_size=latent_side, channels=latent_channels)
    start = None
    if (
        request.init_from
    ):  # fine-tuning: the U-Net, its weights and its schedule from the file; data and recipe from the flags
        start, schedule_config, _, link, _ = load_model_parts(request.init_from, device="cpu")
        if link is not None:
            raise ValueError(
                f"--init_from {request.init_from} is a latent model; continue its own run with --resume instead"
            )
        model_config = start.config
        spec = replace(spec, image_size=model_config.image_size, channels=model_config.in_channels)
    else:
        model_config, schedule_config = spec.model_config(), spec.schedule_config()  # validated before any download
    if stage is None:
        check_pixel_unet(
            model_config, source="--init_from" if start is not None else "--channels"
        )  # images have 1 or 3
    distributed.check_global_batch(request.batch_size, world_size=ranks.world_size)
    check_batch_fits(
        model_config,
        batch_size=request.batch_size // ranks.world_size,
        device=device,
        training=True,
        grad_checkpoint=request.grad_checkpoint,
    )
    if stage is None:
        images = training_images(
            spec.dataset, data_dir=spec.data_dir, image_size=spec.image_size, channels=spec.channels
        )
    else:
        images = latent_images(request.model, autoencoder)
    check_batch_fills(request.batch_size, images, dataset=spec.dataset)
    if request.class_cond:  # one label embedding per class, and the null label
        if images.labels is None:
            raise ValueError(
                f"--class_cond needs labels; the {spec.dataset} images have none (a folder's classes are its "
                "sub-folders: put every image in one)"
            )
        model_config = replace(model_config, num_classes=len(images.class_names))
    # --max_steps alone sets the length; with --n_epochs (default TRAIN_EPOCHS) it caps it.
    if request.n_epochs is None and request.max_steps:
        total = request.max_steps
    else:
        epochs = request.n_epochs or TRAIN_EPOCHS
        total = epochs * images.steps_per_epoch(request.batch_size)
        total = min(total, request.max_steps) if request.max_steps else total
        check_warmup(request.warmup_steps, run_steps=total, run=f"{epochs} epoch{'s' * (epochs > 1)}: {total:,} steps")
    config = TrainConfig(
        dataset=spec.dataset,
        total_steps=total,
        batch_size=request.batch_size,
        lr=request.lr,
        warmup_steps=request.warmup_steps if request.warmup_steps is not None else min(500, total // 20),
        grad_clip=request.grad_clip,
        ema_decay=request.ema_decay,
        min_snr_gamma=request.min_snr_gamma,
        timestep_sampling=request.timestep_sampling or "uniform",
        precision=request.precision,
        compile=request.compile,
        seed=request.seed,
        checkpoint=request.checkpoint,
        save_every=request.save_every,
        sample_every=request.sample_every,
        world_size=ranks.world_size,
        cond_drop=request.cond_drop,
        grad_checkpoint=request.grad_checkpoint,
    )
    trainer = Trainer(config, model_config, schedule_config, images=images, device=device, first_stage=stage)
    if start is not None:  # the model and its EMA both start from the file's (EMA) weights
        trainer.model.load_state_dict(start.state_dict())
        trainer.ema.load_state_dict(start.state_dict())
    what = "volumes" if model_config.dims == 3 else "images" if stage is None else "images' latents"
    distributed.say(
        f"training {count_parameters(trainer.model) / 1e6:.2f}M-parameter U-Net on {len(images)} {spec.dataset} "
        f"{what} ({'x'.join(map(str, model_config.sample_shape(1)[1:]))}) "
        f"for {total} steps on {device.type}, {request.precision}"
        + (f", {trainer.step_layout}" if trainer.step_layout else "")
        + f"{on_ranks(config)}"
        + (f", starting from {request.init_from}" if start is not None else "")
        + (
            f", conditioned on {len(images.class_names)} classes ({config.cond_drop:.0%} of labels dropped)"
            if model_config.num_classes
            else ""
        )
    )
    return trainer


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
    requests.check_previews_folder; again here, against the inputs the model file named). Only names that
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


def train(trainer, request, *, inputs: dict) -> None:
    """The loop of a built ``trainer`` for ``request`` (its --profile, --log_dir): the preview grids and curves
    checked as outputs against the run's ``inputs`` (every file it reads) before the first step, a few steps
    traced with --profile (util/profiling.py), the curves closed however the loop ends (removed with the log
    folder this run created when it fails: curves.py). On Ctrl-C or SIGTERM it saves a whole step's state, then
    exits 130 or 143; a run stopped before its first step saves nothing, so the file it would replace stays."""
    check_previews(trainer, inputs=inputs, flag="--output" if "--output" in inputs else "--model_path")
    curves = training_log(trainer, request, inputs=inputs)
    start, ranks = trainer.step, distributed.current()
    profile = None
    if request.profile and trainer.config.total_steps > start:
        run_name = f"train-rank{ranks.rank}" if ranks.distributed else "train"
        profile = ProfileConfig(request.profile, run_name=run_name, total_steps=trainer.config.total_steps - start)
    failed = False
    try:
        with make_profiler(profile, device=trainer.device, log=tqdm.write) as profiler:
            trainer.run(profiler=profiler, curves=curves)
    except KeyboardInterrupt as exc:  # the step is whole: save it (its curves go with the checkpoint)
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
    except Exception:
        failed = True
        raise
    finally:
        if curves is not None:
            curves.close(failed=failed)  # a failed run leaves no log folder it created (its line: nothing partial)


def run_train_autoencoder(request: AutoencoderTrainRequest) -> None:
    """The first stage of a latent model, in the run every training mode shares (training_run above): its own
    loop, no curves, and an existing checkpoint replaced only with --overwrite (there is no --resume)."""
    with training_run(request.checkpoint, flag="--model_path", overwrite=request.overwrite):
        try:
            train_autoencoder(request)
        except messages.Interrupted as stop:  # what was trained is saved and said (training/autoencoder_trainer.py)
            raise SystemExit(stop.exit_code) from None
