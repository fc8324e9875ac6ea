"""Running exported U-Nets: ONNX files through onnxruntime, TorchScript files through torch.jit.

    model, model_config, schedule_config, meta = load_onnx(Path("checkpoints/mnist.onnx"), device=device)
    eps = model(x_t, t)   # the PyTorch U-Net's call: any sampling loop takes it

Artifacts are validated at load, not trusted; every failure is a one-line ValueError naming the file.
Each file is refused before it is read when larger than ``MAX_FILE_BYTES`` allows, and
its configs go through ``UNetConfig.from_dict`` / ``ScheduleConfig.from_dict``. A TorchScript file is
a program (loading it runs its ``__setstate__``, calling it runs its code): it is loaded only with
``trusted=True`` (``--trust_torchscript``), its metadata is read and checked first, and an error
from its code is reported in one line. An ONNX file is checked before onnxruntime sees it
(:func:`load_onnx`): parsed from its bytes, no external data, the opset within
``MIN_OPSET..MAX_OPSET``, its metadata, its graph's inputs and outputs against the metadata's I/O
spec, ``onnx.checker``; the session is then made from the same bytes.

onnxruntime is optional; it is imported when used.
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from torch import nn

from basic_diffusion import UNet, UNetConfig
from ddpm.formats.checkpoints import parse_artifact_metadata
from ddpm.formats.exporters import (
    TORCHSCRIPT_EXTRA_FILE,
    _onnx_tensors,
    _quiet_torchscript,
    export_onnx_model,
    import_onnx,
    onnx_io_mismatches,
)
from ddpm.formats.torch_files import check_zip
from ddpm.formats.unet_io import (
    DEFAULT_MAX_BATCH,
    DEFAULT_OPSET,
    MAX_OPSET,
    METADATA_KEY,
    MIN_OPSET,
    DecoderIO,
    IOSpec,
    UNetIO,
    artifact_metadata,
)
from ddpm.util.messages import first_line, format_bytes
from ddpm.util.safe_files import MAX_FILE_BYTES, read_limited
from noise_schedule import ScheduleConfig, short_repr

ORT_INSTALL = "pip install onnxruntime (or onnxruntime-gpu for the CUDA and TensorRT execution providers)"


# --------------------------------------------------------------------------------------------
# onnxruntime
# --------------------------------------------------------------------------------------------


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(f"onnxruntime is not installed ({first_line(exc)}); install it: {ORT_INSTALL}") from exc
    return onnxruntime


def onnxruntime_providers(
    available: Sequence[str], *, device_type: str, trt_cache_dir: Path | None = None, memory_cap: int | None = None
) -> list:
    """Execution providers in order of preference: on a GPU, TensorRT's and CUDA's when installed
    (onnxruntime-gpu), then the CPU. TensorRT's builds its own engine, so it gets an engine cache;
    CUDA's arena stops at ``memory_cap`` bytes when one is given (the CPU's: :func:`onnxruntime_session`)."""
    providers: list = []
    if device_type == "cuda":
        if "TensorrtExecutionProvider" in available and trt_cache_dir is not None:
            options = {"trt_engine_cache_enable": True, "trt_engine_cache_path": str(trt_cache_dir)}
            providers.append(("TensorrtExecutionProvider", options))
        if "CUDAExecutionProvider" in available:
            options = {"use_tf32": "0"}  # true fp32, like the original row
            if memory_cap is not None:
                options["gpu_mem_limit"] = str(memory_cap)
            providers.append(("CUDAExecutionProvider", options))
    providers.append("CPUExecutionProvider")
    return providers


class OnnxRuntimeUNet(nn.Module):
    """eps = unet(x_t, t) through an onnxruntime session: the PyTorch U-Net's call, for the sampling loops.

    Inputs and output are bound to torch tensors (onnxruntime's I/O binding): with the CUDA
    execution provider (onnxruntime-gpu) and tensors on the GPU, x_t, t and eps stay on the GPU
    between steps; with the CPU provider, onnxruntime reads and writes the tensors' memory
    directly, without NumPy copies. ``onnx_path`` is the ONNX file when the session came from one
    (unet_io.FromOnnxFile: the tensorrt implementation builds its engine from it).
    """

    def __init__(self, session, *, io: UNetIO, path: Path | None = None, metadata: dict | None = None) -> None:
        super().__init__()
        self.session, self.io, self.onnx_path = session, io, path
        self.metadata = metadata or {}  # the file's artifact metadata ("precision": the graph's, fp32 if absent)
        self.provider = session.get_providers()[0]  # the execution provider onnxruntime runs first

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if (y is None) != (self.io.num_classes == 0):
            raise ValueError(
                "this U-Net is class-conditional: pass labels y" if y is None else "this U-Net takes no labels"
            )
        caller = x_t.device  # eps goes back there
        on_gpu = self.provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider") and x_t.is_cuda
        device = caller if on_gpu else torch.device("cpu")
        x_t = x_t.detach().to(device, torch.float32).contiguous()  # (B, C, H, W); to the host with the CPU provider
        t = t.detach().to(device, torch.int64).contiguous()  # (B,)
        inputs = (x_t, t) if y is None else (x_t, t, y.detach().to(device, torch.int64).contiguous())  # y: (B,)
        eps = torch.empty(self.io.shapes(x_t.shape[0])[self.io.output_names[0]], dtype=torch.float32, device=device)
        run_bound(
            self.session,
            dict(zip(self.io.input_names, inputs, strict=True)),
            {self.io.output_names[0]: eps},
            path=self.onnx_path,
        )
        return eps.to(caller)  # (B, C, H, W) float32


_NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64}


def run_bound(
    session, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], *, path: Path | None = None
) -> None:
    """Run ``session`` reading ``inputs`` and writing ``outputs`` in place (contiguous tensors, all on the
    CPU or all on one GPU): onnxruntime's I/O binding, no copies through NumPy."""
    device = next(iter(outputs.values())).device
    binding = session.io_binding()
    kind, index = ("cuda", device.index or 0) if device.type == "cuda" else ("cpu", 0)
    for name, tensor in inputs.items():
        binding.bind_input(name, kind, index, _NUMPY_DTYPES[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
    for name, tensor in outputs.items():
        binding.bind_output(name, kind, index, _NUMPY_DTYPES[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())
    if kind == "cuda":
        torch.cuda.current_stream(device).synchronize()  # sync: onnxruntime runs on its own stream
    try:
        session.run_with_iobinding(binding)
    except Exception as exc:  # onnxruntime's own classes; a file's graph can fail at run time
        if path is None:
            raise  # an in-memory export failing is a bug, not a user's error
        if "Available memory of" in str(exc) or "Failed to allocate memory" in str(exc):  # the arena's cap
            raise ValueError(f"{path} tried to allocate far more memory than its model needs; it is not run") from exc
        raise ValueError(f"{path} failed when run ({first_line(exc)})") from exc


class OnnxRuntimeDecoder(nn.Module):
    """A latent model's decoder (latent/autoencoder.py) exported to ONNX in memory and run by onnxruntime:
    images (B, C, H, W) = decoder(latents (B, c, h, w)), on the latents' device where the provider allows."""

    def __init__(self, session, *, image_shape: tuple[int, ...], path: Path | None = None) -> None:
        super().__init__()
        self.session, self.image_shape, self.onnx_path = session, tuple(image_shape), path
        self.provider = self.session.get_providers()[0]

    @classmethod
    def exported(cls, decoder: nn.Module, *, io: DecoderIO, device: torch.device, opset: int) -> OnnxRuntimeDecoder:
        """``decoder`` exported to ONNX in memory by its spec ``io``, in a session."""
        from ddpm.formats.exporters import export_decoder_onnx

        proto = export_decoder_onnx(decoder, io=io, opset=opset)
        return cls(onnxruntime_session(proto.SerializeToString(), device=device), image_shape=io.image_shape)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        on_gpu = self.provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider") and z.is_cuda
        device = z.device if on_gpu else torch.device("cpu")
        z_in = z.detach().to(device, torch.float32).contiguous()
        images = torch.empty((z.shape[0], *self.image_shape), dtype=torch.float32, device=device)
        run_bound(self.session, {"latents": z_in}, {"images": images}, path=self.onnx_path)
        return images.to(z.device)


def _ort_reason(exc: Exception) -> str:
    """The short reason inside onnxruntime's message ("Could not find an implementation for Conv(22) ...")."""
    text = first_line(exc)
    return text.rsplit(" : ", 1)[-1].rstrip(")")[:100]


# onnxruntime 1.31's QDQPropagationTransformer, moving a DequantizeLinear past a Reshape in the INT8 graphs
# (formats/quantization.py: symmetric int8 activations, as TensorRT needs), writes a QuantizeLinear whose
# output_dtype is INT8 with a UINT8 zero point, and the session fails to load ("TypeInferenceError"). The pass
# only moves Q/DQ pairs, so the QLinearConv fusions are the same without it.
DISABLED_ORT_OPTIMIZERS = ["QDQPropagationTransformer"]


def onnxruntime_session(
    model: bytes | Path,
    *,
    device: torch.device,
    trt_cache_dir: Path | None = None,
    source: Path | None = None,
    memory_cap: int | None = None,
    precision: str | None = None,
):
    """An onnxruntime session for an ONNX file or serialized model; ValueError if it is not valid ONNX, or (saying
    so, naming ``precision``: the graph's, from its metadata) if this onnxruntime has no kernel for one of its nodes.

    Files are validated by :func:`load_onnx` first, which passes their checked bytes, ``source`` and a
    ``memory_cap``: the bytes the session's tensors may take (CPU arena and CUDA arena alike), so that a
    graph computing its shapes at run time (which :func:`check_bounded_work` cannot bound) fails in one
    line instead of taking the machine's memory. The tool's own in-memory exports run without a cap.
    """
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 4  # nothing printed: every error is raised, and reported in one line
    options.intra_op_num_threads = torch.get_num_threads()  # as many threads as PyTorch uses
    # No spin-waiting between runs: PyTorch's threads run the sampler's step between two U-Net calls, and spinning
    # threads would take their cores (BENCHMARKS.md, "INT8 Q/DQ U-Nets run by onnxruntime").
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if memory_cap is not None:
        # A CPU arena of memory_cap bytes, shared with the environment and taken by this session when it
        # is created (a later registration replaces it for later sessions only).
        cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(memory_cap, -1, -1, -1))
        options.add_session_config_entry("session.use_env_allocators", "1")
    providers = onnxruntime_providers(
        ort.get_available_providers(), device_type=device.type, trt_cache_dir=trt_cache_dir, memory_cap=memory_cap
    )
    try:
        return ort.InferenceSession(
            model if isinstance(model, bytes) else str(model),
            sess_options=options,
            providers=providers,
            disabled_optimizers=DISABLED_ORT_OPTIMIZERS,
        )
    except Exception as exc:  # onnxruntime raises its own classes (InvalidProtobuf, InvalidGraph, Fail, ...)
        name = source or ("the exported model" if isinstance(model, bytes) else model)
        missing = missing_kernel_line(str(exc), name=name, precision=precision, device=device)
        if missing:
            raise ValueError(missing) from exc
        raise ValueError(f"{name} is corrupt or not an ONNX model onnxruntime can run ({first_line(exc)})") from exc


def missing_kernel_line(error: str, *, name, precision: str | None, device: torch.device) -> str | None:
    """The one line for onnxruntime's "Could not find an implementation for OP(opset) node" (a valid graph this
    build cannot run: its CPU provider has no bf16 convolution), or None for any other error."""
    found = re.search(r"Could not find an implementation for (\w+)\((\d+)\) node", error)
    if found is None:
        return None
    where = "GPU" if device.type == "cuda" else "CPU"
    if precision and precision != "fp32":
        return (
            f"{name} is a {precision} graph, and onnxruntime here has no {precision} {found[1]} kernel on the {where}, "
            f"so it cannot run it; sample the checkpoint it was exported from (--precision {precision} runs there), "
            "or export it with --precision fp32"
        )
    return (
        f"{name} is a valid graph, but onnxruntime here has no {where} kernel for its {found[1]} nodes (opset "
        f"{found[2]}), so it cannot run it; sample the checkpoint it was exported from, or export it again"
    )


def as_onnxruntime(
    model: nn.Module, *, device: torch.device, opset: int = DEFAULT_OPSET, calibration: Sequence[dict] | None = None
) -> OnnxRuntimeUNet:
    """An onnxruntime U-Net: ``model`` itself if it is one, else a U-Net exported to ONNX in memory (with
    ``calibration`` feeds: quantized to INT8 on them, formats/quantization.py)."""
    if isinstance(model, OnnxRuntimeUNet):
        return model
    if not isinstance(model, UNet):
        raise ValueError("onnxruntime runs checkpoints and .onnx files; this model is neither")
    metadata = artifact_metadata(model_config=model.config, schedule_config=None, weights=None)  # never saved
    proto = export_onnx_model(model, metadata=metadata, opset=opset)
    if calibration is not None:
        from ddpm.formats.quantization import quantize_unet

        proto = quantize_unet(proto, calibration)
    session = onnxruntime_session(proto.SerializeToString(), device=device)
    return OnnxRuntimeUNet(session, io=UNetIO.from_config(model.config))


def unet_memory_cap(model_config: UNetConfig, *, max_batch: int, file_bytes: int) -> int:
    """Bytes an ONNX U-Net file's session may allocate for batches up to ``max_batch``: its weights twice
    (the initializers and a packed copy) and batch_memory's generous bound on one sampling step of the
    tool's own U-Net of that config. Far beyond one batch is refused; the exporter's graphs need several times
    less (see BENCHMARKS.md, "The memory cap of imported ONNX files")."""
    from ddpm.batch_memory import upper_bound_bytes

    return 2 * file_bytes + upper_bound_bytes(model_config, batch_size=max_batch, training=False)


DECODER_BYTES_PER_PIXEL = 32 << 10  # per image position: 8 fp32 maps of 1,024 channels


def decoder_memory_cap(image_shape: Sequence[int], *, max_batch: int, file_bytes: int) -> int:
    """Bytes an exported decoder's session may allocate for batches up to ``max_batch`` (see :func:`unet_memory_cap`).
    The exporter's decoders need several times less (BENCHMARKS.md, "The memory cap of imported ONNX files")."""
    return 2 * file_bytes + max_batch * math.prod(image_shape[1:]) * DECODER_BYTES_PER_PIXEL


def load_onnx(
    path: Path, *, device: torch.device, max_batch: int = DEFAULT_MAX_BATCH
) -> tuple[OnnxRuntimeUNet, UNetConfig, ScheduleConfig, dict]:
    """An ONNX file validated before onnxruntime sees it, then run by onnxruntime from the same bytes,
    within the memory a batch of up to ``max_batch`` needs (:func:`unet_memory_cap`).

    In order: the size limit (before reading), the graph's own checks (:func:`parse_onnx`), the metadata
    (:func:`parse_artifact_metadata`), the graph against the metadata's I/O spec and ``onnx.checker``
    (:func:`check_onnx_graph`); only then the session.
    """
    data = read_limited(path, kind="onnx")
    proto = parse_onnx(data, source=path)
    entries = [entry.value for entry in proto.metadata_props if entry.key == METADATA_KEY]
    if len(entries) > 1:
        raise ValueError(f"{path} has {len(entries)} {METADATA_KEY!r} metadata entries; export it again")
    model_config, schedule_config, meta = parse_artifact_metadata(entries[0] if entries else None, source=path)
    io = UNetIO.from_config(model_config)
    check_onnx_graph(proto, io=io, source=path)
    trt_cache_dir = path.with_name(f"{path.stem}_ort_trt")
    cap = unet_memory_cap(model_config, max_batch=max_batch, file_bytes=len(data))
    session = onnxruntime_session(
        data, device=device, trt_cache_dir=trt_cache_dir, source=path, memory_cap=cap, precision=meta.get("precision")
    )
    return OnnxRuntimeUNet(session, io=io, path=path, metadata=meta), model_config, schedule_config, meta


def parse_onnx(data: bytes, *, source: Path):
    """The ONNX model in ``data`` (an onnx.ModelProto), refused in one line unless it is what this tool's
    exports are: bytes onnx parses, no external data (it would make onnxruntime read other files), the
    ONNX domain once at an opset within MIN_OPSET..MAX_OPSET and no other domain. Every exported graph,
    a U-Net's or a latent model's decoder's, passes here before onnxruntime sees it."""
    onnx = import_onnx(exporter=False)
    try:
        proto = onnx.load_model_from_string(data)
    except Exception as exc:  # google.protobuf's DecodeError, and whatever else a parser raises on junk
        raise ValueError(f"{source} is corrupt or not an ONNX model ({first_line(exc)})") from exc
    external = [tensor.name for tensor in _onnx_tensors(proto) if tensor.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ValueError(
            f"{source} keeps tensor {short_repr(external[0])} in an external file, which is not read; "
            "this tool's exports hold all their weights"
        )
    domains = [(o.domain, o.version) for o in proto.opset_import]
    opsets = [version for domain, version in domains if domain in ("", "ai.onnx")]
    if not opsets:
        raise ValueError(f"{source} is corrupt or not an ONNX model (it imports no ONNX opset)")
    others = sorted({domain for domain, _ in domains if domain not in ("", "ai.onnx")})
    if len(opsets) > 1 or others:
        found = ", ".join(short_repr(d) for d in others) or "the ONNX domain twice"
        raise ValueError(f"{source} imports {found}; this tool's exports use the ONNX domain once and nothing else")
    if not MIN_OPSET <= opsets[0] <= MAX_OPSET:
        raise ValueError(f"{source} uses ONNX opset {opsets[0]}; this tool runs opsets {MIN_OPSET} to {MAX_OPSET}")
    return proto


def check_onnx_graph(proto, *, io: IOSpec, source: Path) -> None:
    """The graph's inputs and outputs against the I/O spec it must have, :func:`check_bounded_work`, then
    ``onnx.checker`` (full check)."""
    onnx = import_onnx(exporter=False)
    problems = onnx_io_mismatches(proto, io)
    if problems:
        raise ValueError(f"{source}: its graph's inputs and outputs do not match its metadata ({'; '.join(problems)})")
    check_bounded_work(proto, source=source)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # onnx.checker.ValidationError, shape inference errors
        raise ValueError(f"{source} fails onnx.checker ({first_line(exc)})") from exc


# The op types this tool's exporter writes (torch 2.14.1's dynamo exporter, opsets 18-25, fp32/fp16/bf16
# graphs, 2-D and 3-D, conditional, patched and "add" U-Nets, latent decoders; kept by
# tests/backends/test_artifacts.py). None sizes its output from data: ConstantOfShape, Expand,
# Tile, Range, Pad, loops and the like are not among them, so an imported graph cannot allocate through them.
EXPORTED_OPS = frozenset(
    {
        "Add",
        "Attention",
        "Cast",
        "Clip",
        "Concat",
        "Conv",
        "Cos",
        "DequantizeLinear",
        "Gather",
        "Gemm",
        "GroupNormalization",
        "InstanceNormalization",
        "MatMul",
        "Mul",
        "QuantizeLinear",
        "Reshape",
        "Resize",
        "Shape",
        "Sigmoid",
        "Sin",
        "Slice",
        "Softmax",
        "Split",
        "Squeeze",
        "Transpose",
        "Unsqueeze",
    }
)
MAX_ELEMENTS_PER_SAMPLE = 1 << 24  # any tensor of known shape, per sample (64 MiB of fp32; ours: well under 1 MiB)


def check_bounded_work(proto, *, source: Path) -> None:
    """Refuse a graph that could allocate far beyond one batch before anything runs it: ops this tool's
    exports never contain, a Resize by more than 2x or to computed sizes, a convolution with strides,
    dilations or pads ours never use, a tensor whose known shape holds more than MAX_ELEMENTS_PER_SAMPLE
    per sample (the batch and other symbolic dims count once)."""
    from onnx import numpy_helper, shape_inference

    graph = proto.graph
    foreign = sorted({node.op_type for node in graph.node} - EXPORTED_OPS)
    if foreign:
        raise ValueError(
            f"{source} uses the ONNX op {short_repr(foreign[0])}, which this tool's exports never contain; it is not "
            "run"
        )
    constants = {tensor.name: tensor for tensor in graph.initializer}
    for node in graph.node:
        if node.op_type == "Resize":
            scales = node.input[2] if len(node.input) > 2 else ""
            sizes = node.input[3] if len(node.input) > 3 else ""
            if (
                sizes
                or scales not in constants
                or not all(0 < s <= 2 for s in numpy_helper.to_array(constants[scales]).ravel())
            ):
                raise ValueError(
                    f"{source} resizes {short_repr(node.name)} by computed or more than 2x scales; this tool's "
                    "exports upsample 2x"
                )
        elif node.op_type == "Conv":
            attributes = {a.name: list(a.ints) for a in node.attribute if a.name in ("pads", "strides", "dilations")}
            if (
                any(p > 3 for p in attributes.get("pads", []))
                or any(s > 2 for s in attributes.get("strides", []))
                or any(d != 1 for d in attributes.get("dilations", []))
            ):
                raise ValueError(
                    f"{source} has a convolution ({short_repr(node.name)}) with pads, strides or dilations this "
                    "tool's exports never use"
                )
    try:
        inferred = shape_inference.infer_shapes(proto).graph
    except Exception as exc:  # noqa: BLE001 -- onnx.checker passed; inference still raises on odd graphs
        raise ValueError(f"{source}: its shapes cannot be inferred ({first_line(exc)})") from exc
    for value in (*inferred.value_info, *inferred.output):
        shape = value.type.tensor_type.shape
        elements = math.prod(d.dim_value for d in shape.dim if d.HasField("dim_value"))
        if elements > MAX_ELEMENTS_PER_SAMPLE:
            raise ValueError(
                f"{source} makes a tensor ({short_repr(value.name)}) of {elements:,} elements per sample; this tool's "
                "exports "
                f"stay under {MAX_ELEMENTS_PER_SAMPLE:,}, so it is not run"
            )


# --------------------------------------------------------------------------------------------
# TorchScript
# --------------------------------------------------------------------------------------------


class TorchScriptUNet(nn.Module):
    """A loaded TorchScript U-Net whose errors (its own code's) end as one-line ValueErrors naming its file."""

    def __init__(self, module: torch.jit.ScriptModule, *, path: Path) -> None:
        super().__init__()
        self.module, self.path = module, path

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        try:
            return self.module(x_t, t) if y is None else self.module(x_t, t, y)
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

    The file is read within its size limit, its zip held to its directory and CRC-32s (torch_files.check_zip),
    and its metadata (the extra file, read from the zip without torch) checked before torch.jit.load runs anything.
    """
    if not trusted:
        raise ValueError(
            f"{path} is a TorchScript file: a program, not only weights, and loading it runs its code; "
            "pass --trust_torchscript if it comes from a source you trust"
        )
    data = read_limited(path, kind="torchscript")
    check_zip(data, source=str(path), what="a TorchScript file")  # no bomb, no flipped bit
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
    limit = MAX_FILE_BYTES["metadata"]
    too_large = False
    try:
        with zipfile.ZipFile(BytesIO(data)) as archive:
            name = f"extra/{TORCHSCRIPT_EXTRA_FILE}"  # under the archive's top folder
            members = [info for info in archive.infolist() if info.filename.split("/", 1)[-1] == name]
            if not members:
                return None
            too_large = members[0].file_size > limit
            if not too_large:
                with archive.open(members[0]) as f:
                    return f.read(limit + 1)
    except Exception as exc:  # zipfile's and zlib's errors, a member name that is not UTF-8, ...: the file's fault
        raise ValueError(f"{path} is corrupt or not a TorchScript file ({first_line(exc)})") from exc
    raise ValueError(f"{path}: its metadata is over the {format_bytes(limit)} limit")
