"""What draws a model file: opening it for drawing, the one decision of the implementation, its precision and
whether ``cuda`` runs the fused U-Net runner, and the drawer that runs it. Sample and evaluate mode both draw
through it.

    opened = open_for_drawing(request)   # checked, loaded, guidance resolved, memory checked
    selection = select(DeviceKind.of(device), opened.artifact, request)   # once, after the model file is read
    selection.line   # implementation: cuda in fp32 (fused U-Net runner, Winograd convolutions; the fastest ...)
    draw = opened.drawer(plan, selection)   # draw(shape, generator, progress, labels)

:func:`open_for_drawing` loads any artifact (backends/artifacts.py), resolves a class-conditional model's labels
and guidance and refuses a batch that cannot fit, before any sampling. :func:`select` is the only place that
decides what runs; everything after it (the drawer, the sampler's build) reads the Selection (registry.Selection).
:func:`sampling_line` says which sampler draws in how many steps: without --sampler a student's own, any other
model's SDE-DPM-Solver++ in 20 steps. :func:`check_request` refuses, while the flags resolve and before any file
is read, what no implementation would run (a file kind, a precision), from the same registry entries
:func:`select` checks.

The tables it decides from: :data:`VERIFIED` (``--implementation auto``: on each kind of device, for these
precisions and models, the implementation to run, why, and the BENCHMARKS.md section its measurement is in; the
first entry that matches and whose implementation runs the file wins, else the first sample-mode implementation
that runs it, and the line says so) and optimized_diffusion.RUNNER_VERIFIED (where ``cuda`` includes the fused U-Net
runner, optimized_diffusion.FusedUNet: where it was measured faster than the step kernels alone, which are always
available as ``cuda_steps``). :func:`choose` and :func:`select` are pure functions of their arguments (tests hand
them fake devices); optimized_diffusion.DeviceKind.of is the only part that looks at the machine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ddpm.backends import registry
from ddpm.backends.artifacts import Artifact, load_artifact
from ddpm.backends.registry import Selection
from ddpm.batch_memory import check_batch_fits
from ddpm.conditioning import Guidance, guidance_for, unet_batch
from ddpm.formats.torch_files import KIND_NAMES
from ddpm.latent.autoencoder import clips_x0
from ddpm.requests import DrawRequest, SampleRequest, check_mode_outputs
from ddpm.util.precision import FORCED_BF16
from noise_schedule import NoiseSchedule, SamplingPlan
from optimized_diffusion import DeviceKind, FusedUNet, runner_verified, uses_runner

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Verified:
    """One row of the table: on ``device``, for these precisions, kinds and U-Net dims, use ``implementation``."""

    device: str
    precisions: tuple[str, ...]
    implementation: str
    why: str
    evidence: str  # the BENCHMARKS.md section the choice rests on
    kinds: tuple[str, ...] = ("checkpoint",)
    dims: tuple[int, ...] = (2, 3)
    capabilities: tuple[str, ...] | None = None  # a CPU's vector capabilities it covers (None: any)
    native_bf16: bool = False  # only on a CPU that computes bf16 in hardware
    faster_than_fp32: bool = True  # False: verified to run, but slower than fp32 here (not auto precision's choice)
    forced_why: str = ""  # native_bf16 entries: the why where DDPM_NATIVE_BF16=1 forced bf16 on a CPU emulating it

    def why_on(self, device: DeviceKind) -> str:
        """The reason the line gives on ``device``: a native-bf16 entry forced on a CPU that emulates bf16 does not
        claim the CPU's bf16 hardware."""
        return self.forced_why if self.native_bf16 and device.bf16_forced else self.why

    def matches(self, device: DeviceKind, *, precision: str, kind: str, dims: int) -> bool:
        return (
            device.type == self.device
            and device.extension  # every entry is a custom-kernel path
            and (self.capabilities is None or device.capability in self.capabilities)
            and (device.native_bf16 or not self.native_bf16)
            and precision in self.precisions
            and kind in self.kinds
            and dims in self.dims
        )


