"""Exported U-Nets: the one I/O spec, ONNX and TorchScript export, and loading any artifact to sample.

    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt          # -> checkpoints/mnist.onnx
    python main.py --mode export --format torchscript --model_path checkpoints/mnist.pt   # -> checkpoints/mnist.ts
    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime

The U-Net's interface is defined once, in :class:`UNetIO`: inputs ``x_t`` (B, C, H, W) float32 and
``t`` (B,) int64, output ``eps`` (B, C, H, W) float32, the batch B being the one dynamic axis; a
:class:`BatchRange` gives the (min, opt, max) batch sizes of a TensorRT optimization profile. The
ONNX export here and the engine build in tensorrt_integration.py both read it.

Every artifact carries what sampling needs besides the weights (:func:`artifact_metadata`: model and
schedule configs, which weights, the I/O spec): ONNX files in ``metadata_props``, TorchScript files
in an extra file, TensorRT engines in a JSON sidecar. So ``--mode sample --model_path FILE`` takes
a checkpoint (.pt), TorchScript (.ts), ONNX (.onnx, run by onnxruntime) or an engine (.engine/.plan)
and needs nothing else. Only load TorchScript files you trust: they hold code as well as weights.

onnx, onnxscript (the exporter's backend) and onnxruntime are optional; they are imported when used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from basic_diffusion import UNet, UNetConfig
from checkpoints import atomic_write, check_output_file, first_line, load_checkpoint
from noise_schedule import ScheduleConfig

FORMATS = ("onnx", "torchscript", "tensorrt")
FORMAT_SUFFIXES = {"onnx": (".onnx",), "torchscript": (".ts",), "tensorrt": (".engine", ".plan")}
ARTIFACT_KINDS = {
    ".pt": "checkpoint",
    ".ts": "torchscript",
    ".onnx": "onnx",
    ".engine": "tensorrt",
    ".plan": "tensorrt",
}
# Which --implementation can run which artifact: cuda needs a PyTorch module; onnxruntime and tensorrt
# need an ONNX graph (exported on the fly from a checkpoint); an engine runs only in TensorRT; the
# original loop takes any of them (it only calls eps = model(x_t, t)).
IMPLEMENTATIONS_FOR = {
    "checkpoint": ("original", "cuda", "onnxruntime", "tensorrt"),
    "torchscript": ("original", "cuda"),
    "onnx": ("original", "onnxruntime", "tensorrt"),
    "tensorrt": ("original", "tensorrt"),
}
WEIGHTS = ("ema", "model")  # the checkpoint entry an artifact was exported from
KIND_NAMES = {"checkpoint": "checkpoint", "torchscript": "TorchScript", "onnx": "ONNX", "tensorrt": "TensorRT engine"}

# Opset 21 is the first whose GroupNormalization takes per-channel scale and bias, and the one at
# which the exporter emits GroupNormalization natively; opsets 18-20 get an InstanceNormalization
# decomposition instead (use --opset 18 for a TensorRT parser without GroupNormalization-21).
DEFAULT_OPSET = 21
MIN_OPSET = 18
ARTIFACT_FORMAT = "ddpm-unet/1"
METADATA_KEY = "ddpm"  # ONNX metadata_props key; TorchScript extra file "ddpm.json"
ONNX_INSTALL = "pip install onnx onnxscript onnxruntime"
ORT_INSTALL = "pip install onnxruntime (or onnxruntime-gpu for the CUDA and TensorRT execution providers)"

# --------------------------------------------------------------------------------------------
# The I/O spec
# --------------------------------------------------------------------------------------------

BATCH = "batch"  # the name of the dynamic axis
DEFAULT_OPT_BATCH = 16  # the batch an engine is tuned for (the CLI's default --n_samples)
DEFAULT_MAX_BATCH = 64


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, dtype and shape, with :data:`BATCH` marking the dynamic axis."""

    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...]

    def concrete(self, batch_size: int) -> tuple[int, ...]:
        return tuple(batch_size if d == BATCH else int(d) for d in self.shape)

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.shape)}


