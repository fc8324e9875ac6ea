"""Train DDPMs on small images and sample them fast: the command-line entry point.

    python main.py --mode train --dataset digits --max_steps 1500          # offline, CPU-friendly
    python main.py --mode train --dataset mnist --n_epochs 10              # downloads MNIST
    python main.py --mode sample --model_path checkpoints/mnist.pt --n_samples 16 --sampler ddim
    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt        # -> checkpoints/mnist.onnx
    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime
    python main.py --mode benchmark --n_samples 8 --img_size 32 --channels 3 --sampler ddim

Every mistake a user can make (a path, a size, a count, a missing dependency) ends with one line
on stderr and exit code 2; ``--help`` lists every flag.
No run replaces a file it should not: every output is checked before work starts (see safe_files.py),
training onto an existing checkpoint needs --resume or --overwrite, and Ctrl-C or SIGTERM end with
one line and exit code 130 or 143 (training saves first).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import interrupts  # before torch: a Ctrl-C during the first imports ends in one line too

if TYPE_CHECKING:
    import torch

    from implementations import SamplerOptions
    from tensorrt_integration import TensorRTOptions

PROG = "main.py"
SEED_MAX = 2**63 - 1


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


def single_sampling_choice(args: argparse.Namespace) -> None:
    """Outside --mode evaluate, --sampler and --sampling_steps name one value: make them plain."""
    for flag, value in (("--sampler", args.sampler), ("--sampling_steps", args.sampling_steps)):
        if value is not None and "," in value:
            raise ValueError(f"{flag} takes one value in --mode {args.mode} (lists are for --mode evaluate), got {value}")
    if args.sampling_steps is not None:
        args.sampling_steps = int(args.sampling_steps)


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
    import benchmark
    from artifacts import FORMATS
    from basic_diffusion import PRESETS
    from data import DATASETS
    from implementations import SAMPLE_IMPLEMENTATIONS
    from noise_schedule import SAMPLERS, SCHEDULES
    from precision import PRECISIONS
    from tensorrt_integration import BACKENDS
    from unet_io import DEFAULT_MAX_BATCH

    p = Parser(
        prog=PROG,
        description="Train a DDPM on small images, draw sample grids, and compare sampling implementations.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--mode",
        choices=("train", "sample", "evaluate", "benchmark", "export"),
        default="train",
        help="what to do (evaluate: sample quality against the training data, for a list of samplers and steps)",
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
        "--model_path",
        default=None,
        help="checkpoint to write (train) or read (sample, export); sample also reads exported .ts, .onnx and "
        ".engine/.plan files; default checkpoints/<dataset>.pt",
    )

    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default="mnist", help="digits = offline handwritten digits (scikit-learn)")
    g.add_argument("--data_dir", default="./data", help="download folder, or your images with --dataset folder")
    g.add_argument("--img_size", type=int, default=None, help="training image size (default: the dataset's)")
    g.add_argument("--channels", type=int, default=None, help="1 or 3 (default: the dataset's)")

    g = p.add_argument_group("model and schedule")
    g.add_argument("--model_preset", choices=PRESETS, default="small", help="small suits MNIST; ddpm_cifar10 = Ho et al.'s 35.7M U-Net")
    g.add_argument("--model_channels", type=int, default=None, help="override the preset's base width")
    g.add_argument("--num_res_blocks", type=int, default=None, help="override the preset's residual blocks per level")
    g.add_argument("--dropout", type=finite_float, default=None, help="override the preset's dropout")
    g.add_argument("--beta_schedule", choices=SCHEDULES, default="linear")
    g.add_argument("--timesteps", type=int, default=1000, help="diffusion steps T")

    g = p.add_argument_group("training")
    g.add_argument("--n_epochs", type=int, default=None, help="passes over the data (default 10)")
    g.add_argument("--max_steps", type=int, default=None, help="optimizer steps: the run's length, or its cap with --n_epochs")
    g.add_argument(
        "--batch_size", type=int, default=64, help="training batch; sampling draws --n_samples in batches of this size"
    )
    g.add_argument("--lr", type=finite_float, default=2e-4, help="peak AdamW learning rate")
    g.add_argument("--warmup_steps", type=int, default=None, help="linear warm-up (default: 5%% of the run, at most 500)")
    g.add_argument("--ema_decay", type=finite_float, default=0.999)
    g.add_argument(
        "--min_snr_gamma", type=finite_float, default=None,
        help="weight each timestep's loss by min(SNR, gamma)/SNR (Min-SNR weighting; 5 is the paper's choice; default: unweighted)",
    )
    g.add_argument("--grad_clip", type=finite_float, default=1.0, help="gradient-norm clipping")
    g.add_argument(
        "--compile", action="store_true", help="torch.compile the U-Net (training; and sampling with --implementation cuda)"
    )
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
        help="default: T for ddpm, 50 for ddim, 20 for dpm_solver; --mode evaluate takes a comma-separated list",
    )
    g.add_argument("--eta", type=finite_float, default=0.0, help="DDIM stochasticity (0 = deterministic)")
    g.add_argument("--no_clip", action="store_true", help="do not clip predicted x0 to [-1, 1]")
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
    benchmark.add_arguments(p)
    return p


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


def model_config_from_args(args: argparse.Namespace, *, size: int, channels: int):
    """The U-Net preset named by --model_preset with the flags' overrides (validated)."""
    from basic_diffusion import unet_preset

    return unet_preset(
        args.model_preset,
        image_size=size,
        in_channels=channels,
        model_channels=args.model_channels,
        num_res_blocks=args.num_res_blocks,
        dropout=args.dropout,
    )


