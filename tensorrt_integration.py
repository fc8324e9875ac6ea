"""TensorRT for the U-Net (and a latent model's decoder): the engine (build from ONNX, cache, load, infer) and the
"tensorrt" implementation.

    python main.py --mode sample --model_path checkpoints/mnist.pt --implementation tensorrt --precision fp16
    python main.py --mode export --format tensorrt --model_path checkpoints/mnist.pt     # -> mnist.engine (+ .json)
    python main.py --mode sample --model_path checkpoints/mnist.engine --implementation tensorrt

Written against the TensorRT 10.x Python API; which build each version gets is decided in
engine_cache.build_plan. ``tensorrt`` is imported only when an engine is built or loaded.

How a TensorRT sample runs:

1. The U-Net is exported to ONNX (formats/exporters.py, from its I/O spec ``UNetIO``) into a cache folder beside
   the checkpoint, unless it is an ONNX file already.
2. An engine is built from that file (the precision asked for, one optimization profile, a timing cache) or loaded
   from the cache (engine_cache.py: any difference in its key rebuilds, a hash mismatch is refused).
3. :class:`Engine` binds fixed torch buffers and runs on PyTorch's current stream, so a whole denoising step is
   captured in one CUDA graph by optimized_diffusion.FusedSampler (with noise_schedule.p_step when the extension
   is not built). Noise is drawn in the order of basic_diffusion.sample.
4. A latent model's decoder gets its own engine the same way (``DecoderIO``, :func:`tensorrt_decoder`);
   ``--format tensorrt`` writes it beside the U-Net's engine.

``--trt_backend torch_tensorrt`` compiles the PyTorch U-Net with ``torch_tensorrt.compile(ir="dynamo")``
instead (no ONNX, no engine cache).

The TensorRT calls themselves have not run on a machine with TensorRT; the cache rules, I/O checks and sampling
loop are tested on the CPU with a PyTorch U-Net in the engine's place.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from basic_diffusion import UNet, UNetConfig
from ddpm.choices import BACKENDS, OPT_LEVELS
from ddpm.conditioning import Guidance, unet_batch
from ddpm.formats.checkpoints import parse_artifact_metadata
from ddpm.formats.engine_cache import (
    DEFAULT_CACHE_DIR,
    ENVIRONMENT_FIELDS,
    METADATA_VERSION,
    MIN_TENSORRT_MAJOR,
    TENSORRT_INSTALL,
    BuildPlan,
    Log,
    build_plan,
    cache_dir_for,
    engine_key,
    get_or_build_engine,
    key_mismatches,
    metadata_path,
    read_metadata,
    runtime_environment,
    store_with_metadata,
    torch_tensorrt_arguments,
    verified_bytes,
    version_tuple,
)
from ddpm.formats.exporters import export_decoder_onnx, export_onnx_model
from ddpm.formats.unet_io import (
    DEFAULT_MAX_BATCH,
    BatchRange,
    DecoderIO,
    FromOnnxFile,
    IOSpec,
    UNetIO,
    artifact_metadata,
    sha256_file,
    weights_sha256,
)
from ddpm.util.messages import first_line
from ddpm.util.precision import QUANTIZED
from ddpm.util.safe_files import atomic_write, check_file_size, read_limited
from noise_schedule import SamplingPlan, ScheduleConfig, short_repr

if TYPE_CHECKING:
    from optimized_diffusion import FusedSampler


class DecoderStage(Protocol):
    """What a decoder engine is built from: a latent model's first stage (latent/autoencoder.py's FirstStage)."""

    decoder: nn.Module
    latent_shape: tuple[int, ...]
    image_shape: tuple[int, ...]

    @property
    def io(self) -> DecoderIO: ...


TORCH_TENSORRT_INSTALL = "pip install torch-tensorrt (the release matching your torch)"
DEFAULT_WORKSPACE_BYTES = 4 << 30


@dataclass(frozen=True)
class TensorRTOptions:
    """How engines are made: backend, profile size, builder effort, where the caches live."""

    backend: str = "native"
    max_batch: int = DEFAULT_MAX_BATCH  # the profile covers 1 .. max(max_batch, the batch asked for)
    optimization_level: int = 3  # TensorRT's builder_optimization_level: 0 (fast build) .. 5 (most tactics)
    opset: int | None = None  # None: chosen from the TensorRT version (see build_plan)
    cache_dir: Path | None = None  # default: DEFAULT_CACHE_DIR

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown TensorRT backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.max_batch < 1:
            raise ValueError(f"--max_batch must be a positive integer, got {self.max_batch}")
        if self.optimization_level not in OPT_LEVELS:
            raise ValueError(f"--trt_opt_level must be between 0 and 5, got {self.optimization_level}")

    @classmethod
    def for_source(
        cls,
        source: str | Path,
        *,
        backend: str = "native",
        max_batch: int | None = None,
        optimization_level: int | None = None,
        opset: int | None = None,
    ) -> TensorRTOptions:
        """Options for engines made from the file ``source``: their cache goes in a folder beside it
        (engine_cache.cache_dir_for); None keeps a default."""
        given = {"max_batch": max_batch, "optimization_level": optimization_level}
        return cls(
            backend=backend,
            opset=opset,
            cache_dir=cache_dir_for(source),
            **{k: v for k, v in given.items() if v is not None},
        )


# --------------------------------------------------------------------------------------------
# Optional packages
# --------------------------------------------------------------------------------------------


def import_tensorrt():
    """The tensorrt module (10.x or later), or an ImportError that says what to install."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise ImportError(f"TensorRT is not installed ({first_line(exc)}); install it: {TENSORRT_INSTALL}") from exc
    if version_tuple(trt.__version__) < (MIN_TENSORRT_MAJOR,):
        raise ImportError(
            f"TensorRT {trt.__version__} is too old; this code uses the 10.x API: pip install 'tensorrt>=10'"
        )
    return trt


