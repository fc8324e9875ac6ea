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
and needs nothing else.

Artifacts are validated at load, not trusted; every failure is a one-line ValueError naming the file.
Each file is refused before it is read when larger than ``checkpoints.MAX_FILE_BYTES`` allows, and
its configs go through ``UNetConfig.from_dict`` / ``ScheduleConfig.from_dict``. A TorchScript file is
a program (loading it runs its ``__setstate__``, calling it runs its code): it is loaded only with
``trust_torchscript=True`` (``--trust_torchscript``), its metadata is read and checked first, and an
error from its code is reported in one line. An ONNX file is checked before onnxruntime sees it
(:func:`load_onnx`): parsed from its bytes, no external data, the opset within
``MIN_OPSET..MAX_OPSET``, its metadata, its graph's inputs and outputs against the metadata's I/O spec,
``onnx.checker``; the session is then made from the same bytes.

onnx, onnxscript (the exporter's backend) and onnxruntime are optional; they are imported when used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from torch import nn

import checkpoints
from basic_diffusion import UNet, UNetConfig
from checkpoints import first_line, load_checkpoint, load_weights, parse_json, read_configs, read_limited
from noise_schedule import ScheduleConfig, short_repr
from precision import PRECISIONS
from safe_files import atomic_write, check_target

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
# MAX_OPSET is the newest that torch.onnx's dynamo exporter (torch 2.14.1, onnxscript 0.7.2) writes for
# this U-Net and onnxruntime 1.31.1 runs (max abs diff vs PyTorch ~1e-6 at 18, 21, 22, 23, 24, 25);
# at 26 the exporter's version conversion fails (no Attention adapter from 22), 2026-11-22.
DEFAULT_OPSET = 21
BF16_MIN_OPSET = 22  # ONNX allows bfloat16 convolutions and GroupNormalization from opset 22
MIN_OPSET = 18
MAX_OPSET = 25
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
    """Model config, schedule config and the whole metadata of an artifact; ValueError if unusable.

    ``raw`` is JSON text (parsed by checkpoints.parse_json: size- and depth-limited) or its parsed
    dict; the configs go through their ``from_dict``, ``weights`` must be one of :data:`WEIGHTS`.
    """
    if raw is None:
        raise ValueError(f"{source} carries no model metadata (configs, I/O spec); export it with --mode export")
    meta = raw if isinstance(raw, dict) else parse_json(raw, source=source)
    if not isinstance(meta, dict):
        problem = f"a JSON {type(meta).__name__} instead of an object"
    elif meta.get("format") != ARTIFACT_FORMAT:
        problem = f"format {short_repr(meta.get('format'))}, expected {ARTIFACT_FORMAT!r}"
    elif meta.get("schedule_config") is None:
        problem = "no noise schedule"
    elif meta.get("weights") not in WEIGHTS:
        problem = f"weights {short_repr(meta.get('weights'))}, expected one of {', '.join(WEIGHTS)}"
    elif meta.get("precision", "fp32") not in PRECISIONS:
        problem = f"precision {short_repr(meta.get('precision'))}, expected one of {', '.join(PRECISIONS)}"
    else:
        problem = None
    if problem is None:
        model_config, schedule_config = read_configs(meta, source=str(source))
        if meta.get("io") != UNetIO.from_config(model_config).to_dict():
            problem = "its inputs and outputs differ from this version's U-Net interface"
    if problem is not None:
        raise ValueError(f"{source} has unusable model metadata ({problem}); export it again")
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
    """The U-Net of a checkpoint with its EMA (or raw) weights, in eval mode, and its schedule config.

    The U-Net is built on the meta device and takes the checkpoint's tensors (checkpoints.load_weights
    with ``assign``), so nothing is allocated for a config until its weights are known to match it.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    state = load_checkpoint(path)
    source = f"checkpoint {path}"
    model_config, schedule_config = read_configs(state, source=source)
    with torch.device("meta"):
        model = UNet(model_config)
    load_weights(model, state[weights], source=source, assign=True)
    return model.to(device).eval(), schedule_config


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


def import_onnx(*, exporter: bool = True):
    """The onnx module; with ``exporter``, also check for onnxscript (torch.onnx's exporter needs it)."""
    try:
        import onnx

        if exporter:
            import onnxscript  # noqa: F401  (torch.onnx's exporter translates through it)
    except ImportError as exc:
        what = "ONNX export needs onnx and onnxscript" if exporter else "reading ONNX files needs onnx"
        raise ImportError(f"{what} ({first_line(exc)}); install them: {ONNX_INSTALL}") from exc
    return onnx


def check_opset(opset: int) -> None:
    """``--opset`` must be one the exporter writes for this U-Net and onnxruntime runs."""
    if type(opset) is not int or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(
            f"--opset must be between {MIN_OPSET} (GroupNormalization) and {MAX_OPSET} (the newest the exporter "
            f"and onnxruntime support here), got {short_repr(opset)}"
        )


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(f"onnxruntime is not installed ({first_line(exc)}); install it: {ORT_INSTALL}") from exc
    return onnxruntime


def default_opset(precision: str = "fp32") -> int:
    """The opset an export uses when --opset is not given: 21, or 22 for a bf16 graph."""
    return BF16_MIN_OPSET if precision == "bf16" else DEFAULT_OPSET


def export_onnx_model(model: UNet, *, metadata: dict, opset: int = DEFAULT_OPSET, precision: str = "fp32"):
    """Export an eval-mode U-Net to a checked ``onnx.ModelProto`` with a dynamic batch and ``metadata``.

    ``precision`` "fp16" or "bf16" writes a mixed-precision graph (precision.mixed_precision_unet:
    convolutions and matmuls in the low precision, the time embedding, normalization and softmax
    in float32, float32 inputs and output), the form strongly typed TensorRT builds.
    """
    check_opset(opset)
    if precision == "bf16" and opset < BF16_MIN_OPSET:
        raise ValueError(f"a bf16 ONNX graph needs --opset {BF16_MIN_OPSET} or later (bfloat16 convolutions), got {opset}")
    onnx = import_onnx()
    io = UNetIO.from_config(model.config)
    if precision != "fp32":
        from precision import mixed_precision_unet

        model = mixed_precision_unet(model, precision)
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
    problems = onnx_io_mismatches(proto, io)
    if problems:  # the exporter's doing, not the user's
        raise RuntimeError(f"the exported graph does not match the U-Net's I/O spec ({'; '.join(problems)})")
    entry = proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps({**metadata, "precision": precision}, sort_keys=True)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def onnx_io_mismatches(proto, io: UNetIO) -> list[str]:
    """How a graph's inputs and outputs differ from the spec: names, dtypes, shapes, a named batch axis."""
    from onnx import TensorProto

    elem_types = {torch.float32: TensorProto.FLOAT, torch.int64: TensorProto.INT64}
    graph = proto.graph
    problems = []
    for kind, specs, values in (("inputs", io.inputs, graph.input), ("outputs", io.outputs, graph.output)):
        if [v.name for v in values] != [s.name for s in specs]:
            names = [short_repr(v.name) for v in values[:4]]
            problems.append(f"{kind} {', '.join(names) or 'none'}, expected {', '.join(repr(s.name) for s in specs)}")
            continue
        for spec, value in zip(specs, values):
            tensor_type = value.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in tensor_type.shape.dim]
            matches = (
                tensor_type.elem_type == elem_types[spec.dtype]
                and len(dims) == len(spec.shape)
                and isinstance(dims[spec.shape.index(BATCH)], str)  # a named (dynamic) axis, not a number
                and all(d == s for d, s in zip(dims, spec.shape) if s != BATCH)
            )
            if not matches:
                found = f"{_onnx_dtype_name(tensor_type.elem_type)} {_shape_text(dims)}"
                expected = f"{_onnx_dtype_name(elem_types[spec.dtype])} {_shape_text(spec.shape)}"
                problems.append(f"{spec.name} is {found}, expected {expected}")
    return problems


def _onnx_dtype_name(elem_type: int) -> str:
    from onnx import TensorProto

    known = elem_type in TensorProto.DataType.values()
    return TensorProto.DataType.Name(elem_type).lower() if known else str(elem_type)


def _shape_text(dims: Sequence[int | str]) -> str:
    """A shape for a one-line message: named (dynamic) axes as B, at most 8 axes."""
    shown = ", ".join("B" if isinstance(d, str) else str(d) for d in dims[:8])
    return f"[{shown}{', ...' if len(dims) > 8 else ''}]"


def onnxruntime_providers(available: Sequence[str], *, device_type: str, trt_cache_dir: Path | None = None) -> list:
    """Execution providers in order of preference: on a GPU, TensorRT's and CUDA's when installed
    (onnxruntime-gpu), then the CPU. TensorRT's builds its own engine, so it gets an engine cache."""
    providers: list = []
    if device_type == "cuda":
        if "TensorrtExecutionProvider" in available and trt_cache_dir is not None:
            options = {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(trt_cache_dir)}
            providers.append(("TensorrtExecutionProvider", options))
        if "CUDAExecutionProvider" in available:
            providers.append(("CUDAExecutionProvider", {"use_tf32": "0"}))  # true fp32, like the original row
    providers.append("CPUExecutionProvider")
    return providers


class OnnxRuntimeUNet(nn.Module):
    """eps = unet(x_t, t) through an onnxruntime session: the PyTorch U-Net's call, for the sampling loops.

    Inputs and output are bound to torch tensors (onnxruntime's I/O binding): with the CUDA
    execution provider (onnxruntime-gpu) and tensors on the GPU, x_t, t and eps stay on the GPU
    between steps; with the CPU provider, onnxruntime reads and writes the tensors' memory
    directly, without NumPy copies. ``path`` is the ONNX file when the session came from one
    (the tensorrt implementation builds its engine from it).
    """

    def __init__(self, session, *, io: UNetIO, path: Path | None = None, metadata: dict | None = None) -> None:
        super().__init__()
        self.session, self.io, self.path = session, io, path
        self.metadata = metadata or {}  # the file's artifact metadata ("precision": the graph's, fp32 if absent)
        self.provider = session.get_providers()[0]  # the execution provider onnxruntime runs first

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        caller = x_t.device  # eps goes back there
        on_gpu = self.provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider") and x_t.is_cuda
        device = caller if on_gpu else torch.device("cpu")
        x_t = x_t.detach().to(device, torch.float32).contiguous()  # (B, C, H, W); to the host with the CPU provider
        t = t.detach().to(device, torch.int64).contiguous()  # (B,)
        eps = torch.empty(self.io.shapes(x_t.shape[0])[self.io.output_names[0]], dtype=torch.float32, device=device)
        binding = self.session.io_binding()
        kind, index = ("cuda", device.index or 0) if on_gpu else ("cpu", 0)
        for name, tensor in zip(self.io.input_names, (x_t, t)):
            binding.bind_input(name, kind, index, _NUMPY_DTYPES[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
        binding.bind_output(self.io.output_names[0], kind, index, np.float32, tuple(eps.shape), eps.data_ptr())
        if on_gpu:
            torch.cuda.current_stream(device).synchronize()  # sync: onnxruntime runs on its own stream
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own classes; a file's graph can fail at run time
            if self.path is None:
                raise  # an in-memory export failing is a bug, not a user's error
            raise ValueError(f"{self.path} failed when run ({first_line(exc)})") from exc
        return eps.to(caller)  # (B, C, H, W) float32


_NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64}


def _ort_reason(exc: Exception) -> str:
    """The short reason inside onnxruntime's message ("Could not find an implementation for Conv(22) ...")."""
    text = first_line(exc)
    return text.rsplit(" : ", 1)[-1].rstrip(")")[:100]


def onnxruntime_session(
    model: bytes | Path, *, device: torch.device, trt_cache_dir: Path | None = None, source: Path | None = None
):
    """An onnxruntime session for an ONNX file or serialized model; ValueError if it is not valid ONNX.

    Files are validated by :func:`load_onnx` first, which passes their checked bytes and ``source``.
    """
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    options.intra_op_num_threads = torch.get_num_threads()  # as many threads as PyTorch uses
    providers = onnxruntime_providers(
        ort.get_available_providers(), device_type=device.type, trt_cache_dir=trt_cache_dir
    )
    try:
        return ort.InferenceSession(
            model if isinstance(model, bytes) else str(model), sess_options=options, providers=providers
        )
    except Exception as exc:  # onnxruntime raises its own classes (InvalidProtobuf, InvalidGraph, Fail, ...)
        name = source or ("the exported model" if isinstance(model, bytes) else model)
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


def load_onnx(path: Path, *, device: torch.device) -> tuple[OnnxRuntimeUNet, UNetConfig, ScheduleConfig, dict]:
    """An ONNX file validated before onnxruntime sees it, then run by onnxruntime from the same bytes.

    In order: the size limit (before reading), the bytes parsed by onnx, no external data (it would
    make onnxruntime read other files), the default-domain opset within MIN_OPSET..MAX_OPSET and no
    other domain, the metadata (:func:`parse_artifact_metadata`), the graph's inputs and outputs
    against the metadata's I/O spec, ``onnx.checker``; only then the session.
    """
    data = read_limited(path, kind="onnx")
    onnx = import_onnx(exporter=False)
    try:
        proto = onnx.load_model_from_string(data)
    except Exception as exc:  # google.protobuf's DecodeError, and whatever else a parser raises on junk
        raise ValueError(f"{path} is corrupt or not an ONNX model ({first_line(exc)})") from exc
    external = [tensor.name for tensor in _onnx_tensors(proto) if tensor.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ValueError(
            f"{path} keeps tensor {short_repr(external[0])} in an external file, which is not read; "
            "this tool's exports hold all their weights"
        )
    domains = [(o.domain, o.version) for o in proto.opset_import]
    opsets = [version for domain, version in domains if domain in ("", "ai.onnx")]
    if not opsets:
        raise ValueError(f"{path} is corrupt or not an ONNX model (it imports no ONNX opset)")
    others = sorted({domain for domain, _ in domains if domain not in ("", "ai.onnx")})
    if len(opsets) > 1 or others:
        found = ", ".join(short_repr(d) for d in others) or "the ONNX domain twice"
        raise ValueError(f"{path} imports {found}; this tool's exports use the ONNX domain once and nothing else")
    if not MIN_OPSET <= opsets[0] <= MAX_OPSET:
        raise ValueError(f"{path} uses ONNX opset {opsets[0]}; this tool runs opsets {MIN_OPSET} to {MAX_OPSET}")
    entries = [entry.value for entry in proto.metadata_props if entry.key == METADATA_KEY]
    if len(entries) > 1:
        raise ValueError(f"{path} has {len(entries)} {METADATA_KEY!r} metadata entries; export it again")
    model_config, schedule_config, meta = parse_artifact_metadata(entries[0] if entries else None, source=path)
    io = UNetIO.from_config(model_config)
    problems = onnx_io_mismatches(proto, io)
    if problems:
        raise ValueError(f"{path}: its graph's inputs and outputs do not match its metadata ({'; '.join(problems)})")
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # onnx.checker.ValidationError, shape inference errors
        raise ValueError(f"{path} fails onnx.checker ({first_line(exc)})") from exc
    trt_cache_dir = path.with_name(f"{path.stem}_ort_trt")
    session = onnxruntime_session(data, device=device, trt_cache_dir=trt_cache_dir, source=path)
    return OnnxRuntimeUNet(session, io=io, path=path, metadata=meta), model_config, schedule_config, meta


def _onnx_tensors(proto) -> Iterator:
    """Every TensorProto of a model: initializers and attribute tensors, in subgraphs and functions too."""
    graphs, node_lists = [proto.graph], [function.node for function in proto.functions]
    while graphs or node_lists:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            node_lists.append(graph.node)
            continue
        for node in node_lists.pop():
            for attribute in node.attribute:
                yield attribute.t  # an empty TensorProto when the attribute is no tensor
                yield from attribute.tensors
                yield from (attribute.sparse_tensor.values, attribute.sparse_tensor.indices)
                for sparse in attribute.sparse_tensors:
                    yield from (sparse.values, sparse.indices)
                if attribute.HasField("g"):
                    graphs.append(attribute.g)
                graphs.extend(attribute.graphs)


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


class TorchScriptUNet(nn.Module):
    """A loaded TorchScript U-Net whose errors (its own code's) end as one-line ValueErrors naming its file."""

    def __init__(self, module: torch.jit.ScriptModule, *, path: Path) -> None:
        super().__init__()
        self.module, self.path = module, path

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        try:
            return self.module(x_t, t)
        except Exception as exc:  # torch.jit.Error, RuntimeError, or whatever the file's code raises
            raise ValueError(f"{self.path} failed when run ({torchscript_error(exc)})") from exc


def torchscript_error(exc: BaseException) -> str:
    """One line of a TorchScript error: the interpreter's message ends with the original one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines and lines[0].startswith("The following operation failed in the TorchScript interpreter"):
        return lines[-1]
    return first_line(exc)


def load_torchscript(
    path: Path, *, device: torch.device, trusted: bool
) -> tuple[TorchScriptUNet, UNetConfig, ScheduleConfig, dict]:
    """A TorchScript U-Net, only when ``trusted`` (loading runs the file's code); ValueError otherwise.

    The file is read within its size limit and its metadata (the extra file, read from the zip
    without torch) is checked before torch.jit.load runs anything.
    """
    if not trusted:
        raise ValueError(
            f"{path} is a TorchScript file: a program, not only weights, and loading it runs its code; "
            "pass --trust_torchscript if it comes from a source you trust"
        )
    data = read_limited(path, kind="torchscript")
    raw = torchscript_extra_file(data, path=path)
    model_config, schedule_config, meta = parse_artifact_metadata(raw, source=path)
    if meta.get("traced_on") not in ("cpu", "cuda"):
        traced_on = short_repr(meta.get("traced_on"))
        raise ValueError(f"{path} has unusable model metadata (traced_on {traced_on}); export it again")
    if meta["traced_on"] != device.type:
        raise ValueError(
            f"{path} was traced on {meta['traced_on']} and a trace only runs there: sample with "
            f"--device {meta['traced_on']}, or export it again with --device {device.type}"
        )
    try:
        with _quiet_torchscript():
            module = torch.jit.load(BytesIO(data), map_location=device)
    except Exception as exc:  # RuntimeError on broken archives; anything from the file's own __setstate__
        raise ValueError(f"{path} is corrupt or not a TorchScript file ({torchscript_error(exc)})") from exc
    return TorchScriptUNet(module, path=path).eval(), model_config, schedule_config, meta


def torchscript_extra_file(data: bytes, *, path: Path) -> bytes | None:
    """The metadata extra file of a TorchScript archive (``<name>/extra/ddpm.json``), read as a zip
    member, within the metadata size limit; None if there is none."""
    limit = checkpoints.MAX_FILE_BYTES["metadata"]
    try:
        with zipfile.ZipFile(BytesIO(data)) as archive:
            name = f"extra/{TORCHSCRIPT_EXTRA_FILE}"  # under the archive's top folder
            members = [info for info in archive.infolist() if info.filename.split("/", 1)[-1] == name]
            if not members:
                return None
            if members[0].file_size > limit:
                raise ValueError(f"{path}: its metadata is over the {checkpoints.format_bytes(limit)} limit")
            with archive.open(members[0]) as f:
                return f.read(limit + 1)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, NotImplementedError, RuntimeError) as exc:
        raise ValueError(f"{path} is corrupt or not a TorchScript file ({first_line(exc)})") from exc


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


def load_artifact(
    path: str | Path, *, device: torch.device, weights: str = "ema", trust_torchscript: bool = False
) -> Artifact:
    """Load a checkpoint or an exported U-Net by its suffix, with the configs stored in or beside it.

    Everything is validated first (see the module docstring); a TorchScript file is refused unless
    ``trust_torchscript``, before anything reads it.
    """
    path, kind = Path(path), artifact_kind(path)
    if kind == "checkpoint":
        model, schedule_config = load_checkpoint_model(path, weights=weights, device=device)
        return Artifact(kind, path, model, model.config, schedule_config)
    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file")
    if kind == "torchscript":  # refused before it is read unless trusted
        model, model_config, schedule_config, meta = load_torchscript(path, device=device, trusted=trust_torchscript)
    elif kind == "onnx":
        model, model_config, schedule_config, meta = load_onnx(path, device=device)
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
    check_target(output, flag="--output")
    if output.resolve() == source.resolve():
        raise ValueError(f"--output {output} would overwrite the source {source}")


def export_checkpoint(
    source: str | Path,
    *,
    fmt: str,
    output: str | Path,
    weights: str = "ema",
    device: torch.device,
    opset: int | None = None,
    precision: str = "fp32",
) -> list[str]:
    """Export a checkpoint's U-Net to ONNX or TorchScript, check it against PyTorch; returns report lines.

    ONNX may be written in mixed precision (``precision`` fp16/bf16); its check is then against
    the same mixed-precision U-Net in PyTorch, and the fp32 U-Net's difference is reported too.
    """
    if fmt != "onnx" and precision != "fp32":
        raise ValueError(f"{fmt} exports hold fp32 weights; --precision fp16/bf16 applies to --format onnx and tensorrt")
    opset = default_opset(precision) if opset is None else opset
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
        proto = export_onnx_model(model, metadata=metadata, opset=opset, precision=precision)
        data = proto.SerializeToString()
        checked = f"{precision}, opset {opset}, dynamic batch, onnx.checker passed"
        if precision == "fp32":
            reference, compared = model, f"onnxruntime vs PyTorch ({weights} weights)"
        else:
            from precision import mixed_precision_unet

            reference = mixed_precision_unet(model, precision)
            compared = f"onnxruntime vs PyTorch's {precision} mixed-precision U-Net ({weights} weights)"
        try:
            runtime = OnnxRuntimeUNet(onnxruntime_session(data, device=device), io=io)
        except ValueError as exc:
            if precision == "fp32":
                raise
            # onnxruntime's CPU provider lacks some low-precision kernels (bf16 convolutions): say so,
            # and compare the mixed-precision U-Net in PyTorch with the fp32 one instead.
            runtime, reference = reference, model
            compared = f"onnxruntime here cannot run it ({_ort_reason(exc)}); instead PyTorch's {precision} U-Net vs fp32"
        atomic_write(output, lambda f: f.write(data))
        diff = max_abs_diff(runtime, reference, io=io, batch_sizes=batch_sizes)
    else:
        metadata = artifact_metadata(
            model_config=model.config, schedule_config=schedule_config, weights=weights, traced_on=device.type
        )
        module = trace_torchscript(model)
        save_torchscript(module, output, metadata=metadata)
        loaded, *_ = load_torchscript(output, device=device, trusted=True)  # the file traced just now
        diff = max_abs_diff(loaded, model, io=io, batch_sizes=batch_sizes)
        checked = f"traced on {device.type}"
        compared = f"TorchScript vs PyTorch ({weights} weights)"
    sizes = ", ".join(map(str, batch_sizes))
    return [f"wrote {output} ({checked})", f"{compared}: max abs diff {diff:.3e} at batch sizes {sizes}"]

