"""What each mode receives: typed requests, resolved from the flags once by cli/resolve.py, the files each reads, and
every file each mode writes (OUTPUTS, one table) with the check that holds an output to its kind.

    request = SampleRequest(device=torch.device("cpu"), precision="fp32", source=ModelSource("m.pt"), ...)
    run_sample(request)                                        # ddpm/modes/sample.py

Every value here is already resolved and checked (the device, the precision, default paths, the
registry name of the implementation, the sampler's parameters, outputs that destroy nothing), so a
mode reads fields, never the parsed flags. The sampler's ranges are checked here, once, for every
mode that samples (sample, evaluate, benchmark, an INT8 export's calibration). Small helpers turn a
request's parts into what the libraries take (a UNetConfig, a SamplingPlan, TensorRTOptions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ddpm.choices import DEFAULT_SAMPLER
from ddpm.util.safe_files import Input, InputFolder, PathLike, as_input, check_outputs, resolved

if TYPE_CHECKING:
    import torch

    from basic_diffusion import UNetConfig
    from noise_schedule import NoiseSchedule, SamplingPlan, ScheduleConfig


@dataclass(frozen=True)
class ModelSource:
    """A file to sample, export or measure: a checkpoint, or an exported U-Net (.ts, .onnx, .engine/.plan)."""

    path: str
    weights: str = "ema"  # "ema" or "model" (--no_ema): which weights of a checkpoint
    trust_torchscript: bool = False  # a .ts file is a program: loaded only with consent
    autoencoder: str | None = None  # a latent model's autoencoder where it is now (None: the path it stored)

    def inputs(self) -> dict[str, object]:
        """The files the flags name for reading (those the file names are Artifact.inputs); a diffusers
        model folder as an InputFolder: every file in it."""
        return {"--model_path": as_input(self.path), "--autoencoder": self.autoencoder}


@dataclass(frozen=True)
class NewModel:
    """A U-Net and noise schedule made from the flags (training; benchmark without --model_path)."""

    dataset: str
    data_dir: str
    image_size: int  # 0 (latent models): the autoencoder's
    channels: int  # 0 (latent models): the autoencoder's
    preset: str = "small"
    model_channels: int | None = None
    num_res_blocks: int | None = None
    dropout: float | None = None
    time_conditioning: str | None = None
    patch_size: int | None = None
    beta_schedule: str = "linear"
    timesteps: int = 1000

    def model_config(self) -> UNetConfig:
        """The preset with the flags' overrides (validated)."""
        from basic_diffusion import unet_preset
        from ddpm.data.catalog import VOLUME_DATASETS

        return unet_preset(
            self.preset,
            image_size=self.image_size,
            in_channels=self.channels,
            dims=3 if self.dataset in VOLUME_DATASETS else 2,
            model_channels=self.model_channels,
            num_res_blocks=self.num_res_blocks,
            dropout=self.dropout,
            time_conditioning=self.time_conditioning,
            patch_size=self.patch_size,
        )

    @property
    def pixels(self) -> int:
        """A training image's pixels as the flags give them; 0 for a latent or 3-D model (--precision auto)."""
        from ddpm.data.catalog import VOLUME_DATASETS

        return 0 if self.dataset in VOLUME_DATASETS else self.image_size**2

    def schedule_config(self) -> ScheduleConfig:
        from noise_schedule import ScheduleConfig

        return ScheduleConfig(kind=self.beta_schedule, num_timesteps=self.timesteps)


def check_sampling(sampler: str | None, *, eta: float) -> None:
    """The range of --eta, and eta's sampler: one line naming the flag. (--sampling_steps is checked once, where
    it meets the model's schedule: noise_schedule.check_sampling_steps, from make_plan.)"""
    if not 0.0 <= eta <= 1.0:  # beyond 1 the images saturate; also False for NaN
        raise ValueError(f"--eta must be between 0 (deterministic DDIM) and 1 (DDPM's posterior variance), got {eta:g}")
    if eta != 0.0 and sampler != "ddim":
        named = f"--sampler {sampler}" if sampler else "the default sampler (name --sampler ddim)"
        raise ValueError(f"--eta only applies to the ddim sampler, got --eta {eta:g} with {named}")