def import_torch_tensorrt():
    try:
        import torch_tensorrt
    except ImportError as exc:
        raise ImportError(
            f"torch_tensorrt is not installed ({first_line(exc)}); install it: {TORCH_TENSORRT_INSTALL}"
        ) from exc
    return torch_tensorrt


# --------------------------------------------------------------------------------------------
# Graph details of the build
# --------------------------------------------------------------------------------------------


def time_embedding_layers(
    layers: list[tuple[list[str], list[str]]], *, network_inputs: tuple[str, ...] = ("x_t", "t"), time_input: str = "t"
) -> list[int]:
    """Indices of the layers ((input tensor names, output tensor names) each, in network order)
    whose outputs depend on ``time_input`` and on no other network input: the timestep embedding,
    its MLP and the per-block projections of it. Constants (layers without inputs) depend on nothing."""
    depends = {name: {name} for name in network_inputs}
    pinned = []
    for index, (inputs, outputs) in enumerate(layers):
        sources = set().union(*(depends.get(name, set()) for name in inputs))
        for name in outputs:
            depends[name] = sources
        if sources == {time_input}:
            pinned.append(index)
    return pinned


def require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"TensorRT runs on NVIDIA GPUs; the device here is {device} (use --device cuda on a GPU)")


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
_TORCH_DTYPES = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
}


def torch_dtype(trt_dtype) -> torch.dtype:
    """The torch dtype of a ``tensorrt.DataType`` (by its enum name)."""
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    if name not in _TORCH_DTYPES:
        raise ValueError(f"TensorRT data type {name} has no torch equivalent here")
    return _TORCH_DTYPES[name]


def io_mismatches(io: IOSpec, found: Mapping[str, tuple[str, torch.dtype]]) -> list[str]:
    """How an engine's I/O tensors ({name: ("input" | "output", dtype)}) differ from the spec."""
    expected = {s.name: ("input", s.dtype) for s in io.inputs} | {s.name: ("output", s.dtype) for s in io.outputs}
    problems = [
        f"{name}: expected {want}, engine has {found.get(name)}"
        for name, want in expected.items()
        if found.get(name) != want
    ]
    problems += [f"{name}: not in the spec" for name in found if name not in expected]
    return problems


def pin_layers_to_float32(network, *, trt, io: UNetIO) -> int:
    """Weak typing (TensorRT 10.0-10.11): run every layer that depends only on the timestep input in
    float32 (with OBEY_PRECISION_CONSTRAINTS set); returns how many were pinned."""
    layers = []
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        inputs = [layer.get_input(i) for i in range(layer.num_inputs)]
        outputs = [layer.get_output(i) for i in range(layer.num_outputs)]
        layers.append(([t.name for t in inputs if t is not None], [t.name for t in outputs if t is not None]))
    time_input = io.inputs[1].name  # t (B,)
    pinned = time_embedding_layers(layers, network_inputs=tuple(io.input_names), time_input=time_input)
    for index in pinned:
        layer = network.get_layer(index)
        layer.precision = trt.float32
        for i in range(layer.num_outputs):
            if layer.get_output(i).dtype in (trt.float16, trt.bfloat16, trt.float32):
                layer.set_output_type(i, trt.float32)
    return len(pinned)


