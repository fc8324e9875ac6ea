"""Train DDPMs on small images and sample them fast: the command-line entry point.

    python main.py --mode train --dataset digits --max_steps 1500          # offline, CPU-friendly
    python main.py --mode train --dataset mnist --n_epochs 10              # downloads MNIST
    python main.py --mode train_autoencoder --dataset digits               # a latent model's first stage
    python main.py --mode sample --model_path checkpoints/mnist.pt --n_samples 16 --sampler ddim
    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt        # -> checkpoints/mnist.onnx
    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime
    python main.py --mode benchmark --n_samples 8 --img_size 32 --channels 3 --sampler ddim
    torchrun --nproc_per_node 4 main.py --mode train --dataset cifar10 --batch_size 128  # 4 GPUs (distributed.py)

Every mistake a user can make (a path, a size, a count, a missing dependency) ends with one line
on stderr and exit code 2; ``--help`` lists every flag.
No run replaces a file it should not: every output is checked before work starts (see safe_files.py),
training onto an existing checkpoint needs --resume or --overwrite, and Ctrl-C or SIGTERM end with
one line and exit code 130 or 143 (training saves first).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import cli
import interrupts  # before torch: a Ctrl-C during the first imports ends in one line too
from cli import PROG

if TYPE_CHECKING:
    from mode_requests import (
        AutoencoderTrainRequest, BenchmarkRun, DrawRequest, EvaluateRequest, ExportRequest, NewModel, SampleRequest,
        TrainRequest,
    )
    from implementations import SamplerOptions


# ----- train -------------------------------------------------------------------------------------
def run_train(request: TrainRequest) -> None:
    import contextlib

    import distributed
    from safe_files import run_lock

    checkpoint, ranks = request.checkpoint, distributed.current()
    # A second run on this path is refused until this one ends (rank 0 writes, so rank 0 holds the lock).
    with run_lock(checkpoint) if ranks.is_main else contextlib.nullcontext():
        if Path(checkpoint).exists() and not (request.resume or request.overwrite):
            raise ValueError(
                f"--model_path {checkpoint} already holds a checkpoint; pass --resume to continue it, "
                "or --overwrite to start over and replace it"
            )
        train(resumed_trainer(request) if request.resume else new_trainer(request), profile=request.profile)
    distributed.say(f"checkpoint: {checkpoint}")


def resumed_trainer(request: TrainRequest):
    import distributed
    from checkpoints import load_checkpoint, read_configs, read_link
    from latents import linked_first_stage
    from memory_budget import check_batch_fits
    from training import Trainer, resume_config

    checkpoint, device, ranks = request.checkpoint, request.device, distributed.current()
    state = load_checkpoint(checkpoint)  # validated: configs, sizes
    model_config, schedule_config = read_configs(state, source=f"checkpoint {checkpoint}")
    # Any number of ranks continues a run: the checkpoint holds no rank's own state.
    config = resume_config(
        state, total_steps=request.max_steps, checkpoint=checkpoint, world_size=ranks.world_size,
        grad_checkpoint=request.grad_checkpoint or None,  # memory, not math: a resumed run may turn it on
    )  # fmt: skip
    if request.timestep_sampling not in (None, config.timestep_sampling):
        raise ValueError(
            f"{checkpoint} trains with --timestep_sampling {config.timestep_sampling}, and a resumed run keeps it; "
            f"to train with {request.timestep_sampling}, start a new run (another --model_path, or --overwrite)"
        )
    check_batch_fits(
        model_config, batch_size=config.per_rank_batch(), device=device, training=True, grad_checkpoint=config.grad_checkpoint
    )  # fmt: skip
    # A latent model: its autoencoder, checked against the one it trained with, encodes the data again
    # (the checkpoints this run writes name the autoencoder where it is now).
    stage, autoencoder = linked_first_stage(
        read_link(state, source=f"checkpoint {checkpoint}"), model_config=model_config, source=f"checkpoint {checkpoint}",
        device=device, override=request.autoencoder,
    )  # fmt: skip
    if stage is None:
        images = training_images(
            config.dataset, data_dir=request.model.data_dir, image_size=model_config.image_size, channels=model_config.in_channels
        )
    else:
        images = latent_images(replace(request.model, dataset=config.dataset), autoencoder)
    trainer = Trainer(config, model_config, schedule_config, images=images, device=device, resume_state=state, first_stage=stage)
    distributed.say(f"resuming {checkpoint} at step {trainer.step} of {config.total_steps}{on_ranks(config)}")
    return trainer


def training_images(dataset: str, **kwargs):
    """The training images; under torchrun rank 0 downloads them (if needed) before the others read them."""
    import distributed
    from data import load_images

    ranks = distributed.current()
    if ranks.is_main:
        images = load_images(dataset, **kwargs)
        distributed.barrier()  # the files are in place for the other ranks
        return images
    distributed.barrier()
    return load_images(dataset, download=False, **kwargs)


def latent_images(model: NewModel, autoencoder):
    """The training images at the autoencoder's size, encoded once into its scaled latents (latents.py)."""
    import distributed
    from latents import encode_dataset

    config = autoencoder.config
    images = training_images(model.dataset, data_dir=model.data_dir, image_size=config.image_size, channels=config.in_channels)
    distributed.say(f"encoding {len(images)} {model.dataset} images with {autoencoder.path} ...")
    return encode_dataset(images, autoencoder, source=autoencoder.path)