@dataclass(frozen=True)
class SamplingChoice:
    """Which sampler (None: the model's own, else ``default``: :func:`own_sampling`), how many steps
    (--sampling_steps; None: the sampler's default), DDIM's eta, and whether x0 is clipped. ``default`` is the
    tool's few-step sampler (sample, evaluate); benchmark times DDPM."""

    sampler: str | None = None
    sampling_steps: int | None = None
    eta: float = 0.0
    clip_denoised: bool = True
    default: str = DEFAULT_SAMPLER  # the sampler of a model with none of its own, where ``sampler`` is None

    def __post_init__(self) -> None:
        check_sampling(self.sampler, eta=self.eta)

    def plan(self, schedule: NoiseSchedule, *, device: torch.device) -> SamplingPlan:
        sampler, timesteps = own_sampling(
            schedule.config, sampler=self.sampler, sampling_steps=self.sampling_steps, default=self.default
        )
        return schedule.make_plan(
            sampler,
            sampling_steps=self.sampling_steps,
            timesteps=timesteps,
            eta=self.eta,
            clip_denoised=self.clip_denoised,
            device=device,
        )


def own_sampling(
    config: ScheduleConfig, *, sampler: str | None, sampling_steps: int | None, default: str = DEFAULT_SAMPLER
) -> tuple[str, tuple | None]:
    """(sampler, timesteps or None) for a request of ``sampler`` (None: the model's own) in ``sampling_steps``
    (None: its default). A distilled student's own is the sampler and timesteps it was trained for; asked for another
    sampler or step count, it draws as asked, and one warning line says what it was trained for. Any other model has
    none of its own and draws with ``default``: sample and evaluate's few-step sampler (choices.DEFAULT_SAMPLER, at
    its default 20 steps), or DDPM where the caller keeps it (benchmark, training's previews)."""
    if not config.is_student:
        return sampler or default, None
    own, timesteps = config.student_sampler, config.student_timesteps
    if (sampler or own) == own and sampling_steps in (None, len(timesteps)):
        return own, timesteps
    import warnings

    warnings.warn(
        f"this student was trained for the {own} sampler in {len(timesteps)} steps (t = "
        f"{', '.join(map(str, timesteps))}); drawing with {sampler or own} in {sampling_steps or 'its default'} steps "
        "as asked",
        stacklevel=2,
    )
    return sampler or own, None


@dataclass(frozen=True)
class EngineFlags:
    """The TensorRT flags (tensorrt_integration.TensorRTOptions.from_flags turns them into engine options)."""

    backend: str = "native"
    max_batch: int | None = None  # None: TensorRTOptions' default (unet_io.DEFAULT_MAX_BATCH)
    optimization_level: int | None = None  # None: TensorRTOptions' default
    opset: int | None = None  # None: chosen from the TensorRT version


@dataclass(frozen=True)
class TrainRequest:
    device: torch.device
    precision: str  # resolved: bf16 on a GPU that has it, fp32 otherwise, unless asked
    checkpoint: str
    resume: bool
    overwrite: bool
    model: NewModel
    autoencoder: str | None = (
        None  # a latent model: the autoencoder whose latents the U-Net learns (latent/autoencoder.py)
    )
    init_from: str | None = (
        None  # fine-tuning: a new run starting from these weights (checkpoint, safetensors, diffusers folder)
    )
    seed: int = 0
    # with max_steps None: the run's length is n_epochs (default choices.TRAIN_EPOCHS) epochs
    n_epochs: int | None = None
    max_steps: int | None = None  # alone: the run's length; with n_epochs: its cap
    batch_size: int = 64
    lr: float = 2e-4
    warmup_steps: int | None = None  # None: 5% of the run, at most 500
    ema_decay: float = 0.999
    min_snr_gamma: float | None = None
    timestep_sampling: str | None = None  # None: uniform for a new run, the checkpoint's own on --resume
    digits_recipe: bool = False  # the flags left the model and recipe to choices.DIGITS_RECIPE (said at the start)
    # The digits recipe's latent model of 28x28 digits: the autoencoder this run trains first (``autoencoder`` names
    # its checkpoint); None: the run trains no first stage.
    first_stage: AutoencoderTrainRequest | None = None
    class_cond: bool = False  # a class-conditional model on the dataset's labels
    cond_drop: float = 0.1  # with class_cond: share of labels trained as the null label
    grad_checkpoint: bool = False  # activation checkpointing in the residual blocks
    grad_clip: float = 1.0
    compile: bool = False
    save_every: int = 1000
    sample_every: int = 1000
    profile: str | None = None  # --profile DIR
    log_dir: str | None = None  # the training curves' folder (metrics.csv, TensorBoard events); None: none written
    log_every: int = 10  # a row of the curves every N steps
    given: frozenset[str] = (
        frozenset()
    )  # the flags written on the command line: --resume checks them against the checkpoint