class Engine:
    """One TensorRT engine, for the U-Net (``io`` a UNetIO) or a latent model's decoder (a DecoderIO):
    ``build`` (from ONNX) -> ``load`` -> ``activate`` -> ``allocate_buffers`` -> ``infer``. Needs a
    CUDA device; TensorRT 10.x API."""

    def __init__(self, cuda_engine, *, trt, runtime, io: IOSpec, batch: BatchRange, device: torch.device) -> None:
        self._trt, self._runtime, self.engine = trt, runtime, cuda_engine  # the runtime outlives its engine
        self.io, self.batch, self.device = io, batch, device
        found = {}
        for index in range(cuda_engine.num_io_tensors):
            name = cuda_engine.get_tensor_name(index)
            mode = "input" if cuda_engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "output"
            found[name] = (mode, torch_dtype(cuda_engine.get_tensor_dtype(name)))
        problems = io_mismatches(io, found)
        if problems:
            raise ValueError("the engine's inputs and outputs differ from its spec: " + "; ".join(problems))
        self.context = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.batch_size: int | None = None

    @staticmethod
    def build(
        onnx_path: Path,
        *,
        io: IOSpec,
        batch: BatchRange,
        plan: BuildPlan,
        optimization_level: int,
        timing_cache: bytes | None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> tuple[bytes, bytes]:
        """Build a serialized engine from an ONNX file as ``plan`` says; returns (engine, updated timing cache)."""
        trt = import_tensorrt()
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        # Explicit batch is implied since 10.0. Strongly typed (10.12+, and always in 11): every layer
        # runs in the dtype the graph gives it, so the graph carries the precision.
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if plan.strongly_typed else 0
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ValueError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
        config.builder_optimization_level = optimization_level
        for name in plan.builder_flags:  # weak typing only (TensorRT 10.0-10.11)
            config.set_flag(getattr(trt.BuilderFlag, name))
        if plan.pin_time_embedding and isinstance(io, UNetIO):  # a decoder has no time embedding
            pin_layers_to_float32(network, trt=trt, io=io)
        if plan.graph_precision == "fp32" and not plan.builder_flags and hasattr(trt.BuilderFlag, "TF32"):
            config.clear_flag(trt.BuilderFlag.TF32)  # TF32 is on by default; fp32 means fp32, as in PyTorch here
        # One optimization profile: every input's (min, opt, max) shape from the spec.
        profile = builder.create_optimization_profile()
        for name, (smallest, opt, largest) in io.profile(batch).items():
            profile.set_shape(name, smallest, opt, largest)
        config.add_optimization_profile(profile)
        # The timing cache remembers measured tactics, so rebuilds (other precision, profile) go faster.
        cache = config.create_timing_cache(timing_cache or b"")
        if not config.set_timing_cache(cache, ignore_mismatch=False):
            config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)  # stale: start afresh
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RuntimeError("TensorRT could not build the engine; its log above says why")
        return bytes(serialized), bytes(config.get_timing_cache().serialize())

    @classmethod
    def load(cls, data: bytes, *, io: IOSpec, batch: BatchRange, device: torch.device) -> Engine:
        """Deserialize an engine whose bytes the caller has verified (see :func:`verified_bytes`)."""
        trt = import_tensorrt()
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        if hasattr(runtime, "engine_host_code_allowed"):  # TensorRT >= 10: say it, though False is the default
            runtime.engine_host_code_allowed = False  # an engine with host code (a program on the CPU) is refused
        with torch.cuda.device(device):
            cuda_engine = runtime.deserialize_cuda_engine(data)
        if cuda_engine is None:
            raise ValueError("TensorRT could not deserialize the engine (another TensorRT version or GPU?); rebuild it")
        return cls(cuda_engine, trt=trt, runtime=runtime, io=io, batch=batch, device=device)

    def activate(self) -> None:
        """Create the execution context (TensorRT allocates the engine's scratch memory here)."""
        with torch.cuda.device(self.device):
            self.context = self.engine.create_execution_context()
        if self.context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of GPU memory?)")

    def allocate_buffers(self, batch_size: int) -> None:
        """Fix the input shapes at ``batch_size`` and bind one torch buffer per I/O tensor."""
        if batch_size not in self.batch:
            raise ValueError(
                f"this engine takes batches of {self.batch.min} to {self.batch.max}, not {batch_size}; "
                "rebuild it with a larger --max_batch"
            )
        if self.context is None:
            self.activate()
        shapes = self.io.shapes(batch_size)
        for spec in self.io.inputs:
            if not self.context.set_input_shape(spec.name, shapes[spec.name]):
                raise RuntimeError(f"TensorRT refused the shape {shapes[spec.name]} for {spec.name}")
        self.buffers = {}
        for spec in self.io.tensors:
            if tuple(self.context.get_tensor_shape(spec.name)) != shapes[spec.name]:
                raise RuntimeError(f"{spec.name}: TensorRT infers {tuple(self.context.get_tensor_shape(spec.name))}")
            buffer = torch.empty(shapes[spec.name], dtype=spec.dtype, device=self.device)
            self.context.set_tensor_address(spec.name, buffer.data_ptr())
            self.buffers[spec.name] = buffer
        self.batch_size = batch_size

    def infer(self, feed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the engine on PyTorch's current stream; returns the output buffers by name.

        Inputs are copied into the bound buffers, so the addresses TensorRT sees never change and
        the call can be captured in a CUDA graph. The returned tensors ARE the engine's buffers:
        the next call overwrites them (clone what you keep). Allocates only when the batch changes.
        """
        batch_size = feed[self.io.inputs[0].name].shape[0]
        if batch_size != self.batch_size:
            self.allocate_buffers(batch_size)
        stream = torch.cuda.current_stream(self.device)  # PyTorch's stream: ordered with the ops around it
        for spec in self.io.inputs:
            self.buffers[spec.name].copy_(
                feed[spec.name]
            )  # x_t (B, C, H, W), t (B,) or latents: device copies on `stream`
        # execute_async_v3 reads the addresses bound by set_tensor_address.
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT could not enqueue the engine")
        return {spec.name: self.buffers[spec.name] for spec in self.io.outputs}


class TensorRTUNet(nn.Module):
    """eps = unet(x_t, t[, y]) through an :class:`Engine`: the PyTorch U-Net's call, for the sampling loops."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        feed = {"x_t": x_t, "t": t} if y is None else {"x_t": x_t, "t": t, "y": y}  # y: a conditional engine's labels
        eps = self.engine.infer(feed)["eps"]  # (B, C, H, W) float32, the engine's buffer
        return eps.clone()  # the next call overwrites the buffer


class TensorRTDecoder(nn.Module):
    """images = decoder(latents) through an :class:`Engine` of a latent model's decoder (DecoderIO)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        images = self.engine.infer({"latents": z})["images"]  # (B, C, H, W) float32, the engine's buffer
        return images.clone()


def cached_onnx(model: UNet, *, cache_dir: Path, opset: int, precision: str = "fp32", log: Log) -> Path:
    """The U-Net as an ONNX file in ``cache_dir`` (mixed precision for fp16/bf16), exported again
    when the weights or settings change."""
    io = UNetIO.from_config(model.config)
    # An intermediate file, not an artifact to sample from: no schedule, weights known by hash only.
    metadata = artifact_metadata(model_config=model.config, schedule_config=None, weights=None)
    return _cached_graph(
        cache_dir / f"unet_{precision}.onnx",
        model=model,
        io=io,
        opset=opset,
        precision=precision,
        log=log,
        what="the U-Net",
        export=lambda cpu_model: export_onnx_model(cpu_model, metadata=metadata, opset=opset, precision=precision),
    )


def cached_decoder_onnx(
    decoder: torch.nn.Module, *, io: DecoderIO, cache_dir: Path, opset: int, precision: str = "fp32", log: Log
) -> Path:
    """A latent model's decoder (autoencoder.LatentDecoder) as an ONNX file in ``cache_dir``, like
    :func:`cached_onnx`; its latent scale is part of the key (it is not a weight)."""
    return _cached_graph(
        cache_dir / f"decoder_{precision}.onnx",
        model=decoder,
        io=io,
        opset=opset,
        precision=precision,
        log=log,
        what="the decoder",
        extra={"latent_scale": float(decoder.latent_scale)},
        export=lambda cpu_model: export_decoder_onnx(cpu_model, io=io, opset=opset, precision=precision),
    )


def _cached_graph(
    onnx_path: Path,
    *,
    model: torch.nn.Module,
    io: IOSpec,
    opset: int,
    precision: str,
    log: Log,
    what: str,
    export: Callable[[torch.nn.Module], object],
    extra: Mapping | None = None,
) -> Path:
    """``onnx_path``, exported again (``export(cpu copy of model)`` -> an onnx.ModelProto) unless its
    metadata file says it holds these weights, settings and I/O spec and its sha256 matches."""
    key = {
        "precision": precision,
        "metadata_version": METADATA_VERSION,
        "weights_sha256": weights_sha256(model),
        "opset": opset,
        "torch_version": torch.__version__,
        "io": io.to_dict(),
        **(extra or {}),
    }
    meta = read_metadata(metadata_path(onnx_path))
    if not key_mismatches(meta, key) and onnx_path.is_file() and meta.get("sha256") == sha256_file(onnx_path):
        return onnx_path
    log(f"exporting {what} to {onnx_path} ({precision}, opset {opset})")
    cpu_model = copy.deepcopy(model).cpu().eval()  # ONNX holds no device: export on the CPU
    store_with_metadata(onnx_path, export(cpu_model).SerializeToString(), key)
    return onnx_path


def engine_bytes_for(
    model: nn.Module, *, device: torch.device, precision: str, batch: BatchRange, options: TensorRTOptions, log: Log
) -> tuple[bytes, dict, UNetIO]:
    """A verified serialized engine for a PyTorch U-Net or an ONNX file's U-Net, from the cache or
    freshly built; with its cache key and I/O spec."""
    trt = import_tensorrt()
    plan = build_plan(trt.__version__, precision, opset=options.opset)
    if isinstance(model, FromOnnxFile) and model.onnx_path is not None:  # an exported .onnx file's U-Net
        onnx_path, io = model.onnx_path, model.io
        graph_precision = model.metadata.get("precision", "fp32")
        if plan.strongly_typed and graph_precision != precision:
            raise ValueError(
                f"{onnx_path} is a {graph_precision} graph and TensorRT {trt.__version__} builds graphs as they are "
                f"typed; export a {precision} graph (--mode export --format onnx --precision {precision}) or "
                "build from the checkpoint"
            )
    elif isinstance(model, UNet) and precision in QUANTIZED:
        raise ValueError(
            f"a {precision} engine is built from its Q/DQ graph: export it first (--mode export --format onnx "
            f"--precision {precision}), then pass that .onnx file"
        )
    elif isinstance(model, UNet):
        cache_dir = options.cache_dir or DEFAULT_CACHE_DIR
        onnx_path = cached_onnx(model, cache_dir=cache_dir, opset=plan.opset, precision=plan.graph_precision, log=log)
        io = UNetIO.from_config(model.config)
    else:
        raise ValueError("TensorRT engines are built from checkpoints and .onnx files; this model is neither")
    data, key = _engine_from_onnx(
        onnx_path,
        io=io,
        name="unet",
        trt=trt,
        plan=plan,
        device=device,
        precision=precision,
        batch=batch,
        options=options,
        log=log,
    )
    return data, key, io


def decoder_engine_bytes(
    stage: DecoderStage, *, device: torch.device, precision: str, batch: BatchRange, options: TensorRTOptions, log: Log
) -> tuple[bytes, dict]:
    """A verified serialized engine of a latent model's decoder, from the cache or freshly built: from
    the exported .decoder.onnx file of an ONNX model (typed like its U-Net's graph), else from the
    PyTorch decoder exported into the cache (mixed precision for fp16/bf16, as the U-Net)."""
    trt = import_tensorrt()
    plan = build_plan(trt.__version__, precision, opset=options.opset)
    if isinstance(stage.decoder, FromOnnxFile) and stage.decoder.onnx_path is not None:
        onnx_path = stage.decoder.onnx_path
    elif isinstance(stage.decoder, nn.Module) and next(stage.decoder.parameters(), None) is not None:
        cache_dir = options.cache_dir or DEFAULT_CACHE_DIR
        onnx_path = cached_decoder_onnx(
            stage.decoder, io=stage.io, cache_dir=cache_dir, opset=plan.opset, precision=plan.graph_precision, log=log
        )
    else:
        raise ValueError("TensorRT decoder engines are built from checkpoints and .onnx files; this decoder is neither")
    return _engine_from_onnx(
        onnx_path,
        io=stage.io,
        name="decoder",
        trt=trt,
        plan=plan,
        device=device,
        precision=precision,
        batch=batch,
        options=options,
        log=log,
    )


def _engine_from_onnx(
    onnx_path: Path,
    *,
    io: IOSpec,
    name: str,
    trt,
    plan: BuildPlan,
    device: torch.device,
    precision: str,
    batch: BatchRange,
    options: TensorRTOptions,
    log: Log,
) -> tuple[bytes, dict]:
    """The engine of ``onnx_path`` (spec ``io``) as ``plan`` says, cached as ``<name>_<precision>_max<B>.engine``
    in the cache folder under a key of everything it depends on; with that key."""
    cache_dir = options.cache_dir or DEFAULT_CACHE_DIR
    environment = runtime_environment(trt, device)
    key = engine_key(
        environment=environment,
        onnx_sha256=sha256_file(onnx_path),
        precision=precision,
        profile=io.profile(batch),
        optimization_level=options.optimization_level,
    ) | {"strongly_typed": plan.strongly_typed, "graph_precision": plan.graph_precision, "opset": plan.opset}
    timing_path = cache_dir / f"timing_sm{environment['compute_capability']}_trt{environment['tensorrt_version']}.cache"

    def build() -> bytes:
        log(
            f"building from {onnx_path}: {precision} ({'strongly typed' if plan.strongly_typed else 'weakly typed'}), "
            f"batch {batch.min}..{batch.max}, optimization level {options.optimization_level}"
        )
        timing = timing_path.read_bytes() if timing_path.is_file() else None
        data, timing = Engine.build(
            onnx_path,
            io=io,
            batch=batch,
            plan=plan,
            optimization_level=options.optimization_level,
            timing_cache=timing,
        )
        atomic_write(timing_path, lambda f: f.write(timing))
        return data

    # One cache file per profile size: runs whose batches differ do not rebuild each other's engines.
    data = get_or_build_engine(cache_dir / f"{name}_{precision}_max{batch.max}.engine", key=key, build=build, log=log)
    return data, key


def read_engine_metadata(path: Path) -> tuple[UNetConfig, ScheduleConfig, dict, BatchRange]:
    """The configs, metadata and batch range of an exported engine, from the metadata file beside it.

    Validated without TensorRT: the file's size and JSON depth (checkpoints.parse_json), the configs
    (parse_artifact_metadata), the metadata version (an int), the environment fields (short
    printable strings), the sha256 (64 hex digits) and the batch range (three ints, 1 <= min <= opt
    <= max); ValueError on one line otherwise.
    """
    meta_file = metadata_path(path)
    if not meta_file.exists():
        raise ValueError(
            f"{path} has no {meta_file.name} beside it; engines are loaded only with their metadata "
            "(configs and sha256): export one with --mode export --format tensorrt"
        )
    model_config, schedule_config, meta = parse_artifact_metadata(
        read_limited(meta_file, kind="metadata", inside=path.parent), source=meta_file
    )
    problems = [
        f"{field} {short_repr(meta.get(field))}"
        for field in ENVIRONMENT_FIELDS
        if not (isinstance(meta.get(field), str) and 0 < len(meta[field]) <= 100 and meta[field].isprintable())
    ]
    if type(meta.get("metadata_version")) is not int:
        problems.append(f"metadata_version {short_repr(meta.get('metadata_version'))}")
    digest = meta.get("sha256")
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        problems.append(f"sha256 {short_repr(digest)}")
    batch = meta.get("batch_range")
    if not (isinstance(batch, list) and len(batch) == 3 and all(type(b) is int for b in batch)):
        problems.append(f"batch_range {short_repr(batch)}")
    elif not 1 <= batch[0] <= batch[1] <= batch[2]:
        problems.append(f"batch_range {batch} (needs 1 <= min <= opt <= max)")
    if problems:
        raise ValueError(f"{meta_file} holds an invalid {'; '.join(problems)}; export the engine again")
    return model_config, schedule_config, meta, BatchRange(*batch)


def load_engine_artifact(path: Path, *, device: torch.device) -> tuple[TensorRTUNet, UNetConfig, ScheduleConfig, dict]:
    """An exported engine and the configs in its metadata file (:func:`read_engine_metadata`); the
    engine file is refused over its size limit (before it is read) and unless its sha256 matches."""
    trt = import_tensorrt()
    model_config, schedule_config, meta, batch = read_engine_metadata(path)
    check_file_size(path, kind="tensorrt")
    require_cuda(device)
    differences = key_mismatches(meta, {"metadata_version": METADATA_VERSION, **runtime_environment(trt, device)})
    if differences:
        raise ValueError(f"{path} was built for another setup ({'; '.join(differences)}); export it again here")
    data = verified_bytes(path, meta)
    engine = Engine.load(data, io=UNetIO.from_config(model_config), batch=batch, device=device)
    return TensorRTUNet(engine), model_config, schedule_config, meta


def export_engine(
    model: nn.Module,
    *,
    model_config: UNetConfig,
    schedule_config: ScheduleConfig,
    source: Path,
    output: str | Path,
    weights: str,
    device: torch.device,
    precision: str,
    options: TensorRTOptions,
    log: Log = print,
    class_names: tuple[str, ...] = (),
    first_stage: DecoderStage | None = None,
    decoder_output: Path | None = None,
    dataset: str | None = None,
) -> list[str]:
    """``--mode export --format tensorrt``: an engine for the U-Net of a checkpoint or ONNX file ``source``, plus
    its metadata file (with ``class_names`` and the training ``dataset``). A latent model's decoder
    (``first_stage``) gets its own engine at ``decoder_output``, named and hashed in the U-Net's metadata."""
    output = Path(output)
    if options.backend != "native":
        raise ValueError("--format tensorrt writes native engines; torch_tensorrt compiles when sampling")
    import_tensorrt()
    require_cuda(device)
    if first_stage is not None and decoder_output is None:
        raise ValueError("a latent model's engine export needs the decoder engine's path (decoder_output)")
    batch = BatchRange.covering(1, max_batch=options.max_batch)
    options = replace(options, cache_dir=options.cache_dir or cache_dir_for(source))
    data, key, io = engine_bytes_for(model, device=device, precision=precision, batch=batch, options=options, log=log)
    Engine.load(data, io=io, batch=batch, device=device)  # deserializes, and checks its I/O against the spec
    labels = {"class_names": list(class_names)} if class_names else {}
    if dataset is not None:  # the training data, for evaluate
        labels["dataset"] = dataset
    report = []
    if first_stage is not None:  # a latent model: the decoder's engine beside the U-Net's
        decoder_data, _ = decoder_engine_bytes(
            first_stage, device=device, precision=precision, batch=batch, options=options, log=log
        )
        Engine.load(decoder_data, io=first_stage.io, batch=batch, device=device)
        labels["decoder"] = {
            "file": decoder_output.name,
            "sha256": hashlib.sha256(decoder_data).hexdigest(),
            "latent_shape": list(first_stage.latent_shape),
            "image_shape": list(first_stage.image_shape),
        }
        atomic_write(decoder_output, lambda f: f.write(decoder_data))  # before the U-Net's files, which name it
        report.append(f"wrote {decoder_output} (the decoder's engine)")
    metadata = artifact_metadata(model_config=model_config, schedule_config=schedule_config, weights=weights, **labels)
    store_with_metadata(output, data, {**metadata, **key, "batch_range": batch.to_list()})
    return [
        f"wrote {output} and {metadata_path(output).name} (TensorRT {key['tensorrt_version']}, {precision}, "
        f"batch {batch.min}..{batch.max}, {key['gpu_name']})",
        *report,
    ]


# --------------------------------------------------------------------------------------------
# The tensorrt implementation
# --------------------------------------------------------------------------------------------


def tensorrt_decoder(
    stage: DecoderStage,
    *,
    device: torch.device,
    precision: str = "fp32",
    options: TensorRTOptions | None = None,
    log: Log = print,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The tensorrt implementation's decoder for a latent model: images = decode(latents) through a decoder
    engine. An exported engine (:class:`TensorRTDecoder`) is used as it is; otherwise the engine is built (or taken
    from the cache) here, before any sampling, for batches 1 .. ``max_batch``, and again for a larger batch."""
    if isinstance(stage.decoder, TensorRTDecoder):
        return stage.decoder
    options = options or TensorRTOptions()
    precision = (
        "fp32" if precision in QUANTIZED else precision
    )  # a quantized U-Net's decoder stays fp32 (once per image)
    import_tensorrt()
    require_cuda(device)
    engines: dict[BatchRange, TensorRTDecoder] = {}

    def engine_for(batch_size: int) -> TensorRTDecoder:
        batch = BatchRange.covering(batch_size, max_batch=options.max_batch)
        if batch not in engines:
            data, _ = decoder_engine_bytes(
                stage, device=device, precision=precision, batch=batch, options=options, log=log
            )
            engines[batch] = TensorRTDecoder(Engine.load(data, io=stage.io, batch=batch, device=device))
        return engines[batch]

    engine_for(1)  # the profile 1 .. max_batch: built now, so a build failure comes before any sampling

    def decode(z: torch.Tensor) -> torch.Tensor:
        return engine_for(z.shape[0])(z)  # (B, c, h, w) latents -> (B, C, H, W) images

    return decode


def fused_step_available(device: torch.device) -> bool:
    """Whether the diffusion_kernels extension is built (no JIT here), with CUDA kernels on a GPU."""
    from ddpm.kernels import ops

    try:
        ops.load_extension(allow_jit=False)
    except ops.ExtensionUnavailableError:
        return False
    return device.type != "cuda" or ops.has_cuda_kernels()


def make_sampler(
    unet: nn.Module,
    plan: SamplingPlan,
    *,
    shape: tuple[int, int, int, int],
    use_cuda_graph: bool = True,
    guidance: Guidance | None = None,
) -> FusedSampler:
    """optimized_diffusion's graphed sampler around ``unet``: with the fused step when the extension
    is built, else with noise_schedule.p_step."""
    import optimized_diffusion

    # precision "fp32": no autocast around the engine (its precision was fixed when it was built)
    # and no TF32 for the few PyTorch ops.
    return optimized_diffusion.FusedSampler(
        unet,
        plan,
        shape=shape,
        precision="fp32",
        use_cuda_graph=use_cuda_graph,
        fused_step=fused_step_available(plan.coefficients.device),
        guidance=guidance,
    )


def compile_torch_tensorrt(model: UNet, *, batch: BatchRange, precision: str, optimization_level: int) -> nn.Module:
    """``--trt_backend torch_tensorrt``: the U-Net compiled by torch_tensorrt's dynamo frontend."""
    torch_tensorrt = import_torch_tensorrt()
    io = UNetIO.from_config(model.config)
    profile = io.profile(batch)
    inputs = [
        torch_tensorrt.Input(
            min_shape=profile[s.name][0], opt_shape=profile[s.name][1], max_shape=profile[s.name][2], dtype=s.dtype
        )
        for s in io.inputs
    ]
    mixed, arguments = torch_tensorrt_arguments(torch_tensorrt.__version__, precision)
    if mixed:  # the precision is in the model: explicit casts, the time embedding kept in fp32
        from ddpm.util.precision import mixed_precision_unet

        model = mixed_precision_unet(model, precision)
    return torch_tensorrt.compile(
        model.eval(), ir="dynamo", inputs=inputs, optimization_level=optimization_level, **arguments
    )


def tensorrt_sampler(
    model: nn.Module,
    plan: SamplingPlan,
    *,
    shape: tuple[int, int, int, int],
    precision: str = "fp32",
    options: TensorRTOptions | None = None,
    log: Log = print,
    guidance: Guidance | None = None,
) -> FusedSampler:
    """A reusable "tensorrt" sampler: ``sampler(generator=g)`` draws images (B, C, H, W) in [-1, 1]
    (a class-conditional engine's: ``sampler(generator=g, guidance=...)``, the U-Net batch doubled when guided).

    ``model`` is a PyTorch U-Net, an onnxruntime U-Net loaded from an .onnx file (the engine is built
    from that file) or a :class:`TensorRTUNet` of an exported engine (used as it is, whatever
    ``precision`` says). The engine is built or loaded, and the graph captured, once, here.
    """
    options = options or TensorRTOptions()
    device = plan.coefficients.device
    batch = BatchRange.covering(unet_batch(shape[0], guidance), max_batch=options.max_batch)
    if options.backend == "torch_tensorrt":
        import_torch_tensorrt()
        require_cuda(device)
        if not isinstance(model, UNet):
            raise ValueError("--trt_backend torch_tensorrt compiles PyTorch U-Nets: sample from a checkpoint (.pt)")
        unet = compile_torch_tensorrt(
            model, batch=batch, precision=precision, optimization_level=options.optimization_level
        )
        # No outer CUDA graph: torch_tensorrt's runtime checks shapes on the host on every call
        # (it has its own graph mode, torch_tensorrt.runtime.enable_cudagraphs).
        return make_sampler(unet, plan, shape=shape, use_cuda_graph=False, guidance=guidance)
    import_tensorrt()
    require_cuda(device)
    if not isinstance(model, TensorRTUNet):
        data, _, io = engine_bytes_for(model, device=device, precision=precision, batch=batch, options=options, log=log)
        model = TensorRTUNet(Engine.load(data, io=io, batch=batch, device=device))
    return make_sampler(model, plan, shape=shape, guidance=guidance)


def sample(
    model: nn.Module,
    plan: SamplingPlan,
    *,
    shape: tuple[int, int, int, int],
    generator: torch.Generator,
    precision: str = "fp32",
    options: TensorRTOptions | None = None,
    log: Log = print,
    progress: bool = False,
) -> torch.Tensor:
    """The "tensorrt" implementation: :func:`basic_diffusion.sample` with the U-Net run by TensorRT.

    Same generator use as the original; see :func:`tensorrt_sampler` for ``model`` and the options.
    """
    sampler = tensorrt_sampler(model, plan, shape=shape, precision=precision, options=options, log=log)
    return sampler(generator=generator, progress=progress)
