"""A new training run's recipe where the flags leave it out: ddpm/choices.py's TRAINING_DEFAULTS for the kind of data,
and the measured DIGITS_RECIPE for the digits (for the 28x28 digits on any device, a latent model and the autoencoder
its run trains first; in pixels, on a CPU only); a distillation's method for its step count."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ddpm.requests import AutoencoderTrainRequest, NewModel


def training_recipe(args: argparse.Namespace, device: torch.device) -> dict:
    """The defaults of --batch_size, --lr, --ema_decay and --min_snr_gamma for this run, with "digits_recipe": True
    where choices.DIGITS_RECIPE applies (then also written into ``args`` for the model's flags and the timestep
    sampler)."""
    return {**training_defaults(args.dataset), **_digits_recipe(args, device)}


def _digits_recipe(args: argparse.Namespace, device: torch.device) -> dict:
    """choices.DIGITS_RECIPE where it applies (a new model of the digits, none of its flags given: the latent model of
    the 28x28 digits on any device, a pixel model on a CPU only), written into ``args`` for the model's flags, with
    "first_stage": True where the run is a latent model whose autoencoder it trains first; {} elsewhere."""
    from ddpm.choices import DIGITS_RECIPE, LATENT_RECIPE, LATENT_RECIPE_DATASETS, RECIPE_DATASETS
    from ddpm.data.catalog import default_shape

    new = not (args.resume or args.init_from or args.autoencoder)
    if args.dataset not in RECIPE_DATASETS or not new or args.given & {*DIGITS_RECIPE, "model_preset"}:
        return {}
    # The latent recipe was measured on the digits at their own shape; another --img_size, --channels or
    # --patch_size asks for a pixel model.
    size, channels = default_shape(args.dataset)
    latent = (
        args.dataset in LATENT_RECIPE_DATASETS
        and args.img_size in (None, size)
        and args.channels in (None, channels)
        and args.patch_size in (None, 1)
    )
    if not latent and device.type != "cpu":  # the pixel recipe was measured on CPUs only
        return {}
    args.model_channels, args.num_res_blocks = DIGITS_RECIPE["model_channels"], DIGITS_RECIPE["num_res_blocks"]
    args.timestep_sampling = DIGITS_RECIPE["timestep_sampling"]
    if latent and "dropout" not in args.given:
        args.dropout = LATENT_RECIPE["dropout"]
    return {**(LATENT_RECIPE if latent else DIGITS_RECIPE), "digits_recipe": True, "first_stage": latent}


def first_stage_request(args: argparse.Namespace, device: torch.device, *, checkpoint: str) -> AutoencoderTrainRequest:
    """The autoencoder that a run of the digits recipe's latent model trains before its U-Net (FIRST_STAGE_RECIPE),
    written beside ``checkpoint``: checkpoints/mnist.pt -> checkpoints/mnist_autoencoder.pt."""
    from ddpm.choices import FIRST_STAGE_RECIPE
    from ddpm.data.catalog import default_shape
    from ddpm.requests import AutoencoderTrainRequest, reconstructions_path

    path = Path(checkpoint)
    autoencoder = str(path.with_name(f"{path.stem}_autoencoder.pt"))
    size, channels = default_shape(args.dataset)
    return AutoencoderTrainRequest(
        device=device,
        checkpoint=autoencoder,
        reconstructions=reconstructions_path(autoencoder),
        overwrite=args.overwrite,
        dataset=args.dataset,
        data_dir=args.data_dir,
        image_size=size,
        channels=channels,
        seed=args.seed,
        max_steps=FIRST_STAGE_RECIPE["max_steps"],
        batch_size=FIRST_STAGE_RECIPE["batch_size"],
        lr=FIRST_STAGE_RECIPE["lr"],
        base_channels=FIRST_STAGE_RECIPE["ae_channels"],
    )


def new_model(args: argparse.Namespace) -> NewModel:
    """The new U-Net and schedule the flags describe (a latent model's size and channels: 0, its autoencoder's)."""
    from ddpm.data.catalog import default_shape
    from ddpm.requests import NewModel

    size, channels = default_shape(args.dataset)
    if getattr(args, "autoencoder", None):
        size = channels = (
            0  # a latent model's: its autoencoder's, unless the flags name others (refused if they differ)
        )
    return NewModel(
        dataset=args.dataset,
        data_dir=args.data_dir,
        image_size=size if args.img_size is None else args.img_size,
        channels=channels if args.channels is None else args.channels,
        preset=args.model_preset,
        model_channels=args.model_channels,
        num_res_blocks=args.num_res_blocks,
        dropout=args.dropout,
        time_conditioning=args.time_conditioning,
        patch_size=args.patch_size,
        beta_schedule=args.beta_schedule,
        timesteps=args.timesteps,
    )


def training_defaults(dataset: str) -> dict:
    """A new training run's recipe for ``dataset``'s kind of data (ddpm/choices.py: TRAINING_DEFAULTS)."""
    from ddpm.choices import TRAINING_DEFAULTS
    from ddpm.data.catalog import VOLUME_DATASETS

    return TRAINING_DEFAULTS["volumes" if dataset in VOLUME_DATASETS else "images"]


def distill_defaults(args: argparse.Namespace) -> None:
    """Set --mode distill's defaults per --sampling_steps where not given: --distill_method, the measured
    best (choices.DISTILL_METHOD_BY_STEPS), and a new run's --max_steps (choices.DISTILL_MAX_STEPS_BY_STEPS; a
    resumed run keeps its own length)."""
    from ddpm.choices import DISTILL_MAX_STEPS_BY_STEPS, DISTILL_METHOD_BY_STEPS

    if args.distill_method is None:
        args.distill_method = DISTILL_METHOD_BY_STEPS.get(args.sampling_steps, "regression")
    if "max_steps" not in args.given and not args.resume:
        args.max_steps = DISTILL_MAX_STEPS_BY_STEPS.get(args.sampling_steps, args.max_steps)