@dataclass(frozen=True, kw_only=True)
class DrawRequest:
    """What sample and evaluate mode share: a file, the implementation that runs it, and the batches."""

    device: torch.device
    precision: str
    source: ModelSource
    implementation: str  # "auto" or a registry name (what draws is selected once the file is read: backends/selection)
    precision_auto: bool = False  # --precision auto: ``precision`` is the device's fastest, kept where it is faster
    compile: bool = False  # --compile: cuda's U-Net through torch.compile inside the graph
    n_samples: int = 16
    batch_size: int = 64
    seed: int = 0
    opset: int | None = None  # the ONNX opset of an in-memory export
    engine: EngineFlags = EngineFlags()
    class_label: str | None = None  # --class_label as given: resolved against the model's class names
    guidance_scale: float | None = None  # None: conditioning.DEFAULT_GUIDANCE for a conditional model
    dataset: str | None = None  # --dataset as given: the model's training data (a file that records another: refused)

    def outputs(self) -> dict[str, str | None]:
        """The files the run writes, by flag (checked again against the inputs the model file names)."""
        return {}


@dataclass(frozen=True, kw_only=True)
class SampleRequest(DrawRequest):
    sampling: SamplingChoice
    grid: str | None  # the PNG grid, or None with --no_grid
    npz: str | None
    grid_scale: int | None = None
    profile: str | None = None  # --profile DIR

    def outputs(self) -> dict[str, str | None]:
        return {"--output": self.grid, "--save_npz": self.npz}


@dataclass(frozen=True, kw_only=True)
class EvaluateRequest(DrawRequest):
    samplers: list  # evaluate sweeps samplers x sampling_steps (None: the model's own, a student's)
    sampling_steps: list
    students: tuple[str, ...] = ()  # distilled students, each a row of its own sampler and steps
    data_dir: str = "./data"  # ... and where it lies (FID/KID read the real images)
    data_dir_given: bool = False  # --data_dir written: refused for a model whose data no folder holds
    inception_weights: str | None = None  # FID/KID: a local copy of torch-fidelity's Inception weights
    eta: float = 0.0
    clip_denoised: bool = True
    json: str | None = None
    chart: str | None = None

    def __post_init__(self) -> None:  # every row by sample's rules
        for sampler in self.samplers:
            check_sampling(sampler, eta=self.eta)

    def outputs(self) -> dict[str, str | None]:
        return {"--json": self.json, "--chart": self.chart}


@dataclass(frozen=True)
class ExportRequest:
    device: torch.device
    precision: str
    source: ModelSource
    fmt: str
    output: str
    opset: int | None = None
    engine: EngineFlags = EngineFlags()
    calibration: Calibration | None = None  # --precision int8: the trajectories the ranges are measured on
    overwrite: bool = False  # --format diffusers: replace an --output folder that already holds a model


@dataclass(frozen=True)
class Calibration:
    """An INT8 export's calibration (formats/quantization.py): ``samples`` trajectories of ``sampler``."""

    sampler: str
    sampling_steps: int | None  # None: the sampler's default
    samples: int
    seed: int = 0
    batch_size: int = 64  # trajectories run (and their ranges collected) this many at a time


@dataclass(frozen=True)
class BenchmarkRequest:
    """How benchmark mode times its rows (resolved from the flags by cli/resolve.py; BenchmarkRun holds it with the
    model and the sampler)."""

    rows: str = "all"  # comma-separated row names, or "all"
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    train_steps: int = 20  # --bench training: timed optimizer steps per variant
    batch_size: int = 64  # --bench training: the batch of each step
    json: str | None = None
    csv: str | None = None
    chart: str | None = None
    profile: str | None = None  # --profile DIR: one more run of each row, traced, after its timing
    interleave: bool = False  # --interleave: every row built first, then timed in rounds (sampling_bench.time_rows)
    given: frozenset[str] | None = None  # the flags written on the command line (plan.py); None: all count as given

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {self.repeats} and {self.warmup}")
        if self.train_steps < 1:
            raise ValueError(f"--train_steps must be >= 1, got {self.train_steps}")