@dataclass(frozen=True)
class BatchRange:
    """Batch sizes an engine accepts: the (min, opt, max) of its optimization profile; opt is tuned for."""

    min: int = 1
    opt: int = DEFAULT_OPT_BATCH
    max: int = DEFAULT_MAX_BATCH

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"batch sizes need 1 <= min <= opt <= max, got ({self.min}, {self.opt}, {self.max})")

    @classmethod
    def covering(cls, batch_size: int, *, max_batch: int) -> BatchRange:
        """The profile 1 .. max_batch, widened to ``batch_size`` if that is larger."""
        if batch_size < 1 or max_batch < 1:
            raise ValueError(f"batch sizes must be positive, got {batch_size} and --max_batch {max_batch}")
        top = max(max_batch, batch_size)
        return cls(min=1, opt=min(DEFAULT_OPT_BATCH, top), max=top)

    def __contains__(self, batch_size: int) -> bool:
        return self.min <= batch_size <= self.max

    def to_list(self) -> list[int]:
        return [self.min, self.opt, self.max]


@dataclass(frozen=True)
class UNetIO:
    """The U-Net's inputs and outputs: the one definition read by the ONNX export and the engine build."""

    in_channels: int
    image_size: int

    @classmethod
    def from_config(cls, config: UNetConfig) -> UNetIO:
        return cls(in_channels=config.in_channels, image_size=config.image_size)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        image = (BATCH, self.in_channels, self.image_size, self.image_size)
        return (TensorSpec("x_t", torch.float32, image), TensorSpec("t", torch.int64, (BATCH,)))

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("eps", torch.float32, (BATCH, self.in_channels, self.image_size, self.image_size)),)

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.inputs + self.outputs

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [spec.name for spec in self.outputs]

    def shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape at one batch size."""
        return {spec.name: spec.concrete(batch_size) for spec in self.tensors}

    def profile(self, batch: BatchRange) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) shapes of each input: a TensorRT optimization profile."""
        return {spec.name: tuple(spec.concrete(b) for b in batch.to_list()) for spec in self.inputs}

    def example_inputs(
        self, batch_size: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random (x_t, t): x_t ~ N(0, I) (B, C, H, W) and t uniform in [0, 1000) (B,)."""
        x_t = torch.randn(self.inputs[0].concrete(batch_size), generator=generator).to(device)
        t = torch.randint(0, 1000, (batch_size,), generator=generator).to(device)
        return x_t, t

    def torch_dynamic_shapes(self) -> tuple[dict[int, torch.export.Dim], ...]:
        """The batch axis of each input as one shared ``torch.export.Dim`` (for torch.onnx.export)."""
        batch = torch.export.Dim(BATCH, min=1)
        return tuple({spec.shape.index(BATCH): batch} for spec in self.inputs)

    def to_dict(self) -> dict:
        return {"inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs]}


# --------------------------------------------------------------------------------------------
# Metadata, hashes, checkpoints
# --------------------------------------------------------------------------------------------


def artifact_metadata(
    *, model_config: UNetConfig, schedule_config: ScheduleConfig | None, weights: str | None, **extra
) -> dict:
    """What an artifact carries besides its weights, as plain JSON data (``weights``: "ema" or "model")."""
    return {
        "format": ARTIFACT_FORMAT,
        "model_config": model_config.to_dict(),
        "schedule_config": asdict(schedule_config) if schedule_config is not None else None,
        "weights": weights,
        "io": UNetIO.from_config(model_config).to_dict(),
        **extra,
    }


def parse_artifact_metadata(raw: str | bytes | dict | None, *, source: Path) -> tuple[UNetConfig, ScheduleConfig, dict]:
    """Model config, schedule config and the whole metadata of an artifact; ValueError if unusable."""
    if raw is None:
        raise ValueError(f"{source} carries no model metadata (configs, I/O spec); export it with --mode export")
    try:
        meta = raw if isinstance(raw, dict) else json.loads(raw)
        if meta.get("format") != ARTIFACT_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {ARTIFACT_FORMAT!r}")
        model_config = UNetConfig(**meta["model_config"])
        if meta.get("schedule_config") is None:
            raise ValueError("no noise schedule")
        schedule_config = ScheduleConfig(**meta["schedule_config"])
        if meta.get("io") != UNetIO.from_config(model_config).to_dict():
            raise ValueError("its inputs and outputs differ from this version's U-Net interface")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{source} has unusable model metadata ({first_line(exc)}); export it again") from exc
    return model_config, schedule_config, meta


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(model: nn.Module) -> str:
    """A fingerprint of a model's weights and buffers (names, dtypes, shapes and values)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        # sync: each tensor comes to the host once, to be hashed.
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_checkpoint_model(
    path: str | Path, *, weights: str = "ema", device: torch.device | str = "cpu"
) -> tuple[UNet, ScheduleConfig]:
    """The U-Net of a checkpoint with its EMA (or raw) weights, in eval mode, and its schedule config."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    state = load_checkpoint(path)
    model = UNet(UNetConfig(**state["model_config"]))
    model.load_state_dict(state[weights])
    return model.to(device).eval(), ScheduleConfig(**state["schedule_config"])


def max_abs_diff(
    candidate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reference: nn.Module,
    *,
    io: UNetIO,
    batch_sizes: Sequence[int] = (1, 3),
    seed: int = 0,
) -> float:
    """Largest |eps_candidate - eps_reference| over random inputs at each batch size."""
    generator = torch.Generator().manual_seed(seed)
    device = next(reference.parameters()).device
    worst = 0.0
    with torch.no_grad():
        for batch_size in batch_sizes:
            x_t, t = io.example_inputs(batch_size, generator=generator, device=device)
            diff = (candidate(x_t, t).float() - reference(x_t, t).float()).abs().max()
            worst = max(worst, diff.item())  # sync: one number per batch size
    return worst


# --------------------------------------------------------------------------------------------
# ONNX and onnxruntime
# --------------------------------------------------------------------------------------------


def import_onnx():
    try:
        import onnx
        import onnxscript  # noqa: F401  (torch.onnx's exporter translates through it)
    except ImportError as exc:
        raise ImportError(
            f"ONNX export needs onnx and onnxscript ({first_line(exc)}); install them: {ONNX_INSTALL}"
        ) from exc
    return onnx


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(f"onnxruntime is not installed ({first_line(exc)}); install it: {ORT_INSTALL}") from exc
    return onnxruntime


def export_onnx_model(model: UNet, *, metadata: dict, opset: int = DEFAULT_OPSET):
    """Export an eval-mode U-Net to a checked ``onnx.ModelProto`` with a dynamic batch and ``metadata``."""
    if opset < MIN_OPSET:
        raise ValueError(f"--opset must be at least {MIN_OPSET} (GroupNormalization), got {opset}")
    onnx = import_onnx()
    io = UNetIO.from_config(model.config)
    device = next(model.parameters()).device
    example = io.example_inputs(2, device=device)  # B = 2: torch.export specializes sizes 0 and 1
    with warnings.catch_warnings():
        # x_t and t share one batch Dim; the exporter notes that it keeps one of the two names.
        warnings.filterwarnings("ignore", message=r".*axis name: .* will not be used")
        program = torch.onnx.export(
            model.eval(),
            example,
            input_names=io.input_names,
            output_names=io.output_names,
            opset_version=opset,
            dynamo=True,
            dynamic_shapes=io.torch_dynamic_shapes(),
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    _check_onnx_io(proto, io, onnx)
    entry = proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps(metadata, sort_keys=True)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _check_onnx_io(proto, io: UNetIO, onnx) -> None:
    """The exported graph's inputs and outputs are the spec's: names, dtypes, shapes, a named batch axis."""
    elem_types = {torch.float32: onnx.TensorProto.FLOAT, torch.int64: onnx.TensorProto.INT64}
    for spec, value in zip(io.tensors, [*proto.graph.input, *proto.graph.output], strict=True):
        tensor_type = value.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in tensor_type.shape.dim]
        matches = (
            value.name == spec.name
            and tensor_type.elem_type == elem_types[spec.dtype]
            and len(dims) == len(spec.shape)
            and isinstance(dims[spec.shape.index(BATCH)], str)  # a named (dynamic) axis, not a number
            and all(d == s for d, s in zip(dims, spec.shape) if s != BATCH)
        )
        if not matches:
            raise RuntimeError(f"the exported graph's {value.name} {dims} does not match the spec {spec}")


def onnxruntime_providers(available: Sequence[str], *, device_type: str, trt_cache_dir: Path | None = None) -> list:
    """Execution providers in order of preference: on a GPU, TensorRT's and CUDA's when installed
    (onnxruntime-gpu), then the CPU. TensorRT's builds its own engine, so it gets an engine cache."""
    providers: list = []
    if device_type == "cuda":
        if "TensorrtExecutionProvider" in available and trt_cache_dir is not None:
            options = {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(trt_cache_dir)}
            providers.append(("TensorrtExecutionProvider", options))
        if "CUDAExecutionProvider" in available:
            providers.append("CUDAExecutionProvider")
    providers.append("CPUExecutionProvider")
    return providers


class OnnxRuntimeUNet(nn.Module):
    """eps = unet(x_t, t) through an onnxruntime session: the PyTorch U-Net's call, for the sampling loops.

    Inputs go to the session as NumPy arrays and eps comes back as a tensor on x_t's device; with
    the CUDA provider that is a host round trip per call, which keeps this path simple and exact.
    ``path`` is the ONNX file when the session came from one (the tensorrt implementation builds
    its engine from it).
    """

    def __init__(self, session, *, io: UNetIO, path: Path | None = None) -> None:
        super().__init__()
        self.session, self.io, self.path = session, io, path

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # sync: (B, C, H, W) x_t and (B,) t come to the host for onnxruntime.
        feed = {
            "x_t": x_t.detach().to("cpu", torch.float32).contiguous().numpy(),
            "t": t.detach().to("cpu", torch.int64).contiguous().numpy(),
        }
        (eps,) = self.session.run(self.io.output_names, feed)
        return torch.from_numpy(eps).to(x_t.device)  # (B, C, H, W) float32


def onnxruntime_session(model: bytes | Path, *, device: torch.device, trt_cache_dir: Path | None = None):
    """An onnxruntime session for an ONNX file or serialized model; ValueError if it is not valid ONNX."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    options.intra_op_num_threads = torch.get_num_threads()  # as many threads as PyTorch uses
    providers = onnxruntime_providers(
        ort.get_available_providers(), device_type=device.type, trt_cache_dir=trt_cache_dir
    )
    source = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(source, sess_options=options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own classes (InvalidProtobuf, InvalidGraph, Fail, ...)
        name = "the exported model" if isinstance(model, bytes) else model
        raise ValueError(f"{name} is corrupt or not an ONNX model onnxruntime can run ({first_line(exc)})") from exc


def as_onnxruntime(model: nn.Module, *, device: torch.device, opset: int = DEFAULT_OPSET) -> OnnxRuntimeUNet:
    """An onnxruntime U-Net: ``model`` itself if it is one, else a U-Net exported to ONNX in memory."""
    if isinstance(model, OnnxRuntimeUNet):
        return model
    if not isinstance(model, UNet):
        raise ValueError("onnxruntime runs checkpoints and .onnx files; this model is neither")
    metadata = artifact_metadata(model_config=model.config, schedule_config=None, weights=None)  # never saved
    proto = export_onnx_model(model, metadata=metadata, opset=opset)
    session = onnxruntime_session(proto.SerializeToString(), device=device)
    return OnnxRuntimeUNet(session, io=UNetIO.from_config(model.config))


# --------------------------------------------------------------------------------------------
# TorchScript
# --------------------------------------------------------------------------------------------

TORCHSCRIPT_EXTRA_FILE = f"{METADATA_KEY}.json"


@contextlib.contextmanager
def _quiet_torchscript() -> Iterator[None]:
    """TorchScript is deprecated in favour of torch.export, but it is still the format asked for here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.jit.*deprecated")
        # GroupNorm's batch-size check reads a traced value; the traced graph is compared with eager instead.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


def trace_torchscript(model: UNet) -> torch.jit.ScriptModule:
    """Trace an eval-mode U-Net on its own device (a trace fixes the device it ran on)."""
    example = UNetIO.from_config(model.config).example_inputs(2, device=next(model.parameters()).device)
    with _quiet_torchscript():
        return torch.jit.trace(model.eval(), example, check_trace=False)


def save_torchscript(module: torch.jit.ScriptModule, path: str | Path, *, metadata: dict) -> Path:
    extra = {TORCHSCRIPT_EXTRA_FILE: json.dumps(metadata, sort_keys=True)}
    with _quiet_torchscript():
        return atomic_write(path, lambda f: torch.jit.save(module, f, _extra_files=extra))


def load_torchscript(
    path: Path, *, device: torch.device
) -> tuple[torch.jit.ScriptModule, UNetConfig, ScheduleConfig, dict]:
    extra = {TORCHSCRIPT_EXTRA_FILE: b""}
    try:
        with _quiet_torchscript():
            module = torch.jit.load(str(path), map_location=device, _extra_files=extra)
    except (RuntimeError, ValueError, OSError) as exc:
        raise ValueError(f"{path} is corrupt or not a TorchScript file ({first_line(exc)})") from exc
    model_config, schedule_config, meta = parse_artifact_metadata(extra[TORCHSCRIPT_EXTRA_FILE] or None, source=path)
    if meta.get("traced_on") != device.type:
        raise ValueError(
            f"{path} was traced on {meta.get('traced_on')} and a trace only runs there: sample with "
            f"--device {meta.get('traced_on')}, or export it again with --device {device.type}"
        )
    return module.eval(), model_config, schedule_config, meta


# --------------------------------------------------------------------------------------------
# Loading any artifact; exporting a checkpoint
# --------------------------------------------------------------------------------------------


@dataclass
class Artifact:
    """A U-Net ready to sample (``eps = model(x_t, t)``) and the configs that go with it."""

    kind: str  # one of IMPLEMENTATIONS_FOR
    path: Path
    model: nn.Module
    model_config: UNetConfig
    schedule_config: ScheduleConfig


def artifact_kind(path: str | Path) -> str:
    kind = ARTIFACT_KINDS.get(Path(path).suffix)
    if kind is None:
        raise ValueError(f"--model_path {path}: expected a file ending in {', '.join(ARTIFACT_KINDS)}")
    return kind


def check_implementation(kind: str, implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS_FOR[kind]:
        raise ValueError(
            f"the {implementation} implementation cannot run {KIND_NAMES[kind]} files; "
            f"use --implementation {' or '.join(IMPLEMENTATIONS_FOR[kind])}, or sample from the checkpoint"
        )


def load_artifact(path: str | Path, *, device: torch.device, weights: str = "ema") -> Artifact:
    """Load a checkpoint or an exported U-Net by its suffix, with the configs stored in or beside it."""
    path, kind = Path(path), artifact_kind(path)
    if kind == "checkpoint":
        model, schedule_config = load_checkpoint_model(path, weights=weights, device=device)
        return Artifact(kind, path, model, model.config, schedule_config)
    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file")
    if kind == "torchscript":
        model, model_config, schedule_config, meta = load_torchscript(path, device=device)
    elif kind == "onnx":
        session = onnxruntime_session(path, device=device, trt_cache_dir=path.with_name(f"{path.stem}_ort_trt"))
        raw = session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
        model_config, schedule_config, meta = parse_artifact_metadata(raw, source=path)
        model = OnnxRuntimeUNet(session, io=UNetIO.from_config(model_config), path=path)
    else:
        import tensorrt_integration

        model, model_config, schedule_config, meta = tensorrt_integration.load_engine_artifact(path, device=device)
    if meta["weights"] != weights and meta["weights"] == "ema":
        raise ValueError(f"{path} holds the EMA weights only; drop --no_ema (or export the raw ones with --no_ema)")
    if meta["weights"] != weights:
        raise ValueError(f"{path} holds the raw weights only (it was exported with --no_ema); sample it with --no_ema")
    return Artifact(kind, path, model, model_config, schedule_config)


def default_output(source: str | Path, fmt: str) -> Path:
    """Where an export goes by default: beside its checkpoint, with the format's suffix."""
    return Path(source).with_suffix(FORMAT_SUFFIXES[fmt][0])


def check_export_paths(source: Path, output: Path, fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if output.suffix not in FORMAT_SUFFIXES[fmt]:
        raise ValueError(
            f"--format {fmt} needs an --output ending in {' or '.join(FORMAT_SUFFIXES[fmt])}, got {output}"
        )
    check_output_file(output)
    if output.resolve() == source.resolve():
        raise ValueError(f"--output {output} would overwrite the source {source}")


def export_checkpoint(
    source: str | Path,
    *,
    fmt: str,
    output: str | Path,
    weights: str = "ema",
    device: torch.device,
    opset: int = DEFAULT_OPSET,
) -> list[str]:
    """Export a checkpoint's U-Net to ONNX or TorchScript, check it against PyTorch; returns report lines."""
    source, output = Path(source), Path(output)
    check_export_paths(source, output, fmt)
    if fmt == "tensorrt":
        raise ValueError("build TensorRT engines with tensorrt_integration.export_engine")
    if fmt == "onnx":
        import_onnx()  # fail before any work if a package is missing
        import_onnxruntime()
        device = torch.device("cpu")  # an ONNX graph holds no device; export and compare on the CPU
    model, schedule_config = load_checkpoint_model(source, weights=weights, device=device)
    io = UNetIO.from_config(model.config)
    batch_sizes = (1, 3, 8)
    if fmt == "onnx":
        metadata = artifact_metadata(
            model_config=model.config, schedule_config=schedule_config, weights=weights, opset=opset
        )
        proto = export_onnx_model(model, metadata=metadata, opset=opset)
        data = proto.SerializeToString()
        atomic_write(output, lambda f: f.write(data))
        runtime = OnnxRuntimeUNet(onnxruntime_session(data, device=device), io=io)
        diff = max_abs_diff(runtime, model, io=io, batch_sizes=batch_sizes)
        checked = f"opset {opset}, dynamic batch, onnx.checker passed"
        compared = f"onnxruntime vs PyTorch ({weights} weights)"
    else:
        metadata = artifact_metadata(
            model_config=model.config, schedule_config=schedule_config, weights=weights, traced_on=device.type
        )
        module = trace_torchscript(model)
        save_torchscript(module, output, metadata=metadata)
        loaded, *_ = load_torchscript(output, device=device)
        diff = max_abs_diff(loaded, model, io=io, batch_sizes=batch_sizes)
        checked = f"traced on {device.type}"
        compared = f"TorchScript vs PyTorch ({weights} weights)"
    sizes = ", ".join(map(str, batch_sizes))
    return [f"wrote {output} ({checked})", f"{compared}: max abs diff {diff:.3e} at batch sizes {sizes}"]

