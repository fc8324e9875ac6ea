"""Writing exported U-Nets: ONNX (torch.onnx's dynamo exporter) and TorchScript (tracing).

    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt          # -> checkpoints/mnist.onnx
    python main.py --mode export --format torchscript --model_path checkpoints/mnist.pt   # -> checkpoints/mnist.ts

Both take the U-Net's interface from unet_io.py and write its metadata into the file. The export
mode itself (load, write, check against PyTorch) is ``modes/export.export_checkpoint``; running the
files is backends/runtimes.py. onnx and onnxscript (the exporter's backend) are optional; they are imported
when used.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from basic_diffusion import UNet
from ddpm.formats.unet_io import BATCH, DEFAULT_OPSET, METADATA_KEY, DecoderIO, IOSpec, UNetIO, check_opset
from ddpm.util.messages import first_line
from ddpm.util.safe_files import atomic_write
from noise_schedule import short_repr

ONNX_INSTALL = "pip install onnx onnxscript onnxruntime"


# --------------------------------------------------------------------------------------------
# ONNX
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


def export_onnx_model(model: UNet, *, metadata: dict, opset: int = DEFAULT_OPSET, precision: str = "fp32"):
    """Export an eval-mode U-Net to a checked ``onnx.ModelProto`` with a dynamic batch and ``metadata``.

    ``precision`` "fp16" or "bf16" writes a mixed-precision graph (precision.mixed_precision_unet:
    convolutions and matmuls in the low precision, the time embedding, normalization and softmax
    in float32, float32 inputs and output), the form strongly typed TensorRT builds.
    """
    check_opset(opset, precision=precision)
    io = UNetIO.from_config(model.config)
    if precision != "fp32":
        from ddpm.util.precision import mixed_precision_unet

        model = mixed_precision_unet(model, precision)
    example = io.example_inputs(2, device=next(model.parameters()).device)  # B = 2: see export_checked_onnx
    return export_checked_onnx(
        model, io=io, example=example, opset=opset, metadata={**metadata, "precision": precision}
    )


def export_decoder_onnx(
    decoder: torch.nn.Module, *, io: DecoderIO, opset: int = DEFAULT_OPSET, precision: str = "fp32"
):
    """A latent model's decoder (latent/autoencoder.py) as a checked ``onnx.ModelProto`` by its spec ``io``: "latents"
    (B, c, h, w) in, "images" (B, C, H, W) out, with a dynamic batch. ``precision`` fp16/bf16 writes the
    mixed-precision decoder (precision.mixed_precision_decoder), float32 in and out, as for the U-Net."""
    check_opset(opset, precision=precision)
    if precision != "fp32":
        from ddpm.util.precision import mixed_precision_decoder

        decoder = mixed_precision_decoder(decoder, precision)
    example = (torch.randn(2, *io.latent_shape, device=next(decoder.parameters()).device),)  # (B, c, h, w) latents
    return export_checked_onnx(decoder, io=io, example=example, opset=opset)


def export_checked_onnx(
    module: torch.nn.Module, *, io: IOSpec, example: tuple, opset: int, metadata: dict | None = None
):
    """The one ONNX export every graph of this tool goes through (the U-Net's, a decoder's): torch.onnx's dynamo
    exporter with ``io``'s names and dynamic batch, the graph's inputs and outputs held to ``io``, ``metadata``
    (if any) written into it, then ``onnx.checker``'s full check. ``example``'s batch is 2: torch.export
    specializes sizes 0 and 1."""
    onnx = import_onnx()
    with warnings.catch_warnings():
        # The U-Net's x_t and t share one batch Dim; the exporter notes that it keeps one of the two names.
        warnings.filterwarnings("ignore", message=r".*axis name: .* will not be used")
        program = torch.onnx.export(
            module.eval(),
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
        raise RuntimeError(f"the exported graph does not match its I/O spec ({'; '.join(problems)})")
    if metadata is not None:
        entry = proto.metadata_props.add()
        entry.key, entry.value = METADATA_KEY, json.dumps(metadata, sort_keys=True)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def onnx_io_mismatches(proto, io: IOSpec) -> list[str]:
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


def trace_decoder(decoder: torch.nn.Module, *, latent_shape: Sequence[int]) -> torch.jit.ScriptModule:
    """Trace a latent model's decoder (latent/autoencoder.py) on its own device; the trace keeps a dynamic batch."""
    example = torch.randn(2, *latent_shape, device=next(decoder.parameters()).device)
    with torch.no_grad(), _quiet_torchscript():
        return torch.jit.trace(decoder.eval(), (example,), check_trace=False)


def save_torchscript(module: torch.jit.ScriptModule, path: str | Path, *, metadata: dict) -> Path:
    extra = {TORCHSCRIPT_EXTRA_FILE: json.dumps(metadata, sort_keys=True)}
    with _quiet_torchscript():
        return atomic_write(path, lambda f: torch.jit.save(module, f, _extra_files=extra))