@dataclass(frozen=True)
class BenchmarkRun:
    device: torch.device
    precision: str
    bench: str  # "sampling" or "training"
    request: BenchmarkRequest
    source: ModelSource | None  # a checkpoint, or None: a fresh U-Net of ``model``
    model: NewModel
    sampling: SamplingChoice
    n_samples: int = 16  # the seed and the training batch are the timing request's (request.seed, request.batch_size)
    guidance_scale: float | None = None  # a class-conditional checkpoint is timed guided (default: conditioning's)


@dataclass(frozen=True, kw_only=True)
class AutoencoderTrainRequest:
    """--mode train_autoencoder: the first stage of a latent model (training/autoencoder_trainer.py trains it)."""

    device: torch.device
    checkpoint: str
    reconstructions: str  # the PNG beside the checkpoint
    overwrite: bool
    dataset: str
    data_dir: str
    image_size: int
    channels: int
    seed: int = 0
    n_epochs: int | None = None
    max_steps: int | None = None  # neither: choices.AUTOENCODER_DEFAULTS["max_steps"]
    batch_size: int  # the defaults: the flag table's (ddpm/choices.py: AUTOENCODER_DEFAULTS)
    lr: float
    # None: AutoencoderConfig's default
    latent_channels: int | None = None
    downsample: int | None = None
    base_channels: int | None = None
    kl_weight: float | None = None


@dataclass(frozen=True, kw_only=True)
class DistillRequest:
    """--mode distill. The recipe's defaults are the flag table's (ddpm/choices.py: DISTILL_DEFAULTS), so
    every field of it is given here."""

    device: torch.device
    precision: str
    teacher: ModelSource
    checkpoint: str  # the student's checkpoint (--output)
    resume: bool = False
    overwrite: bool = False
    sampling_steps: int
    guidance_scale: float | None = None  # None: a conditional teacher's default guidance
    samples: int  # --distill_samples: teacher trajectories
    teacher_steps: int
    method: str  # --distill_method (training/distill_losses.py)
    adv_weight: float
    dmd_weight: float
    adv_real: str | None = None  # None: cli/recipes.adv_real's default for the teacher, once it is read
    data_dir: str = "./data"  # --adv_real data: where the teacher's training data lies (a torchvision set, a folder)
    seed: int = 0
    max_steps: int
    batch_size: int
    lr: float
    warmup_steps: int | None = None  # None: 5% of the run, at most 500
    ema_decay: float
    grad_clip: float = 1.0
    compile: bool = False
    save_every: int
    profile: str | None = None
    log_dir: str | None = None
    log_every: int = 10
    given: frozenset[str] = frozenset()
    # The method flags given, each with the --distill_method values that read it (the flag table's): a resumed run's
    # method is its checkpoint's, so they are checked once it is read.
    method_flags: dict[str, tuple[str, ...]] | None = None


def default_student_path(teacher: str, steps: int) -> str:
    """Beside the teacher: ``checkpoints/digits.pt`` -> ``checkpoints/digits_student4.pt`` (a folder's name
    for a diffusers teacher)."""
    path = Path(teacher)
    stem = path.name if path.is_dir() else path.stem
    return str(path.with_name(f"{stem}_student{steps}.pt"))


# ----- every file each mode writes -----------------------------------------------------------------
# One table, read by every check of a mode's outputs (cli/resolve.py before any work, the modes again once the model
# file has named its own inputs). Folders (--log_dir, --profile, a diffusers export) are checked as folders where they
# are written; the previews' folder, derived from the checkpoint's name, with the checkpoint.
PREVIEW = "the training preview"  # <checkpoint stem>_samples/step_NNNNNNN.png
CURVES = "--log_dir's metrics.csv"
RECONSTRUCTIONS = "the reconstructions PNG"
FIRST_STAGE = "--model_path's autoencoder"  # the digits recipe's latent model: <stem>_autoencoder.pt, trained first
EXPORT_METADATA = "--output's metadata"  # beside a TensorRT engine
EXPORT_DECODER = "--output's decoder"  # beside a latent model's export

