"""--mode train: a new run (or --resume of one) from the request to the saved checkpoint.

    python main.py --mode train --dataset digits --max_steps 1500
    torchrun --nproc_per_node 4 main.py --mode train --dataset cifar10 --batch_size 128

The loop itself is training/trainer.py's and the run around it (locks, refusals, previews, curves, Ctrl-C
saving) modes/training_run.py's; this module builds the trainer (a new model, a resumed checkpoint, or a
latent model on its autoencoder's latents) and checks the batch fits.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from basic_diffusion import count_parameters
from ddpm.batch_memory import check_batch_fits
from ddpm.choices import CPU_LATENT_RECIPE, CPU_RECIPE, TRAIN_EPOCHS
from ddpm.data.datasets import data_input, load_images
from ddpm.formats.checkpoints import check_pixel_unet, load_checkpoint, read_configs, read_link
from ddpm.formats.model_files import load_model_parts
from ddpm.latent.first_stage import encode_dataset, linked_first_stage, load_first_stage
from ddpm.modes.training_run import resumed_config, train_logged, training_run
from ddpm.outputs import FIRST_STAGE
from ddpm.requests import AutoencoderTrainRequest, NewModel, TrainRequest
from ddpm.training.autoencoder_trainer import train_autoencoder
from ddpm.training.trainer import TrainConfig, Trainer, check_warmup
from ddpm.util import distributed
from ddpm.util.safe_files import as_input


def run_train(request: TrainRequest) -> None:
    run = dict(overwrite=request.overwrite, resume=request.resume, continues="it", log_dir=request.log_dir)
    with training_run(request.checkpoint, flag="--model_path", **run):
        if request.cpu_recipe:
            distributed.say(recipe_line(request))
        if request.first_stage is not None:
            train_first_stage(request.first_stage)
        trainer = resumed_trainer(request) if request.resume else new_trainer(request)
        train_logged(trainer, request, inputs=run_inputs(trainer, request))
    distributed.say(f"checkpoint: {request.checkpoint}")


def recipe_line(request: TrainRequest) -> str:
    """What the CPU's recipe trains, in one line (the flags left it to choices.CPU_RECIPE)."""
    applied = CPU_RECIPE if request.first_stage is None else CPU_LATENT_RECIPE
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
        f"the CPU's recipe for 28x28 digits (no model or recipe flag given): a latent model, first an autoencoder of "
        f"{stage.base_channels} base channels ({stage.max_steps} steps of {stage.batch_size}) into {stage.checkpoint}, "
        f"then the U-Net on its latents: {recipe}"
    )


def train_first_stage(stage: AutoencoderTrainRequest) -> None:
    """The CPU recipe's autoencoder, trained before the U-Net in the same run: an existing one is replaced only with
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
    """What --resume compares besides the recipe (modes/training_run.resumed_config), {flag: (ours, the
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
    """The training images at the autoencoder's size, encoded once into its scaled latents (latent/first_stage.py)."""

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
        f"{on_ranks(config)}"
        + (f", starting from {request.init_from}" if start is not None else "")
        + (
            f", conditioned on {len(images.class_names)} classes ({config.cond_drop:.0%} of labels dropped)"
            if model_config.num_classes
            else ""
        )
    )
    return trainer
