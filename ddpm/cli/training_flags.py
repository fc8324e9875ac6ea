"""The training group of the flag table (flags.py assembles the groups, in --help's order): how long a run is
and its optimizer, what each step learns, and where a run starts from and what it writes besides its checkpoint.
A value is checked here only for its form, as in flags.py. This module imports nothing heavy.
"""

from __future__ import annotations

from ddpm.choices import (
    AUTOENCODER_DEFAULTS,
    DISTILL_DEFAULTS,
    DISTILL_MAX_STEPS_BY_STEPS,
    DRAW_BATCH,
    TIMESTEP_SAMPLERS,
    TRAIN_EPOCHS,
    TRAINING_DEFAULTS,
)
from ddpm.cli.reads import TRAIN, TRAINING_STEPS, Flag, finite_float, flag


def by_data(name: str, *, shown=str) -> str:
    """A new training run's default of ``--name`` for images and for volumes, as --help says it."""
    images, volumes = (shown(TRAINING_DEFAULTS[kind][name]) for kind in ("images", "volumes"))
    return f"{images} images, {volumes} volumes"


def training_flags() -> tuple[Flag, ...]:
    """The training group's flags, in --help's order."""
    return (*_training_length(), *_training_objective(), *_training_files())


def _training_length() -> tuple[Flag, ...]:
    """How long a training run is, and its optimizer."""
    steps = TRAINING_STEPS
    return (
        flag(
            "n_epochs",
            ("train", "train_autoencoder"),
            type=int,
            default=None,
            help=f"passes over the data (default {TRAIN_EPOCHS} where --max_steps is not given)",
            per_mode={
                "train_autoencoder": dict(
                    help=f"passes over the data (without it or --max_steps: {AUTOENCODER_DEFAULTS['max_steps']} steps)"
                )
            },
        ),
        flag(
            "max_steps",
            steps,
            type=int,
            default=None,
            help="optimizer steps: the run's length, or its cap with --n_epochs",
            per_mode={
                "distill": dict(
                    default=DISTILL_DEFAULTS["max_steps"],
                    help="the student's optimizer steps: "
                    + ", ".join(f"{n} for {s} U-Net call(s)" for s, n in DISTILL_MAX_STEPS_BY_STEPS.items())
                    + ", otherwise (default: %(default)s)",
                )
            },
        ),
        flag(
            "batch_size",
            ("train", "sample", "evaluate", "benchmark", "train_autoencoder", "distill", "export"),
            type=int,
            default=None,
            help=f"training batch (default {by_data('batch_size')}); sampling draws --n_samples in batches of this "
            f"size (default {DRAW_BATCH})",
            per_mode={
                "train": dict(help=f"training batch (default {by_data('batch_size')})"),
                "train_autoencoder": dict(default=AUTOENCODER_DEFAULTS["batch_size"], help="training batch"),
                "sample": dict(default=DRAW_BATCH, help="draw --n_samples in batches of this size"),
                "evaluate": dict(default=DRAW_BATCH, help="draw --n_samples in batches of this size"),
                "benchmark": dict(
                    default=TRAINING_DEFAULTS["images"]["batch_size"], help="--bench training: the batch of each step"
                ),
                "distill": dict(default=DISTILL_DEFAULTS["batch_size"], help="the student's training batch"),
                "export": dict(
                    default=DRAW_BATCH, help="--precision int8: calibration trajectories run this many at a time"
                ),
            },
        ),
        flag(
            "lr",
            steps,
            type=finite_float,
            default=None,
            help=f"peak AdamW learning rate (default {by_data('lr', shown='{:g}'.format)})",
            per_mode={
                "train_autoencoder": dict(default=AUTOENCODER_DEFAULTS["lr"], help="peak AdamW learning rate"),
                "distill": dict(default=DISTILL_DEFAULTS["lr"], help="the student's peak AdamW learning rate"),
            },
        ),
        flag(
            "warmup_steps",
            TRAIN,
            type=int,
            default=None,
            help="linear warm-up (default: 5%% of the run, at most 500)",
        ),
        flag(
            "ema_decay",
            TRAIN,
            type=finite_float,
            default=None,
            help=f"the decay of the EMA weights (default {by_data('ema_decay')})",
            per_mode={
                "distill": dict(default=DISTILL_DEFAULTS["ema_decay"], help="the decay of the student's EMA weights")
            },
        ),
    )