VERIFIED: tuple[Verified, ...] = (
    Verified(
        "cpu",
        ("bf16",),
        "cuda",
        "fused U-Net runner in bf16, Winograd convolutions on the CPU's bf16 dot products; the fastest verified on a "
        "CPU with native bf16",
        evidence="BENCHMARKS.md: 'bf16 on a CPU that computes it'",
        dims=(2,),
        native_bf16=True,
        forced_why=f"fused U-Net runner in bf16, Winograd convolutions; {FORCED_BF16}",
    ),
    Verified(
        "cpu",
        ("fp32",),
        "cuda",
        "fused U-Net runner, Winograd convolutions; the fastest verified on an AVX-512 CPU",
        evidence="BENCHMARKS.md: 'The default path on an AVX-512 CPU: the quick plan'",
        dims=(2,),
        capabilities=("AVX512",),
    ),
    Verified(
        "cpu",
        ("fp32",),
        "cuda",
        "fused U-Net runner, Winograd convolutions blocked for AVX2's 16 registers; the fastest verified with AVX2 "
        "kernels",
        evidence="BENCHMARKS.md: 'The default path on an AVX2 CPU, against the runtimes a user would pick'",
        dims=(2,),
        capabilities=("AVX2",),
    ),
    Verified(
        "cuda",
        ("bf16", "fp16"),
        "cuda",
        "fused U-Net runner in a CUDA graph (NHWC, one-pass GroupNorm kernels, weights cast once); the fastest "
        "verified on a GPU, torch.compile's build time counted",
        evidence="BENCHMARKS.md: 'The default path on a GPU, against torch.compile'",
        dims=(2,),
    ),
    Verified(
        "cuda",
        ("fp32", "bf16", "fp16"),
        "cuda",
        "fused step kernels in a CUDA graph around the eager U-Net; the fused U-Net runner is verified on a GPU for "
        "2-D U-Nets in bf16 and fp16 only",
        evidence="BENCHMARKS.md: 'The default path on a GPU, against torch.compile'",
        kinds=("checkpoint", "torchscript"),
    ),
    Verified(
        "cpu",
        ("bf16", "fp16"),
        "cuda",
        "fused step kernels under autocast; the original runs fp32 only",
        evidence="BENCHMARKS.md: 'Lower precision against fp32 on a CPU'",
        kinds=("checkpoint", "torchscript"),
        faster_than_fp32=False,
    ),
)


def choose(
    device: DeviceKind,
    *,
    precision: str,
    kind: str = "checkpoint",
    dims: int = 2,
    conditional: bool = False,
    latent: bool = False,
    fp32_unless_faster: bool = False,
) -> Selection:
    """What ``--implementation auto`` runs in ``precision``: the first entry of :data:`VERIFIED` that matches and
    can run the request, else the first sample-mode implementation that can (saying that nothing faster is
    verified). With ``fp32_unless_faster`` (--precision auto), what it runs in fp32 where that choice is not
    faster than fp32. Raises the last refusal (a one-line ValueError) when no implementation runs the request. Its
    ``fused`` is the runner's verification for a checkpoint's U-Net (:func:`select` asks of the model itself)."""
    facts = dict(kind=kind, dims=dims, conditional=conditional, latent=latent)
    choice = _first_that_runs(device, precision=precision, **facts)
    if fp32_unless_faster and not choice.faster_than_fp32:
        choice = _first_that_runs(device, precision="fp32", **facts)
    return choice


def _first_that_runs(
    device: DeviceKind, *, precision: str, kind: str, dims: int, conditional: bool, latent: bool
) -> Selection:
    def runs(name: str) -> bool:
        if name.startswith("cuda") and not device.extension:
            return False
        try:
            registry.get(name).check(kind=kind, precision=precision, conditional=conditional, latent=latent)
        except ValueError:
            return False
        return device.type in registry.get(name).devices

    for entry in VERIFIED:
        if entry.matches(device, precision=precision, kind=kind, dims=dims) and runs(entry.implementation):
            fused = entry.implementation == "cuda" and kind == "checkpoint"
            fused = fused and runner_verified(
                device_type=device.type, precision=precision, dims=dims, native_bf16=device.native_bf16
            )
            why, faster = entry.why_on(device), entry.faster_than_fp32
            return Selection(entry.implementation, precision, why, fused, auto=True, faster_than_fp32=faster)
    for name in registry.SAMPLE_IMPLEMENTATIONS:
        if runs(name):
            reason = (
                "the diffusion_kernels extension is not built"
                if not device.extension
                else f"nothing faster is verified for {precision} {dims}-D {kind} files on a {device.type.upper()}"
            )
            return Selection(name, precision, reason, auto=True, faster_than_fp32=precision == "fp32")
    registry.get("original").check(kind=kind, precision=precision, conditional=conditional, latent=latent)
    raise ValueError(f"no implementation here runs --precision {precision} for this file")


