"""What sample and evaluate mode share: open a model file for drawing, and make a drawer for a plan.

    opened = open_for_drawing(request)                        # checked, loaded, guidance resolved, memory checked
    selection = select(DeviceKind.of(device), opened.artifact, request)   # the mode: what draws it, once
    draw = opened.drawer(request.sampling.plan(...), selection)   # draw(shape, generator, progress, labels)

Both modes load any artifact (backends/artifacts.py), resolve a class-conditional model's labels and guidance,
refuse a batch that cannot fit before any sampling, then select once what draws it (backends/selection.select: the
implementation, its precision, the fused U-Net runner; auto's choice said in one line), and say in one line which
sampler draws in how many steps (sampling_line:
without --sampler, a student's own, any other model's SDE-DPM-Solver++ in 20 steps); they differ only in what they
do with the images (write a grid, or judge them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ddpm.backends import registry
from ddpm.backends.artifacts import Artifact, load_artifact
from ddpm.batch_memory import check_batch_fits
from ddpm.conditioning import Guidance, guidance_for, unet_batch
from ddpm.latent.first_stage import clips_x0
from ddpm.outputs import check_mode_outputs
from ddpm.requests import DrawRequest, SampleRequest
from noise_schedule import NoiseSchedule, SamplingPlan


@dataclass(frozen=True)
class Opened:
    """A model file ready to draw from, with what the request resolved against it."""

    request: DrawRequest
    artifact: Artifact
    guidance: Guidance | None  # a class-conditional model: one label per image, and the scale
    grid_columns: int | None  # a conditional model's grid: one row per class
    batch_size: int  # --batch_size, at most --n_samples

    @property
    def batch_sizes(self) -> list[int]:
        """--n_samples in batches of ``batch_size``, in order (the last one may be smaller)."""
        n = self.request.n_samples
        return [min(self.batch_size, n - start) for start in range(0, n, self.batch_size)]

    def schedule(self) -> NoiseSchedule:
        return NoiseSchedule(self.artifact.schedule_config).to(self.request.device)

    def clips_x0(self, requested: bool) -> bool:
        """Whether x0 is clipped: as requested for pixel models, never for latent models."""
        return clips_x0(requested, self.artifact.first_stage)

    def drawer(self, plan: SamplingPlan, selection: registry.Selection):
        """``draw(shape, generator, progress, labels) -> images`` for ``plan``, by what ``selection`` says draws."""
        engine = None
        if selection.implementation == "tensorrt":  # the engine options name a cache folder beside the file
            from tensorrt_integration import TensorRTOptions

            engine = TensorRTOptions.for_source(self.artifact.path, **asdict(self.request.engine))
        options = selection.options(opset=self.request.opset, tensorrt=engine, guidance=self.guidance)
        return registry.make_drawer(
            selection.implementation, self.artifact.model, plan, options=options, first_stage=self.artifact.first_stage
        )


def check_recorded_dataset(dataset: str | None, artifact: Artifact) -> None:
    """--dataset as given (None: left out) against the training data ``artifact`` records (checkpoints and exports
    do): a contradiction is refused, in sample as in evaluate, rather than read as the default --model_path's name."""
    if dataset and artifact.dataset and dataset != artifact.dataset:
        raise ValueError(
            f"--dataset {dataset} contradicts {artifact.path}, which was trained on {artifact.dataset}; drop --dataset"
        )


def folded_scale(artifact: Artifact, scale: float | None) -> float | None:
    """A student with classifier-free guidance folded in runs its conditional U-Net once per step (scale 1);
    another scale on top of it is refused rather than applied twice."""
    folded = artifact.schedule_config.folded_guidance
    if not folded:
        return scale
    if scale is not None:
        raise ValueError(
            f"{artifact.path} is a student with guidance {folded:g} folded in (one U-Net call per step); "
            "drop --guidance_scale"
        )
    return 1.0


def open_for_drawing(request: DrawRequest) -> Opened:
    """Load the file, resolve labels and guidance, and check that one batch fits."""
    source = request.source  # no implementation that would refuse its kind or the precision (cli/resolve.py)
    artifact = load_artifact(
        source.path,
        device=request.device,
        weights=source.weights,
        trust_torchscript=source.trust_torchscript,
        autoencoder=source.autoencoder,
        max_batch=2 * min(request.batch_size, request.n_samples),  # guided: twice the images
    )
    check_recorded_dataset(request.dataset, artifact)
    # The files the model named (a latent model's autoencoder, an exported decoder) are inputs too.
    mode = "sample" if isinstance(request, SampleRequest) else "evaluate"
    check_mode_outputs(mode, request.outputs(), inputs={**request.source.inputs(), **artifact.inputs})
    guidance, columns = guidance_for(
        artifact.model_config,
        artifact.class_names,
        class_label=request.class_label,
        scale=folded_scale(artifact, request.guidance_scale),
        n_samples=request.n_samples,
        source=artifact.path,
    )
    batch_size = min(request.batch_size, request.n_samples)
    check_batch_fits(
        artifact.model_config, batch_size=unet_batch(batch_size, guidance), device=request.device, training=False
    )
    return Opened(request, artifact, guidance, columns, batch_size)


def sampling_line(opened: Opened, rows: list[tuple[str, int]], *, named_sampler: bool, named_steps: bool) -> str:
    """What the run draws with, in one line before it draws: each (sampler, steps) of ``rows``, and why where
    --sampler was left out (``named_sampler``, ``named_steps``: whether the flags were given), e.g.
    ``sampling: dpm_solver_sde, 20 steps (default; --sampler ddpm for the 1,000-step DDPM)``."""
    steps: dict[str, list[int]] = {}
    for sampler, count in rows:
        steps.setdefault(sampler, []).append(count)
    said = "; ".join(f"{sampler}, {', '.join(f'{n:,}' for n in counts)} steps" for sampler, counts in steps.items())
    config = opened.artifact.schedule_config
    if named_sampler:
        return f"sampling: {said}"
    if config.is_student:
        return f"sampling: {said} (the student's own)"
    if named_steps:
        return f"sampling: {said} (the default sampler; --sampler ddpm for DDPM)"
    return f"sampling: {said} (default; --sampler ddpm for the {config.num_timesteps:,}-step DDPM)"
