"""The command line: every flag, its type and help, resolved once into a typed request per mode.

    mode, request = cli.parse(["--mode", "sample", "--n_samples", "4"])   # -> ("sample", SampleRequest(...))

``main.py`` runs a mode on its request; below main.py nothing reads an argparse Namespace. The
requests hold resolved values (the device, the precision, default paths, registry names, the
sampler plan's parameters), and every flag error a user can make is a ``ValueError`` raised here,
before any file is read or written. Most of the file is the flags' help text, kept beside each flag
(the request types are in mode_requests.py).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from conditioning import DEFAULT_GUIDANCE, check_scale
from safe_files import check_outputs  # every output checked before any work

from mode_requests import (
    AutoencoderTrainRequest,
    BenchmarkRun,
    EngineFlags,
    EvaluateRequest,
    ExportRequest,
    ModelSource,
    NewModel,
    SampleRequest,
    SamplingChoice,
    TrainRequest,
)

if TYPE_CHECKING:
    import torch

PROG = "main.py"
SEED_MAX = 2**63 - 1
MODES = ("train", "sample", "evaluate", "benchmark", "export", "train_autoencoder")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), like every other user error here."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def name_list(choices):
    """An argparse type: one name from ``choices``, or a comma-separated list of them (kept as text)."""

    def parse(text: str) -> str:
        names = [n.strip() for n in text.split(",")]
        if not all(names) or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), got {text!r}")
        return ",".join(names)

    return parse


def int_list(text: str) -> str:
    """An argparse type: a positive integer, or a comma-separated list of them (kept as text)."""
    items = [n.strip() for n in text.split(",")]
    if not all(n.isdigit() and int(n) > 0 for n in items):
        raise argparse.ArgumentTypeError(f"must be a positive integer or a comma-separated list of them, got {text!r}")
    return ",".join(items)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**63 - 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from artifacts import FORMATS
    from basic_diffusion import PRESETS, TIME_CONDITIONING
    from data import DATASETS
    from implementations import REGISTRY, SAMPLE_IMPLEMENTATIONS
    from noise_schedule import SAMPLERS, SCHEDULES
    from precision import PRECISIONS
    from timestep_sampling import TIMESTEP_SAMPLERS
    from tensorrt_integration import BACKENDS
    from unet_io import DEFAULT_MAX_BATCH

    p = Parser(
        prog=PROG,
        description="Train a DDPM on small images, draw sample grids, and compare sampling implementations.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="train",
        help="what to do (evaluate: sample quality against the training data, for a list of samplers and steps; "
        "train_autoencoder: the first stage of a latent model)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto picks CUDA when available")
    p.add_argument("--seed", type=seed, default=0, help="seed for weights, data order, noise and sampling")
    p.add_argument(
        "--precision",
        choices=("auto", *PRECISIONS),
        default="auto",
        help="autocast precision; auto = bf16 for training on a GPU that supports it, fp32 otherwise "
        "(sampling: fp32, so every implementation draws the same images)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="train, sample, benchmark: record a torch.profiler trace of a few steps into DIR/<run>/plugins/profile/ "
        "(view: tensorboard --logdir DIR, or the .pt.trace.json in ui.perfetto.dev) and print the top operations",
    )
    p.add_argument(
        "--model_path",
        default=None,
        help="checkpoint to write (train) or read (sample, export); sample also reads exported .ts, .onnx and "
        ".engine/.plan files; default checkpoints/<dataset>.pt (train_autoencoder: checkpoints/<dataset>_autoencoder.pt)",
    )

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default=None, help="default mnist; digits = offline handwritten digits (scikit-learn); spheres = 3-D voxel spheres drawn from a seed "
        "(offline; --img_size 16, 32 or 64 voxels a side); voxels = your own .npy volumes under --data_dir; "
        "evaluate: a model's own training data (what its checkpoint or export records) unless given")
    g.add_argument("--data_dir", default="./data", help="download folder, or your images with --dataset folder")
    g.add_argument("--img_size", type=int, default=None, help="training image size (default: the dataset's)")
    g.add_argument("--channels", type=int, default=None, help="1 or 3 (default: the dataset's)")

    g = p.add_argument_group("model and schedule")
    g.add_argument("--model_preset", choices=PRESETS, default="small", help="small suits MNIST; ddpm_cifar10 = Ho et al.'s 35.7M U-Net")
    g.add_argument("--model_channels", type=int, default=None, help="override the preset's base width")
    g.add_argument("--num_res_blocks", type=int, default=None, help="override the preset's residual blocks per level")
    g.add_argument("--dropout", type=finite_float, default=None, help="override the preset's dropout")
    g.add_argument(
        "--time_conditioning", choices=TIME_CONDITIONING, default=None,
        help="how residual blocks take the timestep: scale_shift (the small preset's default) modulates the normalized "
        "features; add is the older bias before the norm (the ddpm_cifar10 preset's, as in the paper)",
    )
    g.add_argument(
        "--patch_size", type=int, default=None,
        help="fold P x P (x P) patches into channels before the U-Net and unfold them after: its layers then run on "
        "P^2 (P^3) times fewer positions (default: 2 for volumes of 32 or more voxels a side, else 1)",
    )  # fmt: skip
    g.add_argument(
        "--autoencoder", default=None, metavar="PATH",
        help="latent diffusion: train the U-Net on the latents of this autoencoder (--mode train_autoencoder makes one); "
        "when sampling, where a latent model's autoencoder is now if it moved",
    )  # fmt: skip
    g.add_argument("--beta_schedule", choices=SCHEDULES, default="linear")
    g = p.add_argument_group("autoencoder (--mode train_autoencoder: the first stage of a latent model)")
    g.add_argument("--latent_channels", type=int, default=None, help="channels of the latent (default 4)")
    g.add_argument(
        "--downsample", type=int, default=None, choices=(2, 4, 8),
        help="image side / latent side (default 4 from 16 pixels up, else 2; sides are padded to an even latent)",
    )  # fmt: skip
    g.add_argument("--ae_channels", type=int, default=None, help="the autoencoder's base width (default 32)")
    g.add_argument("--kl_weight", type=finite_float, default=None, help="weight of the KL term against L1 (default 1e-3)")
    g.add_argument("--timesteps", type=int, default=1000, help="diffusion steps T")

    g = p.add_argument_group("training")
    g.add_argument("--n_epochs", type=int, default=None, help="passes over the data (default 10)")
    g.add_argument("--max_steps", type=int, default=None, help="optimizer steps: the run's length, or its cap with --n_epochs")
    g.add_argument(
        "--batch_size", type=int, default=None,
        help="training batch (default 64 images, 16 volumes); sampling draws --n_samples in batches of this size (default 64)",
    )  # fmt: skip
    g.add_argument("--lr", type=finite_float, default=None, help="peak AdamW learning rate (default 2e-4 images, 1e-3 volumes and autoencoders)")
    g.add_argument("--warmup_steps", type=int, default=None, help="linear warm-up (default: 5%% of the run, at most 500)")
    g.add_argument("--ema_decay", type=finite_float, default=None, help="(default 0.999 images, 0.995 volumes)")
    g.add_argument(
        "--min_snr_gamma", type=finite_float, default=None,
        help="weight each timestep's loss by min(SNR, gamma)/SNR (Min-SNR weighting; 5 is the paper's choice); 0: unweighted "
        "(default: unweighted for images, 5 for volumes)",
    )
    g.add_argument("--grad_clip", type=finite_float, default=1.0, help="gradient-norm clipping")
    g.add_argument(
        "--timestep_sampling", choices=TIMESTEP_SAMPLERS, default=None,
        help="which timesteps each step trains on (a resumed run keeps its own): uniform (DDPM, the default); importance (loss-aware, Nichol & Dhariwal 2021, "
        "unbiased); topk (mostly the K timesteps with the largest loss, unbiased); speed (SpeeD-style: fewer draws "
        "where the loss has converged, reweighted)",
    )  # fmt: skip
    g.add_argument(
        "--compile", action="store_true", help="torch.compile the U-Net (training; and sampling with --implementation cuda)"
    )
    g.add_argument(
        "--class_cond", action="store_true",
        help="train a class-conditional model on the dataset's labels (a folder's sub-folder names are its classes)",
    )  # fmt: skip
    g.add_argument(
        "--cond_drop", type=finite_float, default=0.1,
        help="with --class_cond: share of labels replaced by the null label, so the model also learns unconditional eps",
    )  # fmt: skip
    g.add_argument(
        "--grad_checkpoint", action="store_true",
        help="recompute the residual blocks' activations in the backward pass: less memory (for 64^3 volumes on a "
        "small GPU), about a third more compute",
    )  # fmt: skip
    g.add_argument("--save_every", type=int, default=1000, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--sample_every", type=int, default=1000, help="sample grid every N steps (0: only at the end)")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --model_path exactly")
    g.add_argument(
        "--overwrite", action="store_true", help="start over and replace an existing --model_path (without it, refused)"
    )

    g = p.add_argument_group("sampling")
    g.add_argument("--implementation", choices=SAMPLE_IMPLEMENTATIONS, default="original")
    g.add_argument("--n_samples", type=int, default=16, help="images to draw")
    g.add_argument(
        "--sampler",
        type=name_list(SAMPLERS),
        default="ddpm",
        help=f"{', '.join(SAMPLERS)}; --mode evaluate takes a comma-separated list",
    )
    g.add_argument(
        "--sampling_steps",
        type=int_list,
        default=None,
        help="default: T for ddpm, 50 for ddim, 20 for dpm_solver and dpm_solver_sde; --mode evaluate takes a "
        "comma-separated list",
    )
    g.add_argument("--eta", type=finite_float, default=0.0, help="DDIM stochasticity (0 = deterministic)")
    g.add_argument(
        "--class_label", default=None, metavar="LABELS",
        help="class-conditional models: a class (index or name), a comma-separated list (the samples split evenly, "
        "one grid row each), or all (one grid row per class); default all",
    )  # fmt: skip
    g.add_argument(
        "--guidance_scale", type=finite_float, default=None, metavar="W",
        help="class-conditional models: classifier-free guidance, eps = eps_uncond + W (eps_cond - eps_uncond); "
        f"1 = the conditional model unguided, 0 = unconditional (default {DEFAULT_GUIDANCE})",
    )  # fmt: skip
    g.add_argument("--no_clip", action="store_true", help="do not clip predicted x0 to [-1, 1] (latent models never do)")
    g.add_argument("--no_ema", action="store_true", help="sample (or export) the raw weights instead of the EMA")
    g.add_argument(
        "--output",
        default=None,
        help="sample: the PNG grid (default samples.png); export: the file (default: beside the checkpoint)",
    )
    g.add_argument("--save_npz", default=None, help="also save the images (uint8, NHWC) to this .npz file")
    g.add_argument("--no_grid", action="store_true", help="write no PNG grid (with --save_npz: for many samples)")
    g.add_argument(
        "--grid_scale", type=positive_int, default=None,
        help="enlarge the grid N times, nearest neighbour (default: tiles of at least 64 pixels, e.g. x8 for 8x8 digits)",
    )
    g.add_argument(
        "--trust_torchscript",
        action="store_true",
        help="allow a TorchScript (.ts) --model_path: it is a program, and loading it runs its code",
    )

    g = p.add_argument_group("export and TensorRT")
    g.add_argument("--format", choices=FORMATS, default="onnx", help="what --mode export writes")
    g.add_argument(
        "--opset",
        type=int,
        default=None,
        help="ONNX opset, 18-25 (default: 21, native GroupNormalization; 22 for bf16 graphs; for TensorRT, "
        "chosen from its version)",
    )
    g.add_argument("--trt_backend", choices=BACKENDS, default="native", help="native engines or torch_tensorrt.compile")
    g.add_argument("--max_batch", type=int, default=DEFAULT_MAX_BATCH, help="largest batch a TensorRT engine takes")
    g.add_argument("--trt_opt_level", type=int, default=3, help="TensorRT builder optimization level, 0-5")
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--bench", choices=("sampling", "training"), default="sampling", help="time sampling implementations, or training steps"
    )
    g.add_argument("--train_steps", type=int, default=20, help="timed optimizer steps per training row")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per row (median and min-max reported)")
    g.add_argument("--warmup", type=int, default=1, help="untimed runs per row before timing")
    g.add_argument("--json", default=None, help="write the results as JSON here (benchmark, evaluate)")
    g.add_argument("--csv", default=None, help="write the result rows as CSV here")
    g.add_argument(
        "--chart", default=None, help="write a chart PNG here (benchmark: time per row; evaluate: quality against steps)"
    )
    g.add_argument(
        "--rows",
        default="all",
        help=f"comma-separated rows to run, from {','.join(REGISTRY)} (default all; original always runs: it is the "
        "reference); with --bench training, from fp32,fp32_compile,amp,amp_compile,fp32_checkpoint,amp_checkpoint,"
        "t_<sampler> (fp32 always runs)",
    )
    g = p.add_argument_group("evaluate")
    g.add_argument(
        "--inception_weights", default=None,
        help="FID/KID (MNIST, Fashion-MNIST, CIFAR-10, folders): a local copy of torch-fidelity's Inception "
        "weights (default: torch hub's cache, downloaded once)",
    )
    return p


# ----- from flags to requests --------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> tuple[str, object]:
    """The mode and its request, with every flag checked; argparse errors exit 2 on their own."""
    args = build_parser().parse_args(argv)
    return args.mode, request_for(args)


def request_for(args: argparse.Namespace) -> object:
    """The request of ``args.mode``: flags resolved and checked (a ValueError names the flag)."""
    if args.opset is not None:
        from export import check_opset

        check_opset(args.opset)
    check_profile_dir(args)  # checked once, for every mode: the builders pass args.profile on
    args.dataset_given = args.dataset is not None  # evaluate: else the data the model file records
    args.dataset = args.dataset or "mnist"
    if args.batch_size is None:
        args.batch_size = training_defaults(args.dataset)["batch_size"] if args.mode == "train" else 64
    return REQUESTS[args.mode](args, resolve_device(args.device))


# A new training run's defaults for images and for volumes: a 32^3 spheres model learns its shapes in the
# CPU minutes that the images' defaults spend on a quarter of the steps (BENCHMARKS.md, "3-D volumes").
TRAINING_DEFAULTS = {
    "images": dict(batch_size=64, lr=2e-4, ema_decay=0.999, min_snr_gamma=0.0),
    "volumes": dict(batch_size=16, lr=1e-3, ema_decay=0.995, min_snr_gamma=5.0),
}


def training_defaults(dataset: str) -> dict:
    from data import VOLUME_DATASETS

    return TRAINING_DEFAULTS["volumes" if dataset in VOLUME_DATASETS else "images"]


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but PyTorch sees no CUDA GPU here (use --device cpu)")
    return torch.device(name)


def check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")


def check_suffix(flag: str, path: str | None, suffix: str) -> None:
    """A file name's ending; a folder is left to safe_files.check_outputs, which says so."""
    if path is not None and Path(path).suffix.lower() != suffix and not Path(path).is_dir():
        raise ValueError(f"{flag} needs a file name ending in {suffix}, got {path}")


