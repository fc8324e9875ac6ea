"""--mode sample: draw --n_samples images from any model file and write a PNG grid (and/or a .npz).

    python main.py --mode sample --model_path checkpoints/mnist.pt --n_samples 16   # SDE-DPM-Solver++, 20 steps
    python main.py --mode sample --model_path checkpoints/mnist.pt --n_samples 16 --sampler ddim
    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime

--implementation auto (the default) runs the fastest implementation verified on the device for the precision
and model (backends/selection.py) and says which in one line; the next says which sampler in how many steps. Without
--sampler a distilled student draws with its own sampler and steps, any other model with SDE-DPM-Solver++ in 20 steps
(choices.DEFAULT_SAMPLER; --sampler ddpm draws DDPM's T steps).

Batches of --batch_size are drawn in order, batch i from its own generator (seed, i): memory stays that
of one batch whatever --n_samples is, and under torchrun rank r draws batches r, r + N, ... which rank 0
gathers and writes in order (data/image_files.SampleWriter streams them to the files).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from tqdm.auto import tqdm

from ddpm.backends import registry
from ddpm.backends.selection import open_for_drawing, sampling_line, select
from ddpm.data.image_files import SampleOutputs, SampleWriter
from ddpm.requests import SampleRequest
from ddpm.util import distributed
from ddpm.util.memory import keep_freed_memory
from ddpm.util.profiling import ProfileConfig, make_profiler
from optimized_diffusion import DeviceKind


def run_sample(request: SampleRequest) -> None:
    # A checkpoint or an exported U-Net (.ts, .onnx, .engine/.plan), with the configs stored in or beside it.
    device, n, ranks = request.device, request.n_samples, distributed.current()
    if device.type == "cpu":
        keep_freed_memory()  # no page faults on every step's fresh activations (util/memory.py)
    opened = open_for_drawing(request)
    selection = select(DeviceKind.of(device), opened.artifact, request)  # what draws this model, decided once
    if selection.auto:
        distributed.say(selection.line)
    artifact, guidance = opened.artifact, opened.guidance
    outputs = SampleOutputs(
        n,
        artifact.output_shape,
        grid=request.grid,
        npz=request.npz,
        grid_scale=request.grid_scale,
        grid_columns=opened.grid_columns,
    )
    outputs.check()
    sampling = replace(request.sampling, clip_denoised=opened.clips_x0(request.sampling.clip_denoised))
    plan = sampling.plan(opened.schedule(), device=device)
    named = dict(named_sampler=sampling.sampler is not None, named_steps=sampling.sampling_steps is not None)
    distributed.say(sampling_line(opened, [(plan.sampler, plan.num_steps)], **named))
    draw = opened.drawer(plan, selection)
    sizes, batch_size = opened.batch_sizes, opened.batch_size
    rounds = range(0, len(sizes), ranks.world_size)
    if ranks.distributed:
        idle = (
            f"; {ranks.world_size - len(sizes)} rank(s) have no batch: lower --batch_size"
            if len(sizes) < ranks.world_size
            else ""
        )
        distributed.say(
            f"{n} samples in {len(sizes)} batch(es) of up to {batch_size}, dealt over {ranks.world_size} ranks{idle}"
        )
    run_name = f"sample-{selection.name}" + (f"-rank{ranks.rank}" if ranks.distributed else "")
    profile = request.profile and ProfileConfig(request.profile, run_name=run_name, total_steps=len(rounds))
    # (each round of batches is one profiler step: a one-batch run is traced whole)
    writer = SampleWriter(outputs) if ranks.is_main else contextlib.nullcontext()
    with writer as out, make_profiler(profile or None, device=device, log=tqdm.write) as profiler:
        bar = tqdm(
            rounds, desc="batches", unit="batch", disable=len(rounds) == 1 or not ranks.is_main, dynamic_ncols=True
        )
        for first in bar:
            index = first + ranks.rank
            images = None
            if index < len(sizes):
                generator = registry.batch_generator(request.seed, index, device=device)
                start = index * batch_size
                rows = guidance.rows(start, start + sizes[index]) if guidance is not None else None
                images = draw(artifact.model_config.sample_shape(sizes[index]), generator, len(sizes) == 1, rows)
            for part in distributed.gather_to_main(images) or []:  # rank 0: this round's batches in rank order
                if part is not None:
                    out.add(part)
            profiler.step()
        written = out.close() if ranks.is_main else []
    guided = f", classes {request.class_label or 'all'} at guidance {guidance.scale:g}" if guidance is not None else ""
    distributed.say(
        f"wrote {', '.join(map(str, written))} ({n} samples, {plan.sampler}, {plan.num_steps} steps{guided})"
    )