def _training_objective() -> tuple[Flag, ...]:
    """What each step learns and how: the loss's weights and timesteps, clipping, labels dropped, checkpoints."""
    return (
        flag(
            "min_snr_gamma",
            ("train",),
            type=finite_float,
            default=None,
            help="weight each timestep's loss by min(SNR, gamma)/SNR (Min-SNR weighting; 5 is the paper's choice); "
            f"0: unweighted (default {by_data('min_snr_gamma', shown='{:g}'.format)})",
        ),
        flag("grad_clip", TRAIN, type=finite_float, default=1.0, help="gradient-norm clipping"),
        flag(
            "timestep_sampling",
            ("train",),
            choices=TIMESTEP_SAMPLERS,
            default=None,
            help="which timesteps each step trains on (a resumed run keeps its own): uniform (DDPM, the default; "
            "importance in the digits' recipe: --model_preset); "
            "importance (loss-aware, Nichol & Dhariwal 2021, unbiased); topk (mostly the K timesteps with the "
            "largest loss, unbiased); speed (SpeeD-style: fewer draws where the loss has converged, reweighted)",
        ),
        flag(
            "compile",
            ("train", "sample", "evaluate", "distill"),
            action="store_true",
            help="torch.compile the U-Net (training; and sampling with --implementation cuda)",
        ),
        flag(
            "cond_drop",
            ("train",),
            type=finite_float,
            default=0.1,
            help="with --class_cond: share of labels replaced by the null label, so the model also learns "
            "unconditional eps",
        ),
        flag(
            "grad_checkpoint",
            ("train",),
            action="store_true",
            help="recompute the residual blocks' activations in the backward pass: less memory (for 64^3 volumes on "
            "a small GPU), about a third more compute",
        ),
        flag(
            "save_every",
            TRAIN,
            type=int,
            default=1000,
            help="checkpoint every N steps (0: only at the end)",
            per_mode={
                "distill": dict(
                    default=DISTILL_DEFAULTS["save_every"], help="checkpoint every N steps (0: only at the end)"
                )
            },
        ),
        flag("sample_every", ("train",), type=int, default=1000, help="sample grid every N steps (0: only at the end)"),
    )


def _training_files() -> tuple[Flag, ...]:
    """Where a run starts from and what it writes besides its checkpoint."""
    steps = TRAINING_STEPS
    return (
        flag(
            "resume",
            TRAIN,
            action="store_true",
            help="continue the run saved in --model_path exactly",
            per_mode={"distill": dict(help="continue the distillation saved in --output exactly")},
        ),
        flag(
            "init_from",
            ("train",),
            default=None,
            metavar="MODEL",
            help="fine-tune: a new run (into --model_path) that starts from MODEL's weights and takes its U-Net and "
            "noise schedule: a checkpoint, a .safetensors export or a diffusers model folder (fresh optimizer, step 0)",
        ),
        flag(
            "overwrite",
            (*steps, "export"),
            action="store_true",
            help="start over and replace an existing --model_path and its training curves (without it, refused)",
            per_mode={
                "distill": dict(help="start over and replace an existing --output (without it, refused)"),
                "export": dict(help="--format diffusers: replace an --output folder that holds a model, whole"),
            },
        ),
        flag(
            "log_dir",
            TRAIN,
            default=None,
            metavar="DIR",
            help="training curves: DIR/metrics.csv (step, loss, lr, grad_norm, images_per_s, skipped_steps, "
            "wall_time) and, with the tensorboard package, TensorBoard event files with the preview grids (view: "
            "tensorboard --logdir DIR); --resume appends to them (default: <model_path stem>_logs beside the "
            "checkpoint)",
            per_mode={"distill": dict(help="the student's training curves (metrics.csv; TensorBoard events)")},
        ),
        flag(
            "log_every",
            TRAIN,
            type=int,
            default=10,
            help="a row of training curves every N steps (loss and gradient norm: the means over those steps) and at "
            "the end",
        ),
    )