def _precision(args: argparse.Namespace, purpose: str, device: torch.device) -> str:
    from precision import resolve

    return resolve(args.precision, purpose=purpose, device=device)


def _single(args: argparse.Namespace) -> SamplingChoice:
    """Outside --mode evaluate, --sampler and --sampling_steps name one value."""
    for flag, value in (("--sampler", args.sampler), ("--sampling_steps", args.sampling_steps)):
        if value is not None and "," in value:
            raise ValueError(f"{flag} takes one value in --mode {args.mode} (lists are for --mode evaluate), got {value}")
    steps = int(args.sampling_steps) if args.sampling_steps is not None else None
    return SamplingChoice(sampler=args.sampler, steps=steps, eta=args.eta, clip_denoised=not args.no_clip)


def check_profile_dir(args: argparse.Namespace) -> None:
    """--profile DIR: a folder (made if missing), never a file; only for train, sample and benchmark."""
    if args.profile is None:
        return
    if args.mode not in ("train", "sample", "benchmark"):
        raise ValueError(f"--profile applies to --mode train, sample and benchmark, not {args.mode}")
    if Path(args.profile).exists() and not Path(args.profile).is_dir():
        raise ValueError(f"--profile {args.profile} is a file; it names the folder the traces go into")
    existing = Path(args.profile).absolute()
    while not existing.exists():  # the folder, or the nearest one that exists (the rest is made)
        existing = existing.parent
    try:  # a probe, as for every output: modes, read-only file systems and /proc all answer it
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".profile-probe-")
    except OSError as exc:
        raise ValueError(f"--profile {args.profile}: cannot write into {existing} ({exc.strerror})") from exc
    os.close(fd)
    os.unlink(probe)