# mode -> output -> kind. Export's --output and its decoder are of the kind --format writes (EXPORT_KINDS).
OUTPUTS: dict[str, dict[str, str]] = {
    "train": {
        "--model_path": "checkpoint",
        PREVIEW: "png",
        CURVES: "csv",
        FIRST_STAGE: "checkpoint",
        RECONSTRUCTIONS: "png",
    },
    "distill": {"--output": "checkpoint", PREVIEW: "png", CURVES: "csv"},
    "train_autoencoder": {"--model_path": "checkpoint", RECONSTRUCTIONS: "png"},
    "sample": {"--output": "png", "--save_npz": "npz"},
    "evaluate": {"--json": "json", "--chart": "png"},
    "benchmark": {"--json": "json", "--csv": "csv", "--chart": "png"},
    "export": {"--output": "by --format", EXPORT_METADATA: "json", EXPORT_DECODER: "by --format"},
}
# --format -> the kind of file it writes (diffusers: a folder, checked file by file as it is written).
EXPORT_KINDS = {"onnx": "onnx", "torchscript": "torchscript", "tensorrt": "tensorrt", "safetensors": "safetensors"}
# A latent model's decoder beside its export: of the same kind (ONNX beside ONNX, an engine beside an engine).
DECODER_KINDS = {"onnx": "onnx", "torchscript": "torchscript", "tensorrt": "tensorrt"}


def kinds_of(mode: str, *, fmt: str | None = None) -> dict[str, str]:
    """``mode``'s outputs and their kinds (export's for ``fmt``)."""
    table = dict(OUTPUTS[mode])
    if mode == "export":
        table = {
            "--output": EXPORT_KINDS.get(fmt),
            EXPORT_METADATA: "json",
            EXPORT_DECODER: DECODER_KINDS.get(fmt),
        }
    return {flag: kind for flag, kind in table.items() if kind is not None}


def check_mode_outputs(
    mode: str,
    outputs: Mapping[str, PathLike | None],
    *,
    inputs: Mapping[str, Input | None] | None = None,
    fmt: str | None = None,
):
    """util/safe_files.check_outputs of ``outputs``, each held to its kind in ``mode``'s table; a training run's
    checkpoint with the previews' folder derived from it (:func:`check_previews_folder`)."""
    unknown = set(outputs) - set(OUTPUTS[mode])
    if unknown:  # a programming error: every output of a mode is in its table
        raise KeyError(f"{sorted(unknown)} not in the outputs of --mode {mode} (ddpm/requests.py: OUTPUTS)")
    checked = check_outputs(outputs, inputs=inputs, kinds=kinds_of(mode, fmt=fmt))
    if PREVIEW in OUTPUTS[mode]:
        for flag, path in outputs.items():
            if path is not None and OUTPUTS[mode][flag] == "checkpoint" and flag != FIRST_STAGE:  # it has none
                check_previews_folder(path, flag=flag, inputs=inputs or {})
    return checked


def reconstructions_path(checkpoint: str | Path) -> str:
    """The PNG beside a checkpoint: ``<stem>_reconstructions.png``."""
    path = Path(checkpoint)
    return str(path.with_name(f"{path.stem}_reconstructions.png"))


def previews_folder(checkpoint: PathLike) -> Path:
    """Where a training run's preview grids go: ``checkpoints/mnist.pt`` -> ``checkpoints/mnist_samples``."""
    path = Path(checkpoint)
    return path.with_name(f"{path.stem}_samples")


def check_previews_folder(checkpoint: PathLike, *, flag: str, inputs: Mapping[str, Input | None]) -> Path:
    """The previews' folder of a run writing ``checkpoint`` (named by ``flag``), a derived output checked with the
    named ones, before any data or model is read: refused in one line when it is a file, an input, or inside a
    folder an input names (a --data_dir, a diffusers model: a preview would join the data, or the model's files).
    Its existing preview files are checked again once the run's length is known (modes/train.check_previews)."""
    folder = previews_folder(checkpoint)
    where = f"the training previews of {flag} {checkpoint} go into {folder}"
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{where}, which is a file; move it, or choose another {flag}")
    target = resolved(folder)
    for in_flag, item in inputs.items():
        if item is None:
            continue
        root = resolved(item.root if isinstance(item, InputFolder) else item)
        if target == root or (isinstance(item, InputFolder) and target.is_relative_to(root)):
            raise ValueError(
                f"{where}, inside the folder {in_flag} reads; an input is never written: choose another {flag}"
            )
    return folder