def default_model_path(args: argparse.Namespace) -> str:
    return args.model_path or f"checkpoints/{args.dataset}.pt"


def run_train(args: argparse.Namespace, device: torch.device) -> None:
    from safe_files import check_outputs, run_lock

    check_positive(n_epochs=args.n_epochs, max_steps=args.max_steps, batch_size=args.batch_size)
    checkpoint = default_model_path(args)
    if Path(checkpoint).suffix != ".pt" or Path(checkpoint).is_dir():
        raise ValueError(f"--model_path must name a .pt checkpoint file (sampling and export expect one), got {checkpoint}")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the checkpoint and --overwrite replaces it; choose one")
    check_outputs({"--model_path": checkpoint})
    with run_lock(checkpoint):  # a second run on this path is refused until this one ends
        if Path(checkpoint).exists() and not (args.resume or args.overwrite):
            raise ValueError(
                f"--model_path {checkpoint} already holds a checkpoint; pass --resume to continue it, "
                "or --overwrite to start over and replace it"
            )
        trainer = resumed_trainer(args, checkpoint, device) if args.resume else new_trainer(args, checkpoint, device)
        train(trainer)
    print(f"checkpoint: {checkpoint}")


def resumed_trainer(args: argparse.Namespace, checkpoint: str, device: torch.device):
    from checkpoints import load_checkpoint, read_configs
    from data import load_images
    from memory_budget import check_batch_fits
    from training import Trainer, resume_config

    state = load_checkpoint(checkpoint)  # validated: configs, sizes
    model_config, schedule_config = read_configs(state, source=f"checkpoint {checkpoint}")
    config = resume_config(state, total_steps=args.max_steps, checkpoint=checkpoint)
    check_batch_fits(model_config, batch_size=config.batch_size, device=device, training=True)
    images = load_images(
        config.dataset, data_dir=args.data_dir, image_size=model_config.image_size, channels=model_config.in_channels
    )
    trainer = Trainer(config, model_config, schedule_config, images=images, device=device, resume_state=state)
    print(f"resuming {checkpoint} at step {trainer.step} of {config.total_steps}")
    return trainer