def _model_path(args: argparse.Namespace) -> str:
    return args.model_path or f"checkpoints/{args.dataset}.pt"


def _source(args: argparse.Namespace, path: str | None = None) -> ModelSource:
    return ModelSource(
        path=path or _model_path(args), weights="model" if args.no_ema else "ema", trust_torchscript=args.trust_torchscript,
        autoencoder=args.autoencoder,
    )  # fmt: skip


def _new_model(args: argparse.Namespace) -> NewModel:
    from data import default_shape

    size, channels = default_shape(args.dataset)
    if getattr(args, "autoencoder", None):
        size = channels = 0  # a latent model's: its autoencoder's, unless the flags name others (refused if they differ)
    return NewModel(
        dataset=args.dataset,
        data_dir=args.data_dir,
        image_size=args.img_size or size,
        channels=args.channels or channels,
        preset=args.model_preset,
        model_channels=args.model_channels,
        num_res_blocks=args.num_res_blocks,
        dropout=args.dropout,
        time_conditioning=args.time_conditioning,
        patch_size=args.patch_size,
        beta_schedule=args.beta_schedule,
        timesteps=args.timesteps,
    )


def _engine(args: argparse.Namespace) -> EngineFlags:
    return EngineFlags(
        backend=args.trt_backend, max_batch=args.max_batch, optimization_level=args.trt_opt_level, opset=args.opset
    )