def check_request(*, implementation: str, precision: str, precision_auto: bool, kind: str, compile: bool) -> None:
    """Refuse, while the flags resolve and before any file is read, what the named implementation (or, for
    ``auto``, every sample-mode implementation) cannot run: the file's ``kind``, a ``precision`` asked for (with
    ``precision_auto`` every implementation draws in one it runs), ``compile`` for another than cuda."""
    if compile and implementation != "cuda":
        raise ValueError("--compile applies to training and to sampling with --implementation cuda")
    if compile and kind != "checkpoint":
        raise ValueError(
            f"--compile compiles a checkpoint's U-Net, not a {KIND_NAMES[kind]} file's; drop --compile, or sample "
            "from the checkpoint"
        )
    asked = None if precision_auto else precision
    if implementation != "auto":
        registry.get(implementation).check(kind=kind, precision=asked)
    elif asked is not None and not any(
        registry.get(name).runs(kind, asked) for name in registry.SAMPLE_IMPLEMENTATIONS
    ):
        raise ValueError(
            f"no implementation here runs {KIND_NAMES[kind]} files in --precision {asked}; "
            "drop --precision, or sample from the checkpoint"
        )


def select(device: DeviceKind, artifact, request) -> Selection:
    """What draws ``artifact`` (backends/artifacts.Artifact: its kind, U-Net and autoencoder) for ``request`` (a
    DrawRequest: the implementation named or ``auto``, the precision asked for, ``precision_auto``, ``compile``)
    on ``device``. With --precision auto, ``request.precision`` is the device's fastest (util/precision.resolve):
    kept where the implementation draws this file in it faster than in fp32, else fp32. A named implementation
    that cannot run the model (class-conditional, latent) is refused in one line."""
    config = artifact.model_config
    facts = dict(kind=artifact.kind, conditional=bool(config.num_classes), latent=artifact.first_stage is not None)
    precision, named = request.precision, request.implementation
    if request.precision_auto and precision != "fp32":  # lower only where that path is faster than fp32
        if named == "auto":
            precision = precision if artifact.kind == "checkpoint" else "fp32"
        elif device.type == "cpu" or not registry.get(named).runs(artifact.kind, precision):
            precision = "fp32"  # on a CPU only auto's choice (the runner) is faster in bf16
    if named != "auto":
        registry.get(named).check(precision=precision, **facts)
        fused = (
            named == "cuda"
            and not request.compile
            and uses_runner(
                artifact.model, device_type=device.type, precision=precision, native_bf16=device.native_bf16
            )
        )
        return Selection(named, precision, f"--implementation {named}", fused, request.compile)
    choice = choose(device, precision=precision, dims=config.dims, fp32_unless_faster=request.precision_auto, **facts)
    fused = choice.implementation == "cuda" and uses_runner(
        artifact.model, device_type=device.type, precision=choice.precision, native_bf16=device.native_bf16
    )
    return replace(choice, fused=fused)


def teacher_forward(model: nn.Module, *, device: torch.device) -> nn.Module:
    """The teacher's forward through the fused U-Net runner where the cuda implementation uses it (the same
    outputs to float rounding; uses_runner says where), else the model itself."""
    if not uses_runner(model, device_type=device.type, precision="fp32") or not DeviceKind.of(device).extension:
        return model
    return FusedUNet(model).eval()


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

    def drawer(self, plan: SamplingPlan, selection: Selection):
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