def new_trainer(args: argparse.Namespace, checkpoint: str, device: torch.device):

    from basic_diffusion import count_parameters
    from data import default_shape, load_images
    from memory_budget import check_batch_fits
    from noise_schedule import ScheduleConfig
    from precision import resolve as resolve_precision
    from training import TrainConfig, Trainer

    size, channels = default_shape(args.dataset)
    if args.channels and args.channels != channels and args.dataset != "folder":
        raise ValueError(f"{args.dataset} images have {channels} channel(s); --channels {args.channels} does not fit")
    size, channels = args.img_size or size, args.channels or channels
    model_config = model_config_from_args(args, size=size, channels=channels)  # validates before any download
    schedule_config = ScheduleConfig(kind=args.beta_schedule, num_timesteps=args.timesteps)
    check_batch_fits(model_config, batch_size=args.batch_size, device=device, training=True)
    images = load_images(args.dataset, data_dir=args.data_dir, image_size=size, channels=channels)
    # --max_steps alone sets the length; with --n_epochs (default 10) it caps it.
    if args.n_epochs is None and args.max_steps:
        total = args.max_steps
    else:
        total = (args.n_epochs or 10) * images.steps_per_epoch(args.batch_size)
        total = min(total, args.max_steps) if args.max_steps else total
    precision = resolve_precision(args.precision, purpose="training", device=device)
    config = TrainConfig(
        dataset=args.dataset,
        total_steps=total,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else min(500, total // 20),
        grad_clip=args.grad_clip,
        ema_decay=args.ema_decay,
        min_snr_gamma=args.min_snr_gamma,
        precision=precision,
        compile=args.compile,
        seed=args.seed,
        checkpoint=checkpoint,
        save_every=args.save_every,
        sample_every=args.sample_every,
    )
    trainer = Trainer(config, model_config, schedule_config, images=images, device=device)
    print(
        f"training {count_parameters(trainer.model) / 1e6:.2f}M-parameter U-Net on {len(images)} {args.dataset} images "
        f"({channels}x{size}x{size}) for {total} steps on {device}, {precision}"
    )
    return trainer


def train(trainer) -> None:
    """Run the training loop; on Ctrl-C or SIGTERM save a whole step's state, then exit 130 or 143.

    A run stopped before its first step saves nothing, so the file it would replace stays as it was.
    """
    start = trainer.step
    try:
        trainer.run()
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, interrupts.Interrupted) else interrupts.Interrupted()
        if trainer.step == start:
            print(f"\n{stop.name}: stopped before the first step; nothing was saved", file=sys.stderr)
            raise SystemExit(stop.exit_code) from None
        with interrupts.deferred(reraise=False):  # a second signal does not cut this save
            path = trainer.save()
        print(f"\n{stop.name}: stopped at step {trainer.step}; saved {path} (continue with --resume)", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None


def run_sample(args: argparse.Namespace, device: torch.device) -> None:
    import torch
    from tqdm.auto import tqdm

    import implementations
    from artifacts import artifact_kind, load_artifact
    from image_files import SampleWriter, plan_outputs
    from memory_budget import check_batch_fits
    from noise_schedule import NoiseSchedule
    from precision import resolve as resolve_precision
    from safe_files import check_outputs

    check_positive(n_samples=args.n_samples, sampling_steps=args.sampling_steps, batch_size=args.batch_size)
    grid_path = None if args.no_grid else (args.output or "samples.png")
    if args.no_grid and args.output:
        raise ValueError("--no_grid writes no PNG, so --output has nothing to name; drop one of them")
    if args.no_grid and not args.save_npz:
        raise ValueError("--no_grid writes no PNG, so nothing would be saved; add --save_npz FILE.npz")
    # A checkpoint or an exported U-Net (.ts, .onnx, .engine/.plan), with the configs stored in or beside it.
    model_path = default_model_path(args)
    check_outputs({"--output": grid_path, "--save_npz": args.save_npz}, inputs={"--model_path": model_path})
    if grid_path is not None and Path(grid_path).suffix.lower() != ".png":
        raise ValueError(f"--output is the PNG grid and needs a name ending in .png, got {grid_path}")
    if args.save_npz and not args.save_npz.endswith(".npz"):
        raise ValueError(f"--save_npz needs a file name ending in .npz, got {args.save_npz}")
    precision = resolve_precision(args.precision, purpose="sampling", device=device)  # fp32: the original's images
    implementation = implementations.get(args.implementation)
    implementation.check(kind=artifact_kind(model_path), precision=precision)
    artifact = load_artifact(
        model_path, device=device, weights="model" if args.no_ema else "ema", trust_torchscript=args.trust_torchscript
    )
    model, model_config = artifact.model, artifact.model_config
    c, s = model_config.in_channels, model_config.image_size
    plan_outputs(
        n_samples=args.n_samples, image_shape=(c, s, s), grid=grid_path, npz=args.save_npz, grid_scale=args.grid_scale
    )
    batch_size = min(args.batch_size, args.n_samples)
    check_batch_fits(model_config, batch_size=batch_size, device=device, training=False)
    schedule = NoiseSchedule(artifact.schedule_config).to(device)
    plan = schedule.make_plan(
        args.sampler, num_steps=args.sampling_steps, eta=args.eta, clip_denoised=not args.no_clip, device=device
    )
    generator = torch.Generator(device).manual_seed(args.seed)
    draw = implementations.make_drawer(
        sampling_implementation(args), model, plan, options=sampler_options(args, precision, source=artifact.path)
    )
    # Batches of --batch_size in order, from one generator: memory stays that of one batch.
    sizes = [min(batch_size, args.n_samples - start) for start in range(0, args.n_samples, batch_size)]
    with SampleWriter(
        args.n_samples, (c, s, s), grid=grid_path, npz=args.save_npz, grid_scale=args.grid_scale
    ) as out:
        for size in tqdm(sizes, desc="batches", unit="batch", disable=len(sizes) == 1, dynamic_ncols=True):
            out.add(draw((size, c, s, s), generator, len(sizes) == 1))
        written = out.close()
    print(f"wrote {', '.join(map(str, written))} ({args.n_samples} samples, {plan.sampler}, {plan.num_steps} steps)")


def sampling_implementation(args: argparse.Namespace) -> str:
    """The registry entry --implementation names: with --compile, cuda is cuda_compile (the U-Net
    through torch.compile inside the graph); --compile applies to no other implementation."""
    if args.compile and args.implementation != "cuda":
        raise ValueError("--compile applies to training and to sampling with --implementation cuda")
    return "cuda_compile" if args.compile else args.implementation


def sampler_options(args: argparse.Namespace, precision: str, *, source: str | Path) -> SamplerOptions:
    from implementations import SamplerOptions

    return SamplerOptions(precision=precision, opset=args.opset, tensorrt=tensorrt_options(args, source=source))


def tensorrt_options(args: argparse.Namespace, *, source: str | Path) -> TensorRTOptions:
    """The TensorRT flags, with the engine cache in a folder beside the checkpoint or ONNX file."""
    from engine_cache import cache_dir_for
    from tensorrt_integration import TensorRTOptions

    return TensorRTOptions(
        backend=args.trt_backend,
        max_batch=args.max_batch,
        optimization_level=args.trt_opt_level,
        opset=args.opset,
        cache_dir=cache_dir_for(source),
    )


def run_export(args: argparse.Namespace, device: torch.device) -> None:
    import artifacts
    from engine_cache import metadata_path
    from precision import resolve as resolve_precision
    from safe_files import check_outputs

    source = default_model_path(args)
    output = args.output or artifacts.default_output(source, args.format)
    outputs = {"--output": output}
    if args.format == "tensorrt":
        outputs["--output's metadata"] = metadata_path(output)
    check_outputs(outputs, inputs={"--model_path": source})
    lines = artifacts.export_artifact(
        source,
        fmt=args.format,
        output=output,
        weights="model" if args.no_ema else "ema",
        device=device,
        precision=resolve_precision(args.precision, purpose="export", device=device),
        opset=args.opset,
        tensorrt_options=tensorrt_options(args, source=source) if args.format == "tensorrt" else None,
    )
    for line in lines:
        print(line)


def run_benchmark(args: argparse.Namespace, device: torch.device) -> None:
    """Every implementation on one model: a checkpoint (--model_path), or a fresh U-Net of --img_size/--channels."""
    import torch

    import benchmark
    from artifacts import artifact_kind
    from basic_diffusion import UNet
    from checkpoints import load_checkpoint_model
    from data import default_shape
    from memory_budget import check_batch_fits
    from noise_schedule import NoiseSchedule, ScheduleConfig
    from precision import resolve as resolve_precision
    from safe_files import check_outputs

    check_positive(n_samples=args.n_samples, sampling_steps=args.sampling_steps, batch_size=args.batch_size)
    request = benchmark.BenchmarkRequest(
        rows=args.rows, repeats=args.repeats, warmup=args.warmup, seed=args.seed, train_steps=args.train_steps,
        batch_size=args.batch_size, json=args.json, csv=args.csv, chart=args.chart,
    )  # fmt: skip
    outputs = {"--json": args.json} if args.bench == "training" else {"--json": args.json, "--csv": args.csv, "--chart": args.chart}
    check_outputs(outputs, inputs={"--model_path": args.model_path})
    if args.model_path:
        if artifact_kind(args.model_path) != "checkpoint":
            raise ValueError(f"benchmark mode measures a checkpoint (.pt) in every implementation; got {args.model_path}")
        model, schedule_config = load_checkpoint_model(args.model_path, weights="model" if args.no_ema else "ema")
    else:
        size, channels = default_shape(args.dataset)
        torch.manual_seed(args.seed)
        model = UNet(model_config_from_args(args, size=args.img_size or size, channels=args.channels or channels))
        benchmark.perturb_zero_init(model, seed=args.seed)
        schedule_config = ScheduleConfig(kind=args.beta_schedule, num_timesteps=args.timesteps)
    training = args.bench == "training"
    batch, flag = (args.batch_size, "--batch_size") if training else (args.n_samples, "--n_samples")
    check_batch_fits(model.config, batch_size=batch, device=device, training=training, flag=flag)
    model.to(device).eval()
    plan = NoiseSchedule(schedule_config).make_plan(
        args.sampler, num_steps=args.sampling_steps, eta=args.eta, clip_denoised=not args.no_clip, device=device
    )
    if training:
        benchmark.main_training(request, model_config=model.config, schedule_config=schedule_config, device=device)
        return
    c, s = model.config.in_channels, model.config.image_size
    precision = resolve_precision(args.precision, purpose="sampling", device=device)
    benchmark.main(request, model=model, plan=plan, shape=(args.n_samples, c, s, s), precision=precision)


def run_evaluate(args: argparse.Namespace, device: torch.device) -> None:
    """Sample quality of a digits model for each --sampler x --sampling_steps, against real digits."""
    import torch
    from tqdm.auto import tqdm

    import evaluate
    import implementations
    from artifacts import artifact_kind, load_artifact
    from checkpoints import load_checkpoint
    from memory_budget import check_batch_fits
    from noise_schedule import SAMPLERS, NoiseSchedule
    from precision import resolve as resolve_precision
    from safe_files import check_outputs

    check_positive(n_samples=args.n_samples, batch_size=args.batch_size)
    samplers = evaluate.parse_list(args.sampler, kind=str, flag="--sampler", choices=SAMPLERS)
    steps = evaluate.parse_list(args.sampling_steps, kind=int, flag="--sampling_steps")
    model_path = default_model_path(args)
    check_outputs({"--json": args.json, "--chart": args.chart}, inputs={"--model_path": model_path})
    for flag, path, suffix in (("--json", args.json, ".json"), ("--chart", args.chart, ".png")):
        if path is not None and Path(path).suffix.lower() != suffix:
            raise ValueError(f"{flag} needs a file name ending in {suffix}, got {path}")
    if args.chart:
        import matplotlib  # noqa: F401  (fail now, not after the sweep)
    kind = artifact_kind(model_path)
    precision = resolve_precision(args.precision, purpose="sampling", device=device)
    implementations.get(args.implementation).check(kind=kind, precision=precision)
    artifact = load_artifact(
        model_path, device=device, weights="model" if args.no_ema else "ema", trust_torchscript=args.trust_torchscript
    )
    # The training data: recorded in a checkpoint; for exported files, --dataset says it.
    dataset = load_checkpoint(model_path)["train_config"]["dataset"] if kind == "checkpoint" else args.dataset
    if dataset != "digits":
        raise ValueError(
            f"{model_path} was trained on {dataset}; evaluate mode measures digits models so far (FID/KID for "
            "MNIST, Fashion-MNIST, CIFAR-10 and folders is not built yet)"
        )
    model, model_config = artifact.model, artifact.model_config
    c, s = model_config.in_channels, model_config.image_size
    batch_size = min(args.batch_size, args.n_samples)
    check_batch_fits(model_config, batch_size=batch_size, device=device, training=False)
    schedule = NoiseSchedule(artifact.schedule_config).to(device)
    print(f"fitting the digit classifier and feature space to the real digits at {s}x{s} ...")
    judge = evaluate.DigitJudge(image_size=s, seed=args.seed)
    sizes = [min(batch_size, args.n_samples - start) for start in range(0, args.n_samples, batch_size)]

    def draw(sampler: str, num_steps: int | None) -> tuple[torch.Tensor, int]:
        plan = schedule.make_plan(
            sampler, num_steps=num_steps, eta=args.eta if sampler == "ddim" else 0.0, clip_denoised=not args.no_clip,
            device=device,
        )  # fmt: skip
        drawer = implementations.make_drawer(
            sampling_implementation(args), model, plan, options=sampler_options(args, precision, source=artifact.path)
        )
        generator = torch.Generator(device).manual_seed(args.seed)  # the same noise for every row
        batches = [
            drawer((size, c, s, s), generator, False).float().cpu()  # sync: the batch leaves the device
            for size in tqdm(sizes, desc=f"{sampler} {plan.num_steps} steps", unit="batch", leave=False)
        ]
        return torch.cat(batches), plan.num_steps

    result = evaluate.run_sweep(
        draw, judge, samplers=samplers, steps=steps, n_samples=args.n_samples, seed=args.seed, image_size=s
    )
    result.update(model_path=str(model_path), implementation=args.implementation, precision=precision)
    print()
    print(evaluate.format_table(result))
    if args.json:
        evaluate.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.chart:
        evaluate.write_plot(result, args.chart)
        print(f"wrote {args.chart}")


MODES = {"train": run_train, "sample": run_sample, "evaluate": run_evaluate, "export": run_export, "benchmark": run_benchmark}


def one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one mode; every failure a user can cause ends in one line on stderr and a documented exit code:
    2 for a user error (or memory exhausted), 1 for a training run that diverged, 130/143 for Ctrl-C/SIGTERM."""
    interrupts.install()
    try:
        args = build_parser().parse_args(argv)
        import torch  # noqa: F401  (imported here, under the signal handlers)

        from export import check_opset
        from memory_budget import is_out_of_memory
        from training import TrainingDiverged

        try:
            if args.opset is not None:
                check_opset(args.opset)
            if args.mode != "evaluate":
                single_sampling_choice(args)
            MODES[args.mode](args, resolve_device(args.device))
        except (ValueError, OSError, ImportError) as exc:  # user errors, incl. a missing build or package
            print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
            return 2
        except TrainingDiverged as exc:
            print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
            return 1
        except (RuntimeError, MemoryError) as exc:
            if not is_out_of_memory(exc):
                raise
            place = "GPU" if "cuda" in str(exc).lower() else "machine"
            print(f"{PROG}: error: the {place} ran out of memory; lower --batch_size or --n_samples", file=sys.stderr)
            return 2
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, interrupts.Interrupted) else interrupts.Interrupted()
        print(f"\n{PROG}: {stop.name}: stopped", file=sys.stderr)
        return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