def _implementation(args: argparse.Namespace) -> str:
    """The registry entry --implementation names: with --compile, cuda is cuda_compile (the U-Net
    through torch.compile inside the graph); --compile applies to no other implementation."""
    if args.compile and args.implementation != "cuda":
        raise ValueError("--compile applies to training and to sampling with --implementation cuda")
    return "cuda_compile" if args.compile else args.implementation


def _draw_fields(args: argparse.Namespace, device: torch.device, source: ModelSource) -> dict:
    """The fields of a DrawRequest (sample and evaluate mode)."""
    return dict(
        device=device,
        precision=_precision(args, "sampling", device),  # auto is fp32: the original's images
        source=source,
        implementation=_implementation(args),
        n_samples=args.n_samples,
        batch_size=args.batch_size,
        seed=args.seed,
        opset=args.opset,
        engine=_engine(args),
        class_label=args.class_label,
        guidance_scale=None if args.guidance_scale is None else check_scale(args.guidance_scale),
    )


def dataset_channels(args: argparse.Namespace) -> int:
    """The channels of ``--dataset``'s images: ``--channels`` where it fits them (any for a folder), else a
    one-line ValueError."""
    from data import default_shape

    channels = default_shape(args.dataset)[1]
    if args.channels and args.channels != channels and args.dataset != "folder":
        raise ValueError(f"{args.dataset} images have {channels} channel(s); --channels {args.channels} does not fit")
    return args.channels or channels