def on_ranks(config) -> str:
    """``" on 4 ranks (gloo), 32 images each"`` for a distributed run, ``""`` for one process."""
    import distributed

    if config.world_size == 1:
        return ""
    return f" on {config.world_size} ranks ({distributed.backend()}), {config.per_rank_batch()} images each"


def new_trainer(request: TrainRequest):
    import distributed
    from basic_diffusion import count_parameters
    from memory_budget import check_batch_fits
    from training import TrainConfig, Trainer

    spec, device, ranks = request.model, request.device, distributed.current()
    stage = None
    if request.autoencoder:  # a latent model: the U-Net's data are the autoencoder's latents
        from latents import load_first_stage

        stage, autoencoder = load_first_stage(request.autoencoder, device=device)
        channels, size = autoencoder.config.in_channels, autoencoder.config.image_size
        if spec.image_size not in (0, size) or spec.channels not in (0, channels):
            raise ValueError(
                f"--autoencoder {request.autoencoder} encodes {channels}x{size}x{size} images; drop --img_size and --channels "
                "(a latent model trains at its autoencoder's size), or train an autoencoder at the size you want"
            )
        latent_channels, latent_side = stage.latent_shape[0], stage.latent_shape[-1]
        spec = replace(spec, image_size=latent_side, channels=latent_channels)
    model_config = spec.model_config()  # validates before any download
    if stage is None:
        from checkpoints import check_pixel_unet

        check_pixel_unet(model_config, source="--channels")  # images have 1 or 3
    distributed.check_global_batch(request.batch_size, world_size=ranks.world_size)
    check_batch_fits(
        model_config, batch_size=request.batch_size // ranks.world_size, device=device, training=True,
        grad_checkpoint=request.grad_checkpoint,
    )  # fmt: skip
    if stage is None:
        images = training_images(spec.dataset, data_dir=spec.data_dir, image_size=spec.image_size, channels=spec.channels)
    else:
        images = latent_images(request.model, autoencoder)
    if request.class_cond:  # one label embedding per class, and the null label
        if images.labels is None:
            raise ValueError(
                f"--class_cond needs labels; the {spec.dataset} images have none (a folder's classes are its "
                "sub-folders: put every image in one)"
            )
        model_config = replace(model_config, num_classes=len(images.class_names))
    # --max_steps alone sets the length; with --n_epochs (default 10) it caps it.
    if request.n_epochs is None and request.max_steps:
        total = request.max_steps
    else:
        total = (request.n_epochs or 10) * images.steps_per_epoch(request.batch_size)
        total = min(total, request.max_steps) if request.max_steps else total
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
    trainer = Trainer(config, model_config, spec.schedule_config(), images=images, device=device, first_stage=stage)
    what = "volumes" if model_config.dims == 3 else "images" if stage is None else "images' latents"
    distributed.say(
        f"training {count_parameters(trainer.model) / 1e6:.2f}M-parameter U-Net on {len(images)} {spec.dataset} "
        f"{what} ({'x'.join(map(str, model_config.sample_shape(1)[1:]))}) "
        f"for {total} steps on {device.type}, {request.precision}"
        f"{on_ranks(config)}"
        + (f", conditioned on {len(images.class_names)} classes ({config.cond_drop:.0%} of labels dropped)" if model_config.num_classes else "")
    )
    return trainer


