"""--mode evaluate: sample quality for each --sampler x --sampling_steps, with its ceiling and floor.

    python main.py --mode evaluate --model_path checkpoints/digits.pt      # one row: SDE-DPM-Solver++, 20 steps
    python main.py --mode evaluate --model_path checkpoints/digits.pt --sampler ddpm,dpm_solver --sampling_steps 10,20
    python main.py --mode evaluate --model_path checkpoints/cifar10.pt --n_samples 10000 --json q.json --chart q.png

The digits are judged by a classifier and Frechet distance fitted to real digits, volumes by best-fit
spheres and PSNR/SSIM, other data by FID/KID against the training images (evaluation/judges.py).
Every row draws the same noise (one generator seeded with --seed), so rows differ only by sampler.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ddpm.backends.selection import open_for_drawing, sampling_line, select
from ddpm.data.catalog import VOLUME_DATASETS
from ddpm.data.datasets import data_input
from ddpm.evaluation import quality
from ddpm.evaluation.judges import judge_for
from ddpm.requests import EvaluateRequest, check_mode_outputs, own_sampling
from ddpm.util import distributed
from ddpm.util.memory import check_held_in_host_memory
from optimized_diffusion import DeviceKind


def check_samples_fit(n: int, shape: tuple[int, ...]) -> None:
    """Evaluate holds every sample of a row (float32) while it is judged: refuse a count that cannot fit,
    saying how many do (half the available memory; the judge's features and the next row need the rest)."""
    each = 4 * math.prod(shape)
    check_held_in_host_memory(
        n * each,
        what=f"--n_samples {n}: the samples of one row ({'x'.join(map(str, shape))} float32 each)",
        advice=lambda free: f"at most {free // (2 * each)} fit",
    )


def model_identity(opened) -> str | None:
    """The evaluated model's content hash as a student records its teacher's (training/distill.py's
    teacher_identity: the EMA weights and the configs), or None for a file holding no PyTorch weights to hash."""
    from ddpm.backends.artifacts import load_artifact
    from ddpm.training.distill import TEACHER_KINDS, teacher_identity

    artifact, source = opened.artifact, opened.request.source
    if artifact.kind not in TEACHER_KINDS:
        return None
    if source.weights != "ema":  # --no_ema draws the raw weights; a teacher is known by its EMA weights
        artifact = load_artifact(source.path, device=opened.request.device, autoencoder=source.autoencoder)
    return teacher_identity(artifact)


def check_teacher(path: str, student, *, like, identity: Callable[[], str | None]) -> None:
    """A student's checkpoint records its teacher by content (``distill_config``'s teacher_sha256): a student of
    another model is refused; one whose teacher cannot be compared (an exported student records none, an exported
    teacher holds no weights to hash, an older run records a path) is said in one line, never passed silently."""
    from ddpm.formats.checkpoints import load_checkpoint
    from ddpm.training.distill import DistillConfig
    from ddpm.util.safe_files import resolved

    ours = like.artifact.path
    # Only a .pt checkpoint records its teacher: a .safetensors or diffusers export is a "checkpoint" to the
    # implementations too (formats/torch_files.artifact_kind), but holds the weights and configs alone.
    checkpoint = student.artifact.kind == "checkpoint" and Path(path).suffix == ".pt" and not Path(path).is_dir()
    state = load_checkpoint(path) if checkpoint else {}
    if "distill_config" not in state:
        distributed.say(f"--students {path} records no teacher (an export of a student): its teacher cannot be checked")
        return
    try:
        recorded = DistillConfig.from_dict(state["distill_config"])
    except ValueError as exc:
        raise ValueError(f"--students {path}: {exc}") from None
    teacher = Path(recorded.teacher).name
    if not recorded.teacher_sha256:  # a run that predates the teacher's hash knows it by path only
        if resolved(recorded.teacher) != resolved(ours):
            distributed.say(f"--students {path} records its teacher by path only ({teacher}): not checked")
        return
    ours_hash = identity()
    if ours_hash is None:
        distributed.say(
            f"--students {path}: {ours} holds no PyTorch weights to compare with its teacher's: not checked"
        )
    elif ours_hash != recorded.teacher_sha256:
        raise ValueError(
            f"--students {path} is a student of another model ({teacher}, whose weights and configs hash to "
            f"{recorded.teacher_sha256[:16]}), not of --model_path {ours} ({ours_hash[:16]}); compare a student with "
            "its own teacher"
        )


def open_student(request: EvaluateRequest, path: str, *, like, identity: Callable[[], str | None]):
    """A distilled student for the same table: the same kind of images, drawn with its own sampler and steps, and a
    student of ``like`` (``identity``: its content hash, check_teacher)."""
    from dataclasses import replace

    student = open_for_drawing(replace(like.request, source=replace(request.source, path=path)))
    config = student.artifact.schedule_config
    if not config.is_student:
        raise ValueError(f"--students {path} is not a distilled student (--mode distill makes one)")
    if student.artifact.output_shape != like.artifact.output_shape:
        raise ValueError(
            f"--students {path} draws {'x'.join(map(str, student.artifact.output_shape))} images, "
            f"not the {'x'.join(map(str, like.artifact.output_shape))} of {like.artifact.path}"
        )
    ours, theirs = student.artifact.class_names, like.artifact.class_names
    if bool(student.artifact.model_config.num_classes) != bool(like.artifact.model_config.num_classes):
        which = "a class-conditional model" if ours else "an unconditional model"
        other = "is not" if ours else "is class-conditional"
        raise ValueError(
            f"--students {path} is {which} and --model_path {like.artifact.path} {other}; compare a student with "
            "its own teacher"
        )
    if ours != theirs:
        raise ValueError(f"--students {path} draws other classes than --model_path {like.artifact.path}")
    check_teacher(path, student, like=like, identity=identity)
    check_mode_outputs("evaluate", request.outputs(), inputs={"--students": path, **student.artifact.inputs})
    return student


def estimate(opened, row_steps: list[int], students: list) -> str:
    """The sweep's line before it starts (util/estimates.py): its U-Net calls per image summed over the rows (a
    guided row's twice), their time at the model's own pace (one batch timed), and one row's samples held."""
    from ddpm.util.estimates import phase_line, seconds_per_call
    from ddpm.util.memory import available_bytes

    request, artifact = opened.request, opened.artifact
    doubled = 2 if opened.guidance is not None and opened.guidance.doubled else 1
    batch_steps = doubled * sum(row_steps) + sum(len(s.artifact.schedule_config.student_timesteps) for s in students)
    config, size = artifact.model_config, opened.batch_size
    x = torch.zeros(config.sample_shape(size), device=request.device)
    t = torch.ones(size, dtype=torch.long, device=request.device)
    labels = (torch.zeros(size, dtype=torch.long, device=request.device),) if config.num_classes else ()
    seconds = seconds_per_call(lambda: artifact.model(x, t, *labels), device=request.device)
    rows = len(row_steps) + len(students)
    return phase_line(
        f"evaluate: {rows} row{'s' if rows > 1 else ''} of {request.n_samples:,} samples",
        calls=batch_steps * request.n_samples,
        seconds=seconds * batch_steps * len(opened.batch_sizes),
        held_bytes=4 * math.prod(artifact.output_shape) * request.n_samples,
        available_bytes=available_bytes(torch.device("cpu")),
    )


def judged_dataset(request: EvaluateRequest, artifact) -> str:
    """The training data the model is judged against: recorded in a checkpoint and in an export; --dataset names it
    for exported files too old to record it, and may not contradict a recorded one (the real images for FID/KID are
    read from --data_dir; backends/selection.check_recorded_dataset refused a contradiction as the file was opened)."""
    path = request.source.path
    dataset = artifact.dataset or request.dataset
    if dataset is None:  # guessing would judge the model against data it never saw
        raise ValueError(
            f"{path} records no training dataset; name the data to judge it against with --dataset "
            "(and --data_dir for a folder of images)"
        )
    if (artifact.model_config.dims == 3) != (dataset in VOLUME_DATASETS):  # an exported file's --dataset named wrongly
        kind_of = "a 3-D (volume)" if artifact.model_config.dims == 3 else "a 2-D (image)"
        raise ValueError(
            f"{path} is {kind_of} model but {dataset} is not its kind of data; name its training data with --dataset"
        )
    if request.data_dir_given and data_input(dataset, request.data_dir) is None:  # it would be ignored
        raise ValueError(
            f"--data_dir {request.data_dir}: {path} is a model of {dataset}, which no folder holds (it comes with the "
            "tool); drop --data_dir"
        )
    return dataset


def row_plan(sampler: str, sampling_steps: int | None, *, request: EvaluateRequest, opened):
    """A row's plan on the request's device: ``opened``'s model drawn by ``sampler`` in ``sampling_steps`` (None: a
    student's own timesteps for its own sampler, else the sampler's default steps)."""
    schedule = opened.schedule()
    _, timesteps = own_sampling(schedule.config, sampler=sampler, sampling_steps=sampling_steps)
    return schedule.make_plan(
        sampler,
        sampling_steps=sampling_steps,
        timesteps=timesteps,
        eta=request.eta if sampler == "ddim" else 0.0,
        clip_denoised=opened.clips_x0(request.clip_denoised),
        device=request.device,
    )


def draw_row(
    sampler: str, sampling_steps: int | None, *, request: EvaluateRequest, opened, selection
) -> tuple[torch.Tensor, int]:
    """One row's samples (float32, on the CPU) and its steps: ``opened``'s model (the evaluated one or a student)
    drawn by ``sampler`` from the same noise as every other row (one generator seeded with --seed), by what
    ``selection`` says draws the evaluated model (its students the same)."""
    device = request.device
    plan = row_plan(sampler, sampling_steps, request=request, opened=opened)
    drawer = opened.drawer(plan, selection)
    generator = torch.Generator(device).manual_seed(request.seed)  # the same noise for every row
    sizes, batch_size = opened.batch_sizes, opened.batch_size
    batches = [
        drawer(
            opened.artifact.model_config.sample_shape(size),
            generator,
            False,
            opened.guidance.rows(i * batch_size, i * batch_size + size) if opened.guidance else None,
        )
        .float()
        .cpu()  # sync: the batch leaves the device
        for i, size in enumerate(tqdm(sizes, desc=f"{sampler} {plan.num_steps} steps", unit="batch", leave=False))
    ]
    return torch.cat(batches), plan.num_steps


def run_evaluate(request: EvaluateRequest) -> None:
    source, device, n = request.source, request.device, request.n_samples
    opened = open_for_drawing(request)
    selection = select(DeviceKind.of(device), opened.artifact, request)  # what draws this model, decided once
    if selection.auto:
        distributed.say(selection.line)
    artifact, guidance = opened.artifact, opened.guidance
    dataset = judged_dataset(request, artifact)
    c, s = artifact.output_shape[0], artifact.output_shape[-1]  # the images judged (a latent model's decoded)
    check_samples_fit(n, artifact.output_shape)
    # None (no --sampler): a student's own sampler, any other model's choices.DEFAULT_SAMPLER
    config = artifact.schedule_config
    samplers = [s or own_sampling(config, sampler=None, sampling_steps=None)[0] for s in request.samplers]
    rows = [  # every row's plan before the first is drawn (a bad step count ends it now)
        (sampler, row_plan(sampler, steps, request=request, opened=opened).num_steps)
        for sampler in samplers
        for steps in request.sampling_steps
    ]
    named = dict(named_sampler=request.samplers != [None], named_steps=request.sampling_steps != [None])
    distributed.say(sampling_line(opened, rows, **named))
    row_steps = [steps for _, steps in rows]
    identity = functools.cache(lambda: model_identity(opened))  # hashed once, for the students that record one
    students = [  # before any row is drawn
        open_student(request, path, like=opened, identity=identity) for path in request.students
    ]
    distributed.say(estimate(opened, row_steps, students))
    # The real data it is judged against is an input too.
    check_mode_outputs("evaluate", request.outputs(), inputs={"--data_dir": data_input(dataset, request.data_dir)})
    judge = judge_for(
        dataset,
        data_dir=request.data_dir,
        image_size=s,
        channels=c,
        n=n,
        seed=request.seed,
        device=device,
        inception_weights=request.inception_weights,
    )
    sweep = functools.partial(
        quality.run_sweep,
        judge=judge,
        n_samples=n,
        seed=request.seed,
        image_size=s,
        requested=guidance and guidance.labels,
    )
    draw = functools.partial(draw_row, request=request, opened=opened, selection=selection)
    result = sweep(draw, samplers=samplers, sampling_steps=request.sampling_steps)
    quality.add_calls(result["rows"], doubled=guidance is not None and guidance.doubled)
    for path, student in zip(request.students, students):  # its own sampler and steps; one call a step
        own = student.artifact.schedule_config.student_sampler
        rows = sweep(functools.partial(draw, opened=student), samplers=[own], sampling_steps=[None])["rows"]
        for row in rows:
            row.update(sampler="distilled", model_path=path)  # the file as the user named it: the table's label
        result["rows"] += quality.add_calls(rows, doubled=False)
    result.update(
        model_path=str(source.path),
        implementation=selection.implementation,
        precision=selection.precision,
    )
    if guidance is not None:
        result.update(guidance_scale=guidance.scale, class_names=list(artifact.class_names))
    print()
    print(quality.format_table(result))
    if request.json:
        quality.write_json(result, request.json)
        print(f"wrote {request.json}")
    if request.chart:
        quality.write_plot(result, request.chart)
        print(f"wrote {request.chart}")