def train_request(args: argparse.Namespace, device: torch.device) -> TrainRequest:
    from data import VOLUME_DATASETS

    _single(args)
    check_positive(n_epochs=args.n_epochs, max_steps=args.max_steps, batch_size=args.batch_size)
    checkpoint = _model_path(args)
    if Path(checkpoint).suffix != ".pt" or Path(checkpoint).is_dir():
        raise ValueError(f"--model_path must name a .pt checkpoint file (sampling and export expect one), got {checkpoint}")
    if args.autoencoder and args.dataset in VOLUME_DATASETS:
        raise ValueError("--autoencoder: latent models are for images; volumes train in voxel space")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the checkpoint and --overwrite replaces it; choose one")
    if args.resume and args.class_cond:
        raise ValueError("--class_cond makes a new model; a resumed run keeps the one in its checkpoint")
    for flag in ("time_conditioning", "patch_size"):
        if args.resume and getattr(args, flag) is not None:
            raise ValueError(f"--{flag} makes a new model; a resumed run keeps the one in its checkpoint")
    if not 0.0 <= args.cond_drop <= 1.0:
        raise ValueError(f"--cond_drop must be between 0 and 1, got {args.cond_drop}")
    check_outputs({"--model_path": checkpoint}, inputs={"--autoencoder": args.autoencoder} if args.autoencoder else None)
    recipe = training_defaults(args.dataset)
    min_snr_gamma = recipe["min_snr_gamma"] if args.min_snr_gamma is None else args.min_snr_gamma
    if min_snr_gamma < 0:
        raise ValueError(f"--min_snr_gamma must be positive, or 0 for the unweighted loss, got {min_snr_gamma}")
    if not args.resume:
        dataset_channels(args)
    return TrainRequest(
        device=device,
        precision=_precision(args, "training", device),
        checkpoint=checkpoint,
        resume=args.resume,
        overwrite=args.overwrite,
        model=_new_model(args),
        autoencoder=args.autoencoder,
        seed=args.seed,
        n_epochs=args.n_epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        lr=recipe["lr"] if args.lr is None else args.lr,
        warmup_steps=args.warmup_steps,
        ema_decay=recipe["ema_decay"] if args.ema_decay is None else args.ema_decay,
        min_snr_gamma=min_snr_gamma or None,  # 0: unweighted
        timestep_sampling=args.timestep_sampling,
        class_cond=args.class_cond,
        cond_drop=args.cond_drop,
        grad_checkpoint=args.grad_checkpoint,
        grad_clip=args.grad_clip,
        compile=args.compile,
        save_every=args.save_every,
        sample_every=args.sample_every,
        profile=args.profile,
    )


