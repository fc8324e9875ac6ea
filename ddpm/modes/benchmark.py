"""--mode benchmark: every implementation on one model, timed side by side (or training steps with
--bench training).

    python main.py --mode benchmark --n_samples 8 --img_size 32 --channels 3 --sampler ddim
    python main.py --mode benchmark --model_path checkpoints/digits.pt --bench training

The model is a checkpoint (--model_path) or a fresh U-Net of --img_size/--channels whose zero-initialized
layers get small random weights, so that implementations do not agree trivially on eps = 0. The timing itself is
benchmarks/sampling_bench.py's and benchmarks/training_bench.py's. A run left at its defaults gets the quick plan
of benchmarks/plan.py (the header says how to ask for the full run).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from basic_diffusion import UNet
from ddpm.backends.artifacts import load_model_parts
from ddpm.backends.selection import choose
from ddpm.batch_memory import check_batch_fits
from ddpm.benchmarks import sampling_bench, training_bench
from ddpm.benchmarks.plan import choose_plan
from ddpm.conditioning import guidance_for, unet_batch
from ddpm.latent.autoencoder import clips_x0, linked_first_stage
from ddpm.requests import BenchmarkRun, check_mode_outputs
from ddpm.util import distributed
from noise_schedule import NoiseSchedule
from optimized_diffusion import DeviceKind


def auto_row(device: torch.device, *, precision: str, dims: int) -> str:
    """The row ``--implementation auto`` would run for a checkpoint of this U-Net here."""
    return choose(DeviceKind.of(device), precision=precision, dims=dims).implementation


def run_benchmark(run: BenchmarkRun) -> None:
    """Every implementation on one model: a checkpoint (--model_path), or a fresh U-Net of --img_size/--channels."""
    request, device, training = run.request, run.device, run.bench == "training"
    stage = None  # a latent model's first stage
    if distributed.current().distributed and not training:
        raise ValueError(
            "under torchrun, benchmark mode measures training (--bench training); time sampling in one process"
        )
    if run.source:
        model, schedule_config, class_names, link, _ = load_model_parts(run.source.path, weights=run.source.weights)
        if link is not None and training and run.source.autoencoder:
            raise ValueError(
                "--autoencoder: --bench training times the U-Net on random latents; it reads no autoencoder"
            )
        if (
            not training or link is None
        ):  # a latent model is timed whole (loop, then decoder); a pixel model refuses --autoencoder
            stage, _ = linked_first_stage(
                link,
                model_config=model.config,
                source=f"checkpoint {run.source.path}",
                device=device,
                override=run.source.autoencoder,
                folder=Path(run.source.path).parent,
            )
        if stage is not None:  # the autoencoder the checkpoint named is an input too
            outputs = {"--json": request.json, "--csv": request.csv, "--chart": request.chart}
            inputs = {"--model_path": run.source.path, "its autoencoder": stage.link["path"]}
            check_mode_outputs("benchmark", outputs, inputs=inputs)
    else:
        class_names, link = (), None
        torch.manual_seed(request.seed)
        model = UNet(run.model.model_config())
        sampling_bench.perturb_zero_init(model, seed=request.seed)
        schedule_config = run.model.schedule_config()
    guidance = None
    if not training:  # a conditional model is timed guided, every class in turn
        source = run.source.path if run.source else "a fresh U-Net"
        guidance, _ = guidance_for(
            model.config,
            class_names,
            class_label=None,
            scale=run.guidance_scale,
            n_samples=run.n_samples,
            source=source,
        )
    batch, flag = (request.batch_size, "--batch_size") if training else (run.n_samples, "--n_samples")
    if training:
        batch //= distributed.current().world_size  # under torchrun: one rank's share of the global batch
    check_batch_fits(model.config, batch_size=unet_batch(batch, guidance), device=device, training=training, flag=flag)
    model.to(device).eval()
    sampling = replace(run.sampling, clip_denoised=clips_x0(run.sampling.clip_denoised, stage))
    plan = sampling.plan(NoiseSchedule(schedule_config), device=device)
    quick = choose_plan(
        device_type=device.type,
        steps=plan.num_steps,
        rows=request.rows,
        auto_row=None if training else auto_row(device, precision=run.precision, dims=model.config.dims),
        steps_given="sampling_steps" in request.given,
        rows_given="rows" in request.given,
    )
    if not training and quick.note:  # defaults left as they are: the quick plan
        request = replace(request, rows=quick.rows)
        if quick.steps != plan.num_steps:
            plan = replace(sampling, sampling_steps=quick.steps).plan(NoiseSchedule(schedule_config), device=device)
    if training:
        training_bench.benchmark_training(  # a latent U-Net trains on float latents, not uint8 images
            request, model_config=model.config, schedule_config=schedule_config, device=device, latent=link is not None
        )
        return
    sampling_bench.benchmark_sampling(
        request,
        model=model,
        plan=plan,
        shape=model.config.sample_shape(run.n_samples),
        precision=run.precision,
        guidance=guidance,
        first_stage=stage,
        plan_note=quick.note,
    )
