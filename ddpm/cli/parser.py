"""The command line's flags: every flag, its type, default and help, in one argparse parser.

    args = parse_args(["--mode", "sample", "--n_samples", "4"])
    request = resolve.request_for(args)            # cli/resolve.py: flags checked, one typed request

Most of the file is the flags' help text, kept beside each flag. argparse checks each value's type
(a positive count, a finite float, a seed in range, a name from its list); what depends on several
flags, on the mode or on the file system is resolve.py's, before any file is read.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

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


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**63 - 1, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: the command line), with ``given``: the flags written there, told
    apart from argparse's defaults (what a resumed run compares with its checkpoint)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    for action in parser._actions:  # parsed again without defaults, only what was written is left
        action.default = argparse.SUPPRESS
    args.given = frozenset(vars(parser.parse_known_args(argv)[0]))
    return args


def build_parser() -> argparse.ArgumentParser:
    from basic_diffusion import PRESETS, TIME_CONDITIONING
    from ddpm.backends.engine_cache import OPT_LEVELS
    from ddpm.backends.registry import REGISTRY, SAMPLE_IMPLEMENTATIONS
    from ddpm.conditioning import DEFAULT_GUIDANCE
    from ddpm.data.catalog import DATASETS
    from ddpm.formats.kinds import FORMATS
    from ddpm.formats.unet_io import DEFAULT_MAX_BATCH
    from ddpm.training.timestep_sampling import TIMESTEP_SAMPLERS
    from ddpm.util.precision import ALL_PRECISIONS
    from noise_schedule import SAMPLERS, SCHEDULES
    from tensorrt_integration import BACKENDS

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
        choices=("auto", *ALL_PRECISIONS),
        default="auto",
        help="autocast precision; auto = bf16 for training on a GPU that supports it, fp32 otherwise "
        "(sampling: fp32, so every implementation draws the same images); int8: an ONNX graph with INT8 "
        "convolutions (--mode export --format onnx, or --implementation onnxruntime), calibrated on the model's "
        "own sampling trajectories; fp8: the same for TensorRT on Hopper GPUs",
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
        help="checkpoint to write (train) or read (sample, export); sample also reads exported .ts, .onnx, "
        ".safetensors and .engine/.plan files, and a Hugging Face diffusers model folder (UNet2DModel + scheduler); "
        "default checkpoints/<dataset>.pt (train_autoencoder: checkpoints/<dataset>_autoencoder.pt)",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help="default mnist; digits = offline handwritten digits (scikit-learn); spheres = 3-D voxel spheres drawn "
        "from a seed "
        "(offline; --img_size 16, 32 or 64 voxels a side); voxels = your own .npy volumes under --data_dir; "
        "evaluate: a model's own training data (what its checkpoint or export records) unless given",
    )
    g.add_argument("--data_dir", default="./data", help="download folder, or your images with --dataset folder")
    g.add_argument("--img_size", type=int, default=None, help="training image size (default: the dataset's)")
    g.add_argument("--channels", type=int, default=None, help="1 or 3 (default: the dataset's)")

    g = p.add_argument_group("model and schedule")
    g.add_argument(
        "--model_preset",
        choices=PRESETS,
        default="small",
        help="small suits MNIST; ddpm_cifar10 = Ho et al.'s 35.7M U-Net",
    )
    g.add_argument("--model_channels", type=int, default=None, help="override the preset's base width")
    g.add_argument("--num_res_blocks", type=int, default=None, help="override the preset's residual blocks per level")
    g.add_argument("--dropout", type=finite_float, default=None, help="override the preset's dropout")
    g.add_argument(
        "--time_conditioning",
        choices=TIME_CONDITIONING,
        default=None,
        help="how residual blocks take the timestep: scale_shift (the small preset's default) modulates the normalized "
        "features; add is the older bias before the norm (the ddpm_cifar10 preset's, as in the paper)",
    )
    g.add_argument(
        "--patch_size",
        type=int,
        default=None,
        help="fold P x P (x P) patches into channels before the U-Net and unfold them after: its layers then run on "
        "P^2 (P^3) times fewer positions (default: 2 for volumes of 32 or more voxels a side, else 1)",
    )
    g.add_argument(
        "--autoencoder",
        default=None,
        metavar="PATH",
        help="latent diffusion: train the U-Net on the latents of this autoencoder (--mode train_autoencoder makes "
        "one); "
        "when sampling, where a latent model's autoencoder is now if it moved",
    )
    g.add_argument("--beta_schedule", choices=SCHEDULES, default="linear")
    g = p.add_argument_group("autoencoder (--mode train_autoencoder: the first stage of a latent model)")
    g.add_argument("--latent_channels", type=int, default=None, help="channels of the latent (default 4)")
    g.add_argument(
        "--downsample",
        type=int,
        default=None,
        choices=(2, 4, 8),
        help="image side / latent side (default 4 from 16 pixels up, else 2; sides are padded to an even latent)",
    )
    g.add_argument("--ae_channels", type=int, default=None, help="the autoencoder's base width (default 32)")
    g.add_argument(
        "--kl_weight", type=finite_float, default=None, help="weight of the KL term against L1 (default 1e-3)"
    )
    g.add_argument("--timesteps", type=int, default=1000, help="diffusion steps T")

    g = p.add_argument_group("training")
    g.add_argument("--n_epochs", type=int, default=None, help="passes over the data (default 10)")
    g.add_argument(
        "--max_steps", type=int, default=None, help="optimizer steps: the run's length, or its cap with --n_epochs"
    )
    g.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help="training batch (default 64 images, 16 volumes); sampling draws --n_samples in batches of this size "
        "(default 64)",
    )
    g.add_argument(
        "--lr",
        type=finite_float,
        default=None,
        help="peak AdamW learning rate (default 2e-4 images, 1e-3 volumes and autoencoders)",
    )
    g.add_argument(
        "--warmup_steps", type=int, default=None, help="linear warm-up (default: 5%% of the run, at most 500)"
    )
    g.add_argument("--ema_decay", type=finite_float, default=None, help="(default 0.999 images, 0.995 volumes)")
    g.add_argument(
        "--min_snr_gamma",
        type=finite_float,
        default=None,
        help="weight each timestep's loss by min(SNR, gamma)/SNR (Min-SNR weighting; 5 is the paper's choice); 0: "
        "unweighted "
        "(default: unweighted for images, 5 for volumes)",
    )
    g.add_argument("--grad_clip", type=finite_float, default=1.0, help="gradient-norm clipping")
    g.add_argument(
        "--timestep_sampling",
        choices=TIMESTEP_SAMPLERS,
        default=None,
        help="which timesteps each step trains on (a resumed run keeps its own): uniform (DDPM, the default); "
        "importance (loss-aware, Nichol & Dhariwal 2021, "
        "unbiased); topk (mostly the K timesteps with the largest loss, unbiased); speed (SpeeD-style: fewer draws "
        "where the loss has converged, reweighted)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the U-Net (training; and sampling with --implementation cuda)",
    )
    g.add_argument(
        "--class_cond",
        action="store_true",
        help="train a class-conditional model on the dataset's labels (a folder's sub-folder names are its classes)",
    )
    g.add_argument(
        "--cond_drop",
        type=finite_float,
        default=0.1,
        help="with --class_cond: share of labels replaced by the null label, so the model also learns unconditional "
        "eps",
    )
    g.add_argument(
        "--grad_checkpoint",
        action="store_true",
        help="recompute the residual blocks' activations in the backward pass: less memory (for 64^3 volumes on a "
        "small GPU), about a third more compute",
    )
    g.add_argument("--save_every", type=int, default=1000, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--sample_every", type=int, default=1000, help="sample grid every N steps (0: only at the end)")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --model_path exactly")
    g.add_argument(
        "--init_from",
        default=None,
        metavar="MODEL",
        help="fine-tune: a new run (into --model_path) that starts from MODEL's weights and takes its U-Net and noise "
        "schedule: a checkpoint, a .safetensors export or a diffusers model folder (fresh optimizer, step 0)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start over and replace an existing --model_path and its training curves (without it, refused)",
    )
    g.add_argument(
        "--log_dir",
        default=None,
        metavar="DIR",
        help="training curves: DIR/metrics.csv (step, loss, lr, grad_norm, images_per_s, skipped_steps, wall_time) "
        "and, "
        "with the tensorboard package, TensorBoard event files with the preview grids (view: tensorboard --logdir "
        "DIR); "
        "--resume appends to them (default: <model_path stem>_logs beside the checkpoint)",
    )
    g.add_argument(
        "--log_every",
        type=int,
        default=10,
        help="a row of training curves every N steps (loss and gradient norm: the means over those steps) and at the "
        "end",
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
    g.add_argument(
        "--eta",
        type=finite_float,
        default=0.0,
        help="DDIM stochasticity, 0-1 (0 = deterministic, 1 = DDPM's posterior variance)",
    )
    g.add_argument(
        "--class_label",
        default=None,
        metavar="LABELS",
        help="class-conditional models: a class (index or name), a comma-separated list (the samples split evenly, "
        "one grid row each), or all (one grid row per class); default all",
    )
    g.add_argument(
        "--guidance_scale",
        type=finite_float,
        default=None,
        metavar="W",
        help="class-conditional models: classifier-free guidance, eps = eps_uncond + W (eps_cond - eps_uncond); "
        f"1 = the conditional model unguided, 0 = unconditional (default {DEFAULT_GUIDANCE})",
    )
    g.add_argument(
        "--no_clip", action="store_true", help="do not clip predicted x0 to [-1, 1] (latent models never do)"
    )
    g.add_argument("--no_ema", action="store_true", help="sample (or export) the raw weights instead of the EMA")
    g.add_argument(
        "--output",
        default=None,
        help="sample: the PNG grid (default samples.png); export: the file (default: beside the checkpoint)",
    )
    g.add_argument("--save_npz", default=None, help="also save the images (uint8, NHWC) to this .npz file")
    g.add_argument("--no_grid", action="store_true", help="write no PNG grid (with --save_npz: for many samples)")
    g.add_argument(
        "--grid_scale",
        type=int,
        default=None,
        help="enlarge the grid N times, nearest neighbour (default: tiles of at least 64 pixels, e.g. x8 for 8x8 "
        "digits)",
    )
    g.add_argument(
        "--trust_torchscript",
        action="store_true",
        help="allow a TorchScript (.ts) --model_path: it is a program, and loading it runs its code",
    )

    g = p.add_argument_group("export and TensorRT")
    g.add_argument(
        "--format",
        choices=FORMATS,
        default="onnx",
        help="what --mode export writes: onnx, torchscript (.ts), tensorrt (an engine), safetensors (the weights, "
        "no pickle, this tool's configs in the file's metadata) or diffusers (a folder that diffusers' "
        "DDPMPipeline.from_pretrained loads; default <checkpoint stem>_diffusers/)",
    )
    g.add_argument(
        "--calibration_samples",
        type=int,
        default=None,
        metavar="N",
        help="--precision int8: the seeded trajectories of --sampler (default dpm_solver_sde, 20 steps) whose U-Net "
        "inputs "
        "set the activation ranges (default 16)",
    )
    g.add_argument(
        "--opset",
        type=int,
        default=None,
        help="ONNX opset, 18-25 (default: 21, native GroupNormalization; 22 for bf16 graphs; for TensorRT, "
        "chosen from its version)",
    )
    g.add_argument("--trt_backend", choices=BACKENDS, default="native", help="native engines or torch_tensorrt.compile")
    g.add_argument("--max_batch", type=int, default=DEFAULT_MAX_BATCH, help="largest batch a TensorRT engine takes")
    g.add_argument(
        "--trt_opt_level",
        type=int,
        choices=OPT_LEVELS,
        default=3,
        metavar="0-5",
        help="TensorRT builder optimization level: 0 builds fastest, 5 tries the most tactics",
    )
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--bench",
        choices=("sampling", "training"),
        default="sampling",
        help="time sampling implementations, or training steps",
    )
    g.add_argument("--train_steps", type=int, default=20, help="timed optimizer steps per training row")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per row (median and min-max reported)")
    g.add_argument("--warmup", type=int, default=1, help="untimed runs per row before timing")
    g.add_argument(
        "--interleave",
        action="store_true",
        help="sampling: build every row first, then time them in rounds (each row once per round, --repeats rounds); "
        "speedups are the median of per-round ratios, so a machine whose speed drifts over minutes slows every row "
        "alike (peak memory is not measured: the rows are held together)",
    )
    g.add_argument("--json", default=None, help="write the results as JSON here (benchmark, evaluate)")
    g.add_argument("--csv", default=None, help="write the result rows as CSV here")
    g.add_argument(
        "--chart",
        default=None,
        help="write a chart PNG here (benchmark: time per row; evaluate: quality against steps)",
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
        "--inception_weights",
        default=None,
        help="FID/KID (MNIST, Fashion-MNIST, CIFAR-10, folders): a local copy of torch-fidelity's Inception "
        "weights (default: torch hub's cache, downloaded once)",
    )
    return p