def sample_request(args: argparse.Namespace, device: torch.device) -> SampleRequest:
    sampling = _single(args)
    check_positive(n_samples=args.n_samples, sampling_steps=sampling.steps, batch_size=args.batch_size)
    if args.no_grid and args.output:
        raise ValueError("--no_grid writes no PNG, so --output has nothing to name; drop one of them")
    if args.no_grid and not args.save_npz:
        raise ValueError("--no_grid writes no PNG, so nothing would be saved; add --save_npz FILE.npz")
    grid = None if args.no_grid else (args.output or "samples.png")
    source = _source(args)  # a checkpoint or an exported U-Net (.ts, .onnx, .engine/.plan)
    check_outputs({"--output": grid, "--save_npz": args.save_npz}, inputs={"--model_path": source.path})
    check_suffix("--output (the PNG grid)", grid, ".png")
    check_suffix("--save_npz", args.save_npz, ".npz")
    return SampleRequest(
        **_draw_fields(args, device, source), sampling=sampling, grid=grid, npz=args.save_npz,
        grid_scale=args.grid_scale, profile=args.profile,
    )  # fmt: skip


def evaluate_request(args: argparse.Namespace, device: torch.device) -> EvaluateRequest:
    import evaluate
    from noise_schedule import SAMPLERS

    check_positive(n_samples=args.n_samples, batch_size=args.batch_size)
    source = _source(args)
    check_outputs({"--json": args.json, "--chart": args.chart}, inputs={"--model_path": source.path})
    check_suffix("--json", args.json, ".json")
    check_suffix("--chart", args.chart, ".png")
    if args.inception_weights is not None and not Path(args.inception_weights).is_file():
        raise ValueError(f"--inception_weights {args.inception_weights} is not a file")
    return EvaluateRequest(
        **_draw_fields(args, device, source),
        samplers=evaluate.parse_list(args.sampler, kind=str, flag="--sampler", choices=SAMPLERS),
        steps=evaluate.parse_list(args.sampling_steps, kind=int, flag="--sampling_steps"),
        dataset=args.dataset if args.dataset_given else None,
        data_dir=args.data_dir,
        inception_weights=args.inception_weights,
        eta=args.eta,
        clip_denoised=not args.no_clip,
        json=args.json,
        chart=args.chart,
    )


def export_request(args: argparse.Namespace, device: torch.device) -> ExportRequest:
    import artifacts
    from engine_cache import metadata_path

    _single(args)
    source = _source(args)
    output = args.output or str(artifacts.default_output(source.path, args.format))
    outputs = {"--output": output}
    if args.format == "tensorrt":
        outputs["--output's metadata"] = metadata_path(output)
    check_outputs(outputs, inputs={"--model_path": source.path})
    return ExportRequest(
        device=device,
        precision=_precision(args, "export", device),
        source=source,
        fmt=args.format,
        output=output,
        opset=args.opset,
        engine=_engine(args),
    )