def train(trainer, *, profile: str | None = None) -> None:
    """Run the training loop; on Ctrl-C or SIGTERM save a whole step's state, then exit 130 or 143.

    A run stopped before its first step saves nothing, so the file it would replace stays as it was.
    With ``profile`` (--profile DIR) a few steps of the run are traced (profiling.py).
    """
    import distributed

    start, ranks = trainer.step, distributed.current()
    try:
        if profile and trainer.config.total_steps > start:
            from tqdm.auto import tqdm

            from profiling import ProfileConfig, make_profiler

            run_name = f"train-rank{ranks.rank}" if ranks.distributed else "train"
            config = ProfileConfig(profile, run_name=run_name, total_steps=trainer.config.total_steps - start)
            with make_profiler(config, device=trainer.device, log=tqdm.write) as profiler:
                trainer.run(profiler=profiler)
        else:
            trainer.run()
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, interrupts.Interrupted) else interrupts.Interrupted()
        if trainer.step == start:
            if ranks.is_main:
                print(f"\n{stop.name}: stopped before the first step; nothing was saved", file=sys.stderr)
            raise SystemExit(stop.exit_code) from None
        with interrupts.deferred(reraise=False):  # a second signal does not cut this save
            path = trainer.save()  # rank 0 writes; every rank stopped after the same step
        if ranks.is_main:
            print(f"\n{stop.name}: stopped at step {trainer.step}; saved {path} (continue with --resume)", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None


def run_train_autoencoder(request: AutoencoderTrainRequest) -> None:
    """The first stage of a latent model; an existing checkpoint is replaced only with --overwrite."""
    from autoencoder_training import train_autoencoder
    from safe_files import run_lock

    with run_lock(request.checkpoint):  # a second run on this path is refused until this one ends
        if Path(request.checkpoint).exists() and not request.overwrite:
            raise ValueError(
                f"--model_path {request.checkpoint} already holds a checkpoint; pass --overwrite to start over and replace it"
            )
        train_autoencoder(request)


# ----- sample ------------------------------------------------------------------------------------
def run_sample(request: SampleRequest) -> None:
    import contextlib

    from tqdm.auto import tqdm

    import distributed
    import implementations
    from artifacts import artifact_kind, load_artifact
    from conditioning import unet_batch
    from image_files import SampleOutputs, SampleWriter
    from latents import clips_x0
    from memory_budget import check_batch_fits
    from noise_schedule import NoiseSchedule
    from profiling import ProfileConfig, make_profiler

    # A checkpoint or an exported U-Net (.ts, .onnx, .engine/.plan), with the configs stored in or beside it.
    source, device, n, ranks = request.source, request.device, request.n_samples, distributed.current()
    implementations.get(request.implementation).check(kind=artifact_kind(source.path), precision=request.precision)
    artifact = load_artifact(
        source.path, device=device, weights=source.weights, trust_torchscript=source.trust_torchscript,
        autoencoder=source.autoencoder,
    )  # fmt: skip
    model, model_config = artifact.model, artifact.model_config
    guidance, columns = requested_classes(request, artifact)  # None for an unconditional model
    outputs = SampleOutputs(
        n, artifact.output_shape, grid=request.grid, npz=request.npz, grid_scale=request.grid_scale, grid_columns=columns
    )
    outputs.check()
    batch_size = min(request.batch_size, n)
    check_batch_fits(model_config, batch_size=unet_batch(batch_size, guidance), device=device, training=False)
    sampling = replace(request.sampling, clip_denoised=clips_x0(request.sampling.clip_denoised, artifact.first_stage))
    plan = sampling.plan(NoiseSchedule(artifact.schedule_config).to(device), device=device)
    draw = implementations.make_drawer(
        request.implementation, model, plan, options=sampler_options(request, source=artifact.path, guidance=guidance),
        first_stage=artifact.first_stage,
    )  # fmt: skip
    # Batches of --batch_size in order, batch i from its own generator (seed, i): memory stays that of one
    # batch, and under torchrun rank r draws batches r, r + N, ... which rank 0 gathers and writes in order.
    sizes = [min(batch_size, n - start) for start in range(0, n, batch_size)]
    rounds = range(0, len(sizes), ranks.world_size)
    if ranks.distributed:
        idle = f"; {ranks.world_size - len(sizes)} rank(s) have no batch: lower --batch_size" if len(sizes) < ranks.world_size else ""
        distributed.say(f"{n} samples in {len(sizes)} batch(es) of up to {batch_size}, dealt over {ranks.world_size} ranks{idle}")
    run_name = f"sample-{request.implementation}" + (f"-rank{ranks.rank}" if ranks.distributed else "")
    profile = request.profile and ProfileConfig(request.profile, run_name=run_name, total_steps=len(rounds))
    # (each round of batches is one profiler step: a one-batch run is traced whole)
    writer = SampleWriter(outputs) if ranks.is_main else contextlib.nullcontext()
    with writer as out, make_profiler(profile or None, device=device, log=tqdm.write) as profiler:
        bar = tqdm(rounds, desc="batches", unit="batch", disable=len(rounds) == 1 or not ranks.is_main, dynamic_ncols=True)
        for first in bar:
            index = first + ranks.rank
            images = None
            if index < len(sizes):
                generator = implementations.batch_generator(request.seed, index, device=device)
                start = index * batch_size
                rows = guidance.rows(start, start + sizes[index]) if guidance is not None else None
                images = draw(model_config.sample_shape(sizes[index]), generator, len(sizes) == 1, rows)
            for part in distributed.gather_to_main(images) or []:  # rank 0: this round's batches in rank order
                if part is not None:
                    out.add(part)
            profiler.step()
        written = out.close() if ranks.is_main else []
    guided = f", classes {request.class_label or 'all'} at guidance {guidance.scale:g}" if guidance is not None else ""
    distributed.say(f"wrote {', '.join(map(str, written))} ({n} samples, {plan.sampler}, {plan.num_steps} steps{guided})")


def requested_classes(request: DrawRequest, artifact):
    """(guidance with one label per image, grid columns) for a class-conditional model; (None, None) otherwise."""
    import implementations
    from conditioning import guidance_for

    if artifact.model_config.num_classes:
        implementations.get(request.implementation).check(conditional=True)
    return guidance_for(
        artifact.model_config, artifact.class_names, class_label=request.class_label, scale=request.guidance_scale,
        n_samples=request.n_samples, source=artifact.path,
    )  # fmt: skip


def sampler_options(request: DrawRequest, *, source: str | Path, guidance=None) -> SamplerOptions:
    from implementations import SamplerOptions

    return SamplerOptions(
        precision=request.precision, opset=request.opset, tensorrt=request.engine.options(source=source), guidance=guidance
    )


# ----- export ------------------------------------------------------------------------------------
def run_export(request: ExportRequest) -> None:
    import artifacts

    source, output = request.source, request.output
    lines = artifacts.export_artifact(
        source.path,
        fmt=request.fmt,
        output=output,
        weights=source.weights,
        device=request.device,
        precision=request.precision,
        opset=request.opset,
        tensorrt_options=request.engine.options(source=source.path) if request.fmt == "tensorrt" else None,
        autoencoder=source.autoencoder,
    )
    for line in lines:
        print(line)


# ----- benchmark ---------------------------------------------------------------------------------
def run_benchmark(run: BenchmarkRun) -> None:
    """Every implementation on one model: a checkpoint (--model_path), or a fresh U-Net of --img_size/--channels."""
    import torch

    import benchmark
    import benchmark_training
    import distributed
    from artifacts import artifact_kind
    from basic_diffusion import UNet
    from checkpoints import load_checkpoint_parts
    from conditioning import guidance_for, unet_batch
    from latents import clips_x0, linked_first_stage
    from memory_budget import check_batch_fits
    from noise_schedule import NoiseSchedule

    request, device, training = run.request, run.device, run.bench == "training"
    stage = None  # a latent model's first stage
    if distributed.current().distributed and not training:
        raise ValueError("under torchrun, benchmark mode measures training (--bench training); time sampling in one process")
    if run.source:
        if artifact_kind(run.source.path) != "checkpoint":
            raise ValueError(f"benchmark mode measures a checkpoint (.pt) in every implementation; got {run.source.path}")
        model, schedule_config, class_names, link, _ = load_checkpoint_parts(run.source.path, weights=run.source.weights)
        if link is not None and training and run.source.autoencoder:
            raise ValueError("--autoencoder: --bench training times the U-Net on random latents; it reads no autoencoder")
        if not training or link is None:  # a latent model is timed whole (loop, then decoder); a pixel model refuses --autoencoder
            stage, _ = linked_first_stage(
                link, model_config=model.config, source=f"checkpoint {run.source.path}", device=device,
                override=run.source.autoencoder,
            )  # fmt: skip
    else:
        class_names, link = (), None
        torch.manual_seed(run.seed)
        model = UNet(run.model.model_config())
        benchmark.perturb_zero_init(model, seed=run.seed)
        schedule_config = run.model.schedule_config()
    guidance = None
    if not training:  # a conditional model is timed guided, every class in turn
        source = run.source.path if run.source else "a fresh U-Net"
        guidance, _ = guidance_for(
            model.config, class_names, class_label=None, scale=run.guidance_scale, n_samples=run.n_samples, source=source
        )
    batch, flag = (run.batch_size, "--batch_size") if training else (run.n_samples, "--n_samples")
    if training:
        batch //= distributed.current().world_size  # under torchrun: one rank's share of the global batch
    check_batch_fits(model.config, batch_size=unet_batch(batch, guidance), device=device, training=training, flag=flag)
    model.to(device).eval()
    sampling = replace(run.sampling, clip_denoised=clips_x0(run.sampling.clip_denoised, stage))
    plan = sampling.plan(NoiseSchedule(schedule_config), device=device)
    if training:
        benchmark_training.main_training(  # a latent U-Net trains on float latents, not uint8 images
            request, model_config=model.config, schedule_config=schedule_config, device=device, latent=link is not None
        )
        return
    benchmark.main(
        request, model=model, plan=plan, shape=model.config.sample_shape(run.n_samples), precision=run.precision,
        guidance=guidance, first_stage=stage,
    )  # fmt: skip


# ----- evaluate ----------------------------------------------------------------------------------
def inception_judge(dataset: str, *, data_dir: str, image_size: int, channels: int, n: int, request: EvaluateRequest):
    """FID/KID against the model's training images; the ceiling from its test split (or the folder's other half)."""
    import inception_metrics
    from data import TEST_SPLITS, load_images

    weights = inception_metrics.weights_file(request.inception_weights)  # before the data: fail fast offline
    train = load_images(dataset, data_dir=data_dir, image_size=image_size, channels=channels).images
    held = (
        load_images(dataset, data_dir=data_dir, image_size=image_size, channels=channels, train=False).images
        if dataset in TEST_SPLITS else None
    )  # fmt: skip
    reference, ceiling = inception_metrics.real_splits(train, held, n=n, seed=request.seed)
    print(f"Inception features of {n} real {dataset} images (the reference) ...")
    extractor = inception_metrics.inception_extractor(weights, device=request.device)
    return inception_metrics.InceptionJudge(reference, ceiling, extractor=extractor, seed=request.seed)


def voxel_judge(dataset: str, *, data_dir: str, size: int, n: int, seed: int):
    """Volumes: best-fit-sphere IoU, and PSNR/SSIM against the nearest training volume; the ceiling from
    held-out spheres (or, for the user's volumes, the half of them the reference leaves out)."""
    import volumes
    from data import TEST_SPLITS, load_images

    train = load_images(dataset, data_dir=data_dir, image_size=size).images
    if dataset in TEST_SPLITS:
        held = load_images(dataset, data_dir=data_dir, image_size=size, train=False).images
    else:
        half = len(train) // 2
        if half < 1:
            raise ValueError(f"evaluate needs at least 2 volumes in {data_dir}: one reference, one held out")
        train, held = train[:half], train[half:]
    if n > len(held):
        raise ValueError(f"--n_samples {n} is more than the {len(held)} held-out real volumes the ceiling is scored on")
    return volumes.VoxelJudge(train, held, seed=seed)


def run_evaluate(request: EvaluateRequest) -> None:
    """Sample quality for each --sampler x --sampling_steps: digits against real digits (a classifier and
    a Frechet distance), other data by FID/KID against the training images."""
    import torch
    from tqdm.auto import tqdm

    import evaluate
    import implementations
    from artifacts import artifact_kind, load_artifact
    from conditioning import unet_batch
    from data import VOLUME_DATASETS
    from latents import clips_x0
    from memory_budget import check_batch_fits
    from noise_schedule import NoiseSchedule

    source, device, n = request.source, request.device, request.n_samples
    if request.chart:
        import matplotlib  # noqa: F401  (fail now, not after the sweep)
    kind = artifact_kind(source.path)
    implementations.get(request.implementation).check(kind=kind, precision=request.precision)
    artifact = load_artifact(
        source.path, device=device, weights=source.weights, trust_torchscript=source.trust_torchscript,
        autoencoder=source.autoencoder,
    )  # fmt: skip
    # The training data: recorded in a checkpoint, and in exports since 2026-11-24; --dataset names it for
    # older exported files. The real images for FID/KID are read from --data_dir.
    given = request.dataset if kind != "checkpoint" else None
    dataset = given or artifact.dataset or "mnist"
    model, model_config = artifact.model, artifact.model_config
    c, s = artifact.output_shape[0], artifact.output_shape[-1]  # the images judged (a latent model's decoded)
    if (model_config.dims == 3) != (dataset in VOLUME_DATASETS):  # an exported file's --dataset named wrongly
        kind_of = "a 3-D (volume)" if model_config.dims == 3 else "a 2-D (image)"
        raise ValueError(f"{source.path} is {kind_of} model but {dataset} is not its kind of data; name its training data with --dataset")
    guidance, _ = requested_classes(request, artifact)  # a conditional model: each digit asked for equally often
    batch_size = min(request.batch_size, n)
    check_batch_fits(model_config, batch_size=unet_batch(batch_size, guidance), device=device, training=False)
    schedule = NoiseSchedule(artifact.schedule_config).to(device)
    if dataset == "digits":
        print(f"fitting the digit classifier and feature space to the real digits at {s}x{s} ...")
        judge = evaluate.DigitJudge(image_size=s, seed=request.seed)
    elif model_config.dims == 3:
        judge = voxel_judge(dataset, data_dir=request.data_dir, size=s, n=n, seed=request.seed)
    else:
        judge = inception_judge(dataset, data_dir=request.data_dir, image_size=s, channels=c, n=n, request=request)
    sizes = [min(batch_size, n - start) for start in range(0, n, batch_size)]
    options = sampler_options(request, source=artifact.path, guidance=guidance)

    def draw(sampler: str, num_steps: int | None) -> tuple[torch.Tensor, int]:
        plan = schedule.make_plan(
            sampler, num_steps=num_steps, eta=request.eta if sampler == "ddim" else 0.0,
            clip_denoised=clips_x0(request.clip_denoised, artifact.first_stage), device=device,
        )  # fmt: skip
        drawer = implementations.make_drawer(request.implementation, model, plan, options=options, first_stage=artifact.first_stage)
        generator = torch.Generator(device).manual_seed(request.seed)  # the same noise for every row
        batches = [
            drawer(model_config.sample_shape(size), generator, False, guidance.rows(i * batch_size, i * batch_size + size) if guidance else None)
            .float().cpu()  # sync: the batch leaves the device
            for i, size in enumerate(tqdm(sizes, desc=f"{sampler} {plan.num_steps} steps", unit="batch", leave=False))
        ]  # fmt: skip
        return torch.cat(batches), plan.num_steps

    result = evaluate.run_sweep(
        draw, judge, samplers=request.samplers, steps=request.steps, n_samples=n, seed=request.seed, image_size=s,
        requested=None if guidance is None else guidance.labels,
    )  # fmt: skip
    result.update(model_path=str(source.path), implementation=request.implementation, precision=request.precision)
    if guidance is not None:
        result.update(guidance_scale=guidance.scale, class_names=list(artifact.class_names))
    print()
    print(evaluate.format_table(result))
    if request.json:
        evaluate.write_json(result, request.json)
        print(f"wrote {request.json}")
    if request.chart:
        evaluate.write_plot(result, request.chart)
        print(f"wrote {request.chart}")


MODES = {
    "train": run_train, "sample": run_sample, "evaluate": run_evaluate, "export": run_export, "benchmark": run_benchmark,
    "train_autoencoder": run_train_autoencoder,
}  # fmt: skip
DISTRIBUTED_MODES = ("train", "sample", "benchmark")  # the modes that run under torchrun


def one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def report(message: str) -> None:
    """The one error line, written whole in one call (ranks share the terminal: lines must not interleave)."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Run one mode; every failure a user can cause ends in one line on stderr and a documented exit code:
    2 for a user error (or memory exhausted), 1 for a training run that diverged, 130/143 for Ctrl-C/SIGTERM."""
    interrupts.install()
    try:
        args = cli.build_parser().parse_args(argv)  # --help and argparse's own errors (exit 2) end here
        import torch  # noqa: F401  (imported here, under the signal handlers)

        from memory_budget import is_out_of_memory
        from training import TrainingDiverged

        import distributed

        ranks = distributed.current()  # replaced by torchrun's place once the environment is read
        try:
            ranks = distributed.from_environment()  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; one process without
            if ranks.distributed and args.mode not in DISTRIBUTED_MODES:
                raise ValueError(f"--mode {args.mode} runs in one process; start it with python, not torchrun")
            request = cli.request_for(args)
            with distributed.session(ranks, request.device) as device:  # each rank on its own GPU
                MODES[args.mode](replace(request, device=device))
        except (ValueError, OSError, ImportError) as exc:  # user errors, incl. a missing build or package
            report(f"{ranks.label()}{one_line(exc)}")
            return 2
        except TrainingDiverged as exc:
            report(f"{ranks.label()}{one_line(exc)}")
            return 1
        except (RuntimeError, MemoryError) as exc:
            if distributed.is_collective_failure(exc, ranks=ranks):  # another rank failed (it said why) or vanished
                report(f"{ranks.label()}stopped: the other ranks went away ({one_line(exc)[:200]})")
                return 1
            if not is_out_of_memory(exc):
                raise
            place = "GPU" if "cuda" in str(exc).lower() else "machine"
            report(f"{ranks.label()}the {place} ran out of memory; lower --batch_size or --n_samples")
            return 2
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, interrupts.Interrupted) else interrupts.Interrupted()
        print(f"\n{PROG}: {stop.name}: stopped", file=sys.stderr)
        return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
