"""Flags resolved once into a typed request per mode (ddpm/requests.py), every mistake refused here.

    mode, request = resolve.parse(["--mode", "sample", "--n_samples", "4"])   # -> ("sample", SampleRequest(...))

``main.py`` runs a mode on its request; below main.py nothing reads an argparse Namespace. The
requests hold resolved values (the device, the precision, default paths, registry names, the
sampler plan's parameters), and every flag error a user can make is a ``ValueError`` raised here,
before any file is read or written or any model is loaded: a value no flag may take (a count, a
size or a step number below 1, an opset out of range, a guidance scale out of range), flags that
contradict each other or the mode, an implementation that cannot run the file's kind or the
precision, and every output that would destroy an input (util/safe_files.check_outputs). Which
flags each mode reads at all is the flag table's (cli/flags.py), refused while parsing.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ddpm.choices import DEFAULT_SAMPLER
from ddpm.cli.flags import FLAGS, NEW_MODEL
from ddpm.cli.parser import not_read_by_run, parse_args
from ddpm.cli.reads import (
    READ_BY_RUN,
    check_at_most,
    check_empty,
    check_log_dir,
    check_not_negative,
    check_positive,
    check_profile_dir,
    check_training_numbers,
    parse_list,
    parse_students,
)
from ddpm.cli.recipes import distill_defaults, first_stage_request, new_model, training_recipe
from ddpm.conditioning import check_scale
from ddpm.formats.checkpoints import MAX_STEP
from ddpm.latent.autoencoder import requested_config
from ddpm.requests import (  # every output checked, by its kind, before any work
    CURVES,
    EXPORT_METADATA,
    FIRST_STAGE,
    RECONSTRUCTIONS,
    AutoencoderTrainRequest,
    BenchmarkRequest,
    BenchmarkRun,
    Calibration,
    EngineFlags,
    EvaluateRequest,
    ExportRequest,
    ModelSource,
    SampleRequest,
    SamplingChoice,
    TrainRequest,
    check_mode_outputs,
)
from ddpm.util.safe_files import as_input, check_output_folder

if TYPE_CHECKING:
    import torch


def parse(argv: list[str] | None = None) -> tuple[str, object]:
    """The mode and its request, with every flag checked; argparse errors exit 2 on their own."""
    args = parse_args(argv)
    return args.mode, request_for(args)


def request_for(args: argparse.Namespace) -> object:
    """The request of ``args.mode``: flags resolved and checked (a ValueError names the flag)."""
    check_empty({name: getattr(args, name) for name in sorted(args.given)})
    if args.opset is not None:
        from ddpm.formats.unet_io import check_opset

        check_opset(args.opset)
    check_profile_dir(args.profile)  # checked once, for every mode that reads it: the builders pass it on
    if args.mode not in REQUESTS:
        raise ValueError(f"--mode {args.mode} is not available yet")
    # Sizes, counts and step numbers: never 0 or negative (0 is not "the default"; leave a flag out for that).
    check_positive(
        img_size=args.img_size,
        channels=args.channels,
        model_channels=args.model_channels,
        num_res_blocks=args.num_res_blocks,
        patch_size=args.patch_size,
        timesteps=args.timesteps,
        latent_channels=args.latent_channels,
        ae_channels=args.ae_channels,
        max_batch=args.max_batch,
        train_steps=args.train_steps,
        repeats=args.repeats,
        grid_scale=args.grid_scale,
    )
    check_not_negative(
        warmup_steps=args.warmup_steps, save_every=args.save_every, sample_every=args.sample_every, warmup=args.warmup
    )
    check_at_most(
        MAX_STEP,
        "a billion optimizer steps, the most a checkpoint records",
        max_steps=args.max_steps,
        n_epochs=args.n_epochs,
        train_steps=args.train_steps,
    )
    check_at_most(1000, "timings settle within a few repeats", repeats=args.repeats, warmup=args.warmup)
    if args.mode == "distill":
        distill_defaults(args)  # --distill_method and --max_steps by --sampling_steps, where not given
    if unread := not_read_by_run(args.mode, vars(args), args.given):  # a TensorRT flag to ONNX
        raise ValueError(unread)
    return REQUESTS[args.mode](args, resolve_device(args.device))


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but PyTorch sees no CUDA GPU here (use --device cpu)")
    return torch.device(name)


def _precision(args: argparse.Namespace, purpose: str, device: torch.device, *, pixels: int = 0) -> str:
    from ddpm.util.precision import resolve

    return resolve(args.precision, purpose=purpose, device=device, pixels=pixels)


def _single(args: argparse.Namespace, *, default: str = DEFAULT_SAMPLER) -> SamplingChoice:
    """Outside --mode evaluate, --sampler and --sampling_steps name one value (``default``: SamplingChoice's)."""
    for flag, value in (("--sampler", args.sampler), ("--sampling_steps", args.sampling_steps)):
        if value is not None and "," in value:
            raise ValueError(
                f"{flag} takes one value in --mode {args.mode} (lists are for --mode evaluate), got {value}"
            )
    steps = int(args.sampling_steps) if args.sampling_steps is not None else None
    sampler = args.sampler if "sampler" in args.given else None  # None: the model's own (a student's)
    return SamplingChoice(
        sampler=sampler, sampling_steps=steps, eta=args.eta, clip_denoised=not args.no_clip, default=default
    )


def _model_path(args: argparse.Namespace) -> str:
    return args.model_path or f"checkpoints/{args.dataset}.pt"


# Flags that describe a new model (its shape, network, schedule, conditioning): a run from a model file
# (benchmark --model_path, train --init_from) takes all of that from the file, so one given would be ignored.
NEW_MODEL_FLAGS = tuple(name for name, flag in FLAGS.items() if flag.note == NEW_MODEL)


def _refuse_ignored(args: argparse.Namespace, flags: tuple[str, ...], why: str) -> None:
    given = [flag for flag in flags if flag in args.given]
    if given:
        raise ValueError(f"--{given[0]} {why}; drop it")


def _source(args: argparse.Namespace, path: str | None = None) -> ModelSource:
    path = path or _model_path(args)
    check_output_folder("--profile", args.profile, inputs={"--model_path": as_input(path)})
    _refuse_ignored(
        args, NEW_MODEL_FLAGS, f"describes a new model, and --mode {args.mode} takes the whole model from {path}"
    )
    return ModelSource(
        path=path,
        weights="model" if args.no_ema else "ema",
        trust_torchscript=args.trust_torchscript,
        autoencoder=args.autoencoder,
    )


def _engine(args: argparse.Namespace) -> EngineFlags:
    return EngineFlags(
        backend=args.trt_backend, max_batch=args.max_batch, optimization_level=args.trt_opt_level, opset=args.opset
    )


def _draw_fields(args: argparse.Namespace, device: torch.device, source: ModelSource) -> dict:
    """The fields of a DrawRequest (sample and evaluate mode); what no implementation would run of the file's kind
    and the precision refused now (what runs is selected once the file is read: backends/selection.select)."""
    from ddpm.backends.selection import check_request
    from ddpm.formats.torch_files import artifact_kind

    kind, precision_auto = artifact_kind(source.path), args.precision == "auto"
    precision = _precision(args, "sampling", device)  # auto: the device's fastest, kept by select where it is faster
    check_request(
        implementation=args.implementation,
        precision=precision,
        precision_auto=precision_auto,
        kind=kind,
        compile=args.compile,
    )
    _refuse_unread_runtime_flags(args, kind=kind)
    return dict(
        device=device,
        precision=precision,
        precision_auto=precision_auto,
        source=source,
        implementation=args.implementation,
        compile=args.compile,
        n_samples=args.n_samples,
        batch_size=args.batch_size,
        seed=args.seed,
        opset=args.opset,
        engine=_engine(args),
        class_label=args.class_label,
        guidance_scale=None if args.guidance_scale is None else check_scale(args.guidance_scale),
        dataset=args.dataset if "dataset" in args.given else None,  # else the data the model file records
    )


def _refuse_unread_runtime_flags(args: argparse.Namespace, *, kind: str) -> None:
    """--opset is read only where an ONNX graph is made from the model: by the implementations that make one
    (the flag table's READ_BY_RUN, checked with the flags), from a file that is not already a graph or an engine."""
    if "opset" in args.given and kind in ("onnx", "tensorrt"):
        raise ValueError(f"--opset sets the ONNX graph made from a model; {args.model_path} is one already (drop it)")


def _data_input(args: argparse.Namespace):
    from ddpm.data.datasets import data_input

    return data_input(args.dataset, args.data_dir)


def dataset_channels(args: argparse.Namespace) -> int:
    """The channels of ``--dataset``'s images: ``--channels`` where it fits them (any for a folder), else a
    one-line ValueError."""
    from ddpm.data.catalog import default_shape

    channels = default_shape(args.dataset)[1]
    if args.channels and args.channels != channels and args.dataset != "folder":
        raise ValueError(f"{args.dataset} images have {channels} channel(s); --channels {args.channels} does not fit")
    return channels if args.channels is None else args.channels


def train_request(args: argparse.Namespace, device: torch.device) -> TrainRequest:
    from ddpm.data.catalog import VOLUME_DATASETS
    from ddpm.training.curves import CSV_NAME, default_log_dir
    from ddpm.training.trainer import check_warmup
    from ddpm.util.safe_files import check_resumable

    recipe = training_recipe(args, device)
    batch_size = recipe["batch_size"] if args.batch_size is None else args.batch_size
    check_positive(n_epochs=args.n_epochs, max_steps=args.max_steps, batch_size=batch_size, log_every=args.log_every)
    check_training_numbers(lr=args.lr, ema_decay=args.ema_decay, grad_clip=args.grad_clip, dropout=args.dropout)
    check_warmup(args.warmup_steps, run_steps=args.max_steps)  # a length from --n_epochs: checked once it is known
    checkpoint = _model_path(args)
    if Path(checkpoint).suffix != ".pt" or Path(checkpoint).is_dir():
        raise ValueError(
            f"--model_path must name a .pt checkpoint file (sampling and export expect one), got {checkpoint}"
        )
    if args.autoencoder and args.dataset in VOLUME_DATASETS:
        raise ValueError("--autoencoder: latent models are for images; volumes train in voxel space")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the checkpoint and --overwrite replaces it; choose one")
    if args.init_from:  # fine-tuning: the whole model comes from the file, the data and the recipe from the flags
        if args.resume:
            raise ValueError(
                f"--resume continues {checkpoint}'s own run and --init_from starts a new one from {args.init_from}; "
                "choose one"
            )
        _refuse_ignored(
            args, NEW_MODEL_FLAGS, f"describes a new model, and --init_from takes the whole model from {args.init_from}"
        )
        if args.autoencoder:
            raise ValueError("--init_from starts from a pixel model's weights; a latent model continues with --resume")
    if args.resume and args.class_cond:
        raise ValueError("--class_cond makes a new model; a resumed run keeps the one in its checkpoint")
    if "cond_drop" in args.given and not args.class_cond and not args.resume:
        raise ValueError(
            "--cond_drop is the share of labels dropped when training a class-conditional model; add --class_cond or "
            "drop it"
        )
    if args.resume:
        check_resumable("--model_path", checkpoint)  # read, not replaced: before the output checks call it destroyed
        resumed_keeps = "makes a new model; a resumed run keeps the one in its checkpoint"
        _refuse_ignored(args, ("time_conditioning", "patch_size", "model_preset"), resumed_keeps)
    if args.resume and args.n_epochs is not None:
        raise ValueError("--n_epochs sets a new run's length; a resumed run goes on to --max_steps (drop --n_epochs)")
    if not 0.0 <= args.cond_drop <= 1.0:
        raise ValueError(f"--cond_drop must be between 0 and 1, got {args.cond_drop}")
    inputs = {
        "--autoencoder": args.autoencoder,
        "--data_dir": _data_input(args),
        "--init_from": as_input(args.init_from),
    }
    first_stage = first_stage_request(args, device, checkpoint=checkpoint) if recipe.get("first_stage") else None
    outputs = {"--model_path": checkpoint}
    if first_stage is not None:
        outputs.update({FIRST_STAGE: first_stage.checkpoint, RECONSTRUCTIONS: first_stage.reconstructions})
    log_dir = args.log_dir or default_log_dir(checkpoint)  # checked again once the run's inputs are all known
    for flag, path in outputs.items():  # the checkpoint, and the autoencoder a first stage writes
        check_log_dir(log_dir, checkpoint=path, flag=flag)
    check_mode_outputs("train", {**outputs, CURVES: Path(log_dir) / CSV_NAME}, inputs=inputs)
    check_output_folder("--profile", args.profile, inputs=inputs)
    min_snr_gamma = recipe["min_snr_gamma"] if args.min_snr_gamma is None else args.min_snr_gamma
    if min_snr_gamma < 0:
        raise ValueError(f"--min_snr_gamma must be positive, or 0 for the unweighted loss, got {min_snr_gamma}")
    if not args.resume:
        dataset_channels(args)
    model = new_model(args)
    if first_stage is not None:  # a latent model: its U-Net's shape is the autoencoder's latent's
        autoencoder = requested_config(first_stage)
        replace(model, image_size=autoencoder.latent_side, channels=autoencoder.latent_shape[0]).model_config()
        model = replace(model, image_size=0, channels=0)
    elif not (args.resume or args.init_from or args.autoencoder):
        model.model_config()  # its size, width and depth, before the data are read
    return TrainRequest(
        device=device,
        precision=_precision(args, "training", device, pixels=model.pixels),
        checkpoint=checkpoint,
        resume=args.resume,
        overwrite=args.overwrite,
        model=model,
        autoencoder=first_stage.checkpoint if first_stage is not None else args.autoencoder,
        first_stage=first_stage,
        init_from=args.init_from,
        seed=args.seed,
        n_epochs=args.n_epochs,
        max_steps=args.max_steps,
        batch_size=batch_size,
        lr=recipe["lr"] if args.lr is None else args.lr,
        warmup_steps=args.warmup_steps,
        ema_decay=recipe["ema_decay"] if args.ema_decay is None else args.ema_decay,
        min_snr_gamma=min_snr_gamma or None,  # 0: unweighted
        timestep_sampling=args.timestep_sampling,
        digits_recipe=recipe.get("digits_recipe", False),
        class_cond=args.class_cond,
        cond_drop=args.cond_drop,
        grad_checkpoint=args.grad_checkpoint,
        grad_clip=args.grad_clip,
        compile=args.compile,
        save_every=args.save_every,
        sample_every=args.sample_every,
        profile=args.profile,
        log_dir=log_dir,
        log_every=args.log_every,
        given=args.given,
    )


def sample_request(args: argparse.Namespace, device: torch.device) -> SampleRequest:
    sampling = _single(args)
    check_positive(n_samples=args.n_samples, batch_size=args.batch_size)
    if args.no_grid and args.output:
        raise ValueError("--no_grid writes no PNG, so --output has nothing to name; drop one of them")
    if args.no_grid and not args.save_npz:
        raise ValueError("--no_grid writes no PNG, so nothing would be saved; add --save_npz FILE.npz")
    grid = None if args.no_grid else (args.output or "samples.png")
    source = _source(args)  # a checkpoint or an exported U-Net (.ts, .onnx, .engine/.plan)
    check_mode_outputs("sample", {"--output": grid, "--save_npz": args.save_npz}, inputs=source.inputs())
    return SampleRequest(
        **_draw_fields(args, device, source),
        sampling=sampling,
        grid=grid,
        npz=args.save_npz,
        grid_scale=args.grid_scale,
        profile=args.profile,
    )


MAX_EVALUATE_SAMPLES = 50_000


def evaluate_request(args: argparse.Namespace, device: torch.device) -> EvaluateRequest:
    from ddpm.formats.torch_files import artifact_kind
    from noise_schedule import SAMPLERS

    check_positive(n_samples=args.n_samples, batch_size=args.batch_size)
    if args.n_samples < 2:
        raise ValueError("--mode evaluate needs --n_samples 2 or more (a Frechet distance needs a covariance)")
    if args.n_samples > MAX_EVALUATE_SAMPLES:  # time: every row draws them all, a U-Net pass per sample and step
        raise ValueError(
            f"--mode evaluate draws at most {MAX_EVALUATE_SAMPLES:,} samples per row (the count FID is reported at; "
            f"more changes no conclusion and takes hours per row), got --n_samples {args.n_samples:,}"
        )
    source = _source(args)
    # (the data it is judged against is checked in evaluate mode, once the model file has said which it is)
    check_mode_outputs("evaluate", {"--json": args.json, "--chart": args.chart}, inputs=source.inputs())
    if args.chart:
        try:
            import matplotlib  # noqa: F401  (an optional package: missing, it fails now, not after the sweep)
        except ImportError as exc:
            raise ImportError(f"--chart needs matplotlib ({exc}); install it: pip install matplotlib") from exc
    if args.inception_weights is not None and not Path(args.inception_weights).is_file():
        raise ValueError(f"--inception_weights {args.inception_weights} is not a file")
    students = parse_students(args.students, teacher=source.path)
    for path in students:  # by its name, as --model_path's kind was (_draw_fields)
        artifact_kind(path, flag="--students")
    students = tuple(_source(args, path).path for path in students)
    return EvaluateRequest(
        **_draw_fields(args, device, source),
        samplers=parse_list(args.sampler, kind=str, flag="--sampler", choices=SAMPLERS),  # not given: [None]
        sampling_steps=parse_list(args.sampling_steps, kind=int, flag="--sampling_steps"),
        students=students,
        data_dir=args.data_dir,
        data_dir_given="data_dir" in args.given,
        inception_weights=args.inception_weights,
        eta=args.eta,
        clip_denoised=not args.no_clip,
        json=args.json,
        chart=args.chart,
    )


def _check_rows(rows: str, *, bench: str, device: torch.device) -> None:
    """--rows: names the benchmark knows (checked now: the timing run starts with minutes of building); all, alone."""
    names = [row.strip() for row in rows.split(",")]
    if "all" in names and len(names) > 1:
        raise ValueError(f"--rows {rows}: all names every row and stands alone; give all, or a list without it")
    if bench == "training":
        from ddpm.benchmarks.training_bench import select_variants

        select_variants(rows, device)
        return
    from ddpm.benchmarks.rows import parse_rows

    try:
        parse_rows(rows, device_type=device.type)
    except ValueError as exc:
        raise ValueError(f"--rows: {exc}") from None


def export_request(args: argparse.Namespace, device: torch.device) -> ExportRequest:
    from ddpm.formats.engine_cache import metadata_path
    from ddpm.formats.torch_files import default_output

    _single(args)
    check_positive(batch_size=args.batch_size)
    source = _source(args)
    precision = _precision(args, "export", device)
    calibration = _calibration(args, precision)
    output = args.output or str(default_output(source.path, args.format, precision=precision))
    outputs = {"--output": output}
    if args.format == "tensorrt":
        outputs[EXPORT_METADATA] = metadata_path(output)
    if args.format == "diffusers":  # a folder, checked by export mode (it knows what --overwrite replaces)
        outputs = {}
    check_mode_outputs("export", outputs, inputs=source.inputs(), fmt=args.format)
    return ExportRequest(
        device=device,
        precision=precision,
        source=source,
        fmt=args.format,
        output=output,
        opset=args.opset,
        engine=_engine(args),
        calibration=calibration,
        overwrite=args.overwrite,
    )


def _calibration(args: argparse.Namespace, precision: str) -> Calibration | None:
    """An INT8 export's calibration: --calibration_samples trajectories of --sampler (when given; else the
    default few-step sampler) over --sampling_steps; None for the other precisions."""
    from ddpm.formats import quantization
    from ddpm.util.precision import QUANTIZED

    if precision == "fp8":
        problem = quantization.fp8_runtime_problem()
        if problem:
            raise ValueError(
                f"--precision fp8 writes an FP8 Q/DQ graph for TensorRT on Hopper and newer GPUs, and {problem}; "
                "nothing was written"
            )
    if precision not in QUANTIZED:  # (its flags, given, were refused with the others: reads.READ_BY_RUN)
        return None
    if args.format != "onnx":
        raise ValueError(
            f"--precision {precision} is written into an ONNX graph (--format onnx); a TensorRT engine is then "
            "built from that file (--format tensorrt --model_path FILE.onnx)"
        )
    sampling = _single(args)
    sampler, steps = quantization.DEFAULT_CALIBRATION_SAMPLER
    if "sampler" in args.given:
        sampler, steps = sampling.sampler, None
    if "sampling_steps" in args.given:
        steps = sampling.sampling_steps
    samples = quantization.DEFAULT_CALIBRATION_SAMPLES if args.calibration_samples is None else args.calibration_samples
    if not 1 <= samples <= quantization.MAX_CALIBRATION_SAMPLES:
        raise ValueError(
            f"--calibration_samples must be between 1 and {quantization.MAX_CALIBRATION_SAMPLES}, got {samples}"
        )
    return Calibration(
        sampler=sampler, sampling_steps=steps, samples=samples, seed=args.seed, batch_size=args.batch_size
    )


def benchmark_request(args: argparse.Namespace, device: torch.device) -> BenchmarkRun:
    from ddpm.formats.torch_files import artifact_kind

    sampling = _single(args, default="ddpm")  # benchmark times DDPM (benchmarks/plan.py may respace it)
    check_positive(n_samples=args.n_samples, batch_size=args.batch_size)
    if args.autoencoder and not args.model_path:
        raise ValueError(
            "--autoencoder goes with a latent model's checkpoint (--model_path); a fresh U-Net is a pixel model"
        )
    if args.model_path and artifact_kind(args.model_path) != "checkpoint":
        raise ValueError(f"benchmark mode measures a checkpoint (.pt) in every implementation; got {args.model_path}")
    rows = [row.strip() for row in args.rows.split(",")]
    repeated = next((row for i, row in enumerate(rows) if row and row in rows[:i]), None)
    if repeated:  # a row is timed once (per round, with --interleave); twice would only cost time
        raise ValueError(f"--rows names {repeated} twice; name each row once")
    _check_rows(args.rows, bench=args.bench, device=device)
    if not args.model_path:
        check_training_numbers(dropout=args.dropout)
        new_model(args).model_config()  # the fresh U-Net's shape, before anything is built
    request = BenchmarkRequest(
        rows=args.rows,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        train_steps=args.train_steps,
        batch_size=args.batch_size,
        json=args.json,
        csv=args.csv,
        chart=args.chart,
        profile=args.profile,
        interleave=args.interleave,
        given=args.given,
    )
    outputs = {"--json": args.json}
    if args.bench == "sampling":
        outputs.update({"--csv": args.csv, "--chart": args.chart})
    check_mode_outputs(
        "benchmark", outputs, inputs={"--model_path": as_input(args.model_path), "--autoencoder": args.autoencoder}
    )
    return BenchmarkRun(
        device=device,
        precision=_precision(args, "sampling", device),
        bench=args.bench,
        request=request,
        source=_source(args, args.model_path) if args.model_path else None,
        model=new_model(args),
        sampling=sampling,
        n_samples=args.n_samples,
        guidance_scale=None if args.guidance_scale is None else check_scale(args.guidance_scale),
    )


def train_autoencoder_request(args: argparse.Namespace, device: torch.device) -> AutoencoderTrainRequest:
    from ddpm.data.catalog import VOLUME_DATASETS, default_shape
    from ddpm.requests import reconstructions_path

    if args.dataset in VOLUME_DATASETS:
        raise ValueError(f"--mode train_autoencoder is for images; {args.dataset} holds 3-D volumes")
    if args.precision not in ("auto", "fp32"):
        raise ValueError(f"--mode train_autoencoder trains in fp32; drop --precision {args.precision}")
    check_positive(n_epochs=args.n_epochs, max_steps=args.max_steps, batch_size=args.batch_size)
    check_training_numbers(lr=args.lr, kl_weight=args.kl_weight)
    checkpoint = args.model_path or f"checkpoints/{args.dataset}_autoencoder.pt"
    if Path(checkpoint).suffix != ".pt" or Path(checkpoint).is_dir():
        raise ValueError(f"--model_path must name a .pt checkpoint file, got {checkpoint}")
    png = reconstructions_path(checkpoint)
    check_mode_outputs(
        "train_autoencoder",
        {"--model_path": checkpoint, RECONSTRUCTIONS: png},
        inputs={"--data_dir": _data_input(args)},
    )
    size, channels = default_shape(args.dataset)[0], dataset_channels(args)
    request = AutoencoderTrainRequest(
        device=device,
        checkpoint=checkpoint,
        reconstructions=png,
        overwrite=args.overwrite,
        dataset=args.dataset,
        data_dir=args.data_dir,
        image_size=size if args.img_size is None else args.img_size,
        channels=channels,
        seed=args.seed,
        n_epochs=args.n_epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        latent_channels=args.latent_channels,
        downsample=args.downsample,
        base_channels=args.ae_channels,
        kl_weight=args.kl_weight,
    )
    side = requested_config(request).latent_side  # the size and shape flags checked before any data is read
    if side >= 8 and side % 4:
        raise ValueError(
            f"a {side}x{side} latent cannot be halved twice by the latent U-Net; pick --downsample so the latent side "
            "is "
            "a multiple of 4 (or at most 4)"
        )
    return request


def distill_request(args: argparse.Namespace, device: torch.device):
    """--mode distill: the teacher (--model_path, only read), the student's checkpoint (--output), the student's
    recipe; flags left out take the distillation's own defaults (the flag table's, from ddpm/choices.py:
    DISTILL_DEFAULTS), not --mode train's. Every flag is checked here: the teacher's trajectories take minutes,
    and nothing may be refused after them."""
    from ddpm.formats.torch_files import KIND_ARTICLES, artifact_kind
    from ddpm.requests import DistillRequest, default_student_path
    from ddpm.training.curves import CSV_NAME, default_log_dir
    from ddpm.training.distill import DistillConfig
    from ddpm.training.trainer import check_warmup

    if args.model_path is None:
        raise ValueError("--mode distill needs --model_path: the teacher model (a checkpoint, .safetensors or folder)")
    teacher_kind = artifact_kind(args.model_path)  # by its name alone: nothing is read yet
    if teacher_kind != "checkpoint":
        raise ValueError(
            f"--model_path {args.model_path} is {KIND_ARTICLES[teacher_kind]}; a student starts from its teacher's "
            "PyTorch weights: give the checkpoint (.pt), .safetensors export or diffusers folder it was made from"
        )
    if args.resume and args.overwrite:
        raise ValueError("--resume continues a distillation and --overwrite starts a new one; choose one")
    check_positive(max_steps=args.max_steps, batch_size=args.batch_size, log_every=args.log_every)
    check_training_numbers(lr=args.lr, ema_decay=args.ema_decay, grad_clip=args.grad_clip)
    # (a resumed run without --max_steps keeps its own length, and its own warm-up unless the flag contradicts it)
    check_warmup(args.warmup_steps, run_steps=args.max_steps if "max_steps" in args.given or not args.resume else None)
    steps = args.sampling_steps
    method = dict(method=args.distill_method, adv_weight=args.adv_weight, dmd_weight=args.dmd_weight)
    DistillConfig(  # the ranges of --sampling_steps, --distill_samples, --teacher_steps, --guidance_scale, the method's
        teacher=args.model_path,
        sampling_steps=steps,
        samples=args.distill_samples,
        teacher_steps=args.teacher_steps,
        guidance_scale=0.0 if args.guidance_scale is None else args.guidance_scale,
        **method,
    )
    method.update(adv_real=args.adv_real, data_dir=args.data_dir)
    output = args.output or default_student_path(args.model_path, steps)
    if Path(output).suffix != ".pt" or Path(output).is_dir():
        raise ValueError(f"--output must name a .pt checkpoint file for the student, got {output}")
    log_dir = args.log_dir if args.log_dir is not None else default_log_dir(output)
    check_log_dir(log_dir, checkpoint=output, flag="--output")
    teacher = _source(args, args.model_path)
    outputs = {"--output": output, CURVES: Path(log_dir) / CSV_NAME}
    check_mode_outputs("distill", outputs, inputs=teacher.inputs())  # the teacher is only read
    return DistillRequest(
        device=device,
        precision=_precision(args, "distillation", device),
        teacher=teacher,
        checkpoint=output,
        resume=args.resume,
        overwrite=args.overwrite,
        sampling_steps=steps,
        guidance_scale=args.guidance_scale,
        samples=args.distill_samples,
        teacher_steps=args.teacher_steps,
        **method,
        seed=args.seed,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        ema_decay=args.ema_decay,
        grad_clip=args.grad_clip,
        compile=args.compile,
        save_every=args.save_every,
        profile=args.profile,
        log_dir=log_dir,
        log_every=args.log_every,
        given=args.given,
        method_flags={name: readers for name, (_, readers) in READ_BY_RUN["distill"].items() if name in args.given},
    )


REQUESTS = {
    "distill": distill_request,
    "train": train_request,
    "sample": sample_request,
    "evaluate": evaluate_request,
    "export": export_request,
    "benchmark": benchmark_request,
    "train_autoencoder": train_autoencoder_request,
}