def benchmark_request(args: argparse.Namespace, device: torch.device) -> BenchmarkRun:
    import benchmark

    sampling = _single(args)
    check_positive(n_samples=args.n_samples, sampling_steps=sampling.steps, batch_size=args.batch_size)
    if args.autoencoder and not args.model_path:
        raise ValueError("--autoencoder goes with a latent model's checkpoint (--model_path); a fresh U-Net is a pixel model")
    request = benchmark.BenchmarkRequest(
        rows=args.rows, repeats=args.repeats, warmup=args.warmup, seed=args.seed, train_steps=args.train_steps,
        batch_size=args.batch_size, json=args.json, csv=args.csv, chart=args.chart, profile=args.profile,
    )  # fmt: skip
    outputs = {"--json": args.json}
    if args.bench == "sampling":
        outputs.update({"--csv": args.csv, "--chart": args.chart})
    check_outputs(outputs, inputs={"--model_path": args.model_path})
    return BenchmarkRun(
        device=device,
        precision=_precision(args, "sampling", device),
        bench=args.bench,
        request=request,
        source=_source(args, args.model_path) if args.model_path else None,
        model=_new_model(args),
        sampling=sampling,
        n_samples=args.n_samples,
        batch_size=args.batch_size,
        seed=args.seed,
        guidance_scale=None if args.guidance_scale is None else check_scale(args.guidance_scale),
    )


def train_autoencoder_request(args: argparse.Namespace, device: torch.device) -> AutoencoderTrainRequest:
    from autoencoder_training import reconstructions_path
    from data import VOLUME_DATASETS, default_shape

    if args.dataset in VOLUME_DATASETS:
        raise ValueError(f"--mode train_autoencoder is for images; {args.dataset} holds 3-D volumes")
    if args.autoencoder:
        raise ValueError("--autoencoder names a latent model's first stage; --mode train_autoencoder makes one (drop it)")
    if args.resume:
        raise ValueError("--mode train_autoencoder has no --resume (a run is a few minutes); start over with --overwrite")
    if args.precision not in ("auto", "fp32"):
        raise ValueError(f"--mode train_autoencoder trains in fp32; drop --precision {args.precision}")
    check_positive(n_epochs=args.n_epochs, max_steps=args.max_steps, batch_size=args.batch_size)
    checkpoint = args.model_path or f"checkpoints/{args.dataset}_autoencoder.pt"
    if Path(checkpoint).suffix != ".pt" or Path(checkpoint).is_dir():
        raise ValueError(f"--model_path must name a .pt checkpoint file, got {checkpoint}")
    png = reconstructions_path(checkpoint)
    check_outputs({"--model_path": checkpoint, "the reconstructions PNG": png})
    size, channels = default_shape(args.dataset)[0], dataset_channels(args)
    request = AutoencoderTrainRequest(
        device=device, checkpoint=checkpoint, reconstructions=png, overwrite=args.overwrite, dataset=args.dataset,
        data_dir=args.data_dir, image_size=args.img_size or size, channels=channels, seed=args.seed,
        n_epochs=args.n_epochs, max_steps=args.max_steps, batch_size=args.batch_size, lr=1e-3 if args.lr is None else args.lr,
        latent_channels=args.latent_channels, downsample=args.downsample, base_channels=args.ae_channels,
        kl_weight=args.kl_weight,
    )  # fmt: skip
    side = request.config().latent_side  # the image size, channels and shape flags checked before any data is read
    if side >= 8 and side % 4:
        raise ValueError(
            f"a {side}x{side} latent cannot be halved twice by the latent U-Net; pick --downsample so the latent side is "
            "a multiple of 4 (or at most 4)"
        )
    return request


REQUESTS = {
    "train": train_request,
    "sample": sample_request,
    "evaluate": evaluate_request,
    "export": export_request,
    "benchmark": benchmark_request,
    "train_autoencoder": train_autoencoder_request,
}
