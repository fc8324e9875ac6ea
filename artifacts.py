"""Artifacts: the files a U-Net lives in (checkpoint, TorchScript, ONNX, TensorRT engine), loading any
of them to sample, and the export mode that writes one from a checkpoint.

    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime
    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt

``--mode sample --model_path FILE`` takes a checkpoint (.pt), TorchScript (.ts), ONNX (.onnx) or an
engine (.engine/.plan) and needs nothing else: each carries its configs (unet_io.py). This module
sits above export.py, runtimes.py and tensorrt_integration.py (imported only for engines), so none
of them imports another's caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from basic_diffusion import UNetConfig
from checkpoints import load_checkpoint_parts
from export import (
    default_opset,
    export_onnx_model,
    import_onnx,
    save_torchscript,
    trace_torchscript,
)
from noise_schedule import ScheduleConfig
from runtimes import (
    OnnxRuntimeUNet,
    _ort_reason,
    import_onnxruntime,
    load_onnx,
    load_torchscript,
    onnxruntime_session,
)
from safe_files import atomic_write, check_target
from unet_io import UNetIO, artifact_metadata, max_abs_diff

FORMATS = ("onnx", "torchscript", "tensorrt")
FORMAT_SUFFIXES = {"onnx": (".onnx",), "torchscript": (".ts",), "tensorrt": (".engine", ".plan")}
ARTIFACT_KINDS = {
    ".pt": "checkpoint",
    ".ts": "torchscript",
    ".onnx": "onnx",
    ".engine": "tensorrt",
    ".plan": "tensorrt",
}
KIND_NAMES = {"checkpoint": "checkpoint", "torchscript": "TorchScript", "onnx": "ONNX", "tensorrt": "TensorRT engine"}


# --------------------------------------------------------------------------------------------
# Loading any artifact
# --------------------------------------------------------------------------------------------


@dataclass
class Artifact:
    """A U-Net ready to sample (``eps = model(x_t, t)``) and the configs that go with it."""

    kind: str  # one of ARTIFACT_KINDS's values
    path: Path
    model: nn.Module
    model_config: UNetConfig
    schedule_config: ScheduleConfig
    class_names: tuple[str, ...] = ()  # a class-conditional model's classes (label i is class_names[i])


def artifact_kind(path: str | Path) -> str:
    kind = ARTIFACT_KINDS.get(Path(path).suffix)
    if kind is None:
        raise ValueError(f"--model_path {path}: expected a file ending in {', '.join(ARTIFACT_KINDS)}")
    return kind


def load_artifact(
    path: str | Path, *, device: torch.device, weights: str = "ema", trust_torchscript: bool = False
) -> Artifact:
    """Load a checkpoint or an exported U-Net by its suffix, with the configs stored in or beside it.

    Everything is validated first (see the module docstring); a TorchScript file is refused unless
    ``trust_torchscript``, before anything reads it.
    """
    path, kind = Path(path), artifact_kind(path)
    if kind == "checkpoint":
        model, schedule_config, class_names = load_checkpoint_parts(path, weights=weights, device=device)
        return Artifact(kind, path, model, model.config, schedule_config, class_names)
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
    class_names = ()
    if model_config.num_classes:
        from conditioning import read_class_names

        class_names = read_class_names(meta, num_classes=model_config.num_classes, source=str(path))
    return Artifact(kind, path, model, model_config, schedule_config, class_names)


# --------------------------------------------------------------------------------------------
# Exporting a checkpoint
# --------------------------------------------------------------------------------------------


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
    model, schedule_config, class_names = load_checkpoint_parts(source, weights=weights, device=device)
    labels = {"class_names": list(class_names)} if class_names else {}  # a conditional U-Net's classes travel along
    io = UNetIO.from_config(model.config)  # with the label input y for a conditional U-Net
    batch_sizes = (1, 3, 8)
    if fmt == "onnx":
        metadata = artifact_metadata(
            model_config=model.config, schedule_config=schedule_config, weights=weights, opset=opset, **labels
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
            model_config=model.config, schedule_config=schedule_config, weights=weights, traced_on=device.type, **labels
        )
        module = trace_torchscript(model)
        save_torchscript(module, output, metadata=metadata)
        loaded, *_ = load_torchscript(output, device=device, trusted=True)  # the file traced just now
        diff = max_abs_diff(loaded, model, io=io, batch_sizes=batch_sizes)
        checked = f"traced on {device.type}"
        compared = f"TorchScript vs PyTorch ({weights} weights)"
    sizes = ", ".join(map(str, batch_sizes))
    return [f"wrote {output} ({checked})", f"{compared}: max abs diff {diff:.3e} at batch sizes {sizes}"]


def export_artifact(
    source: str | Path,
    *,
    fmt: str,
    output: str | Path,
    weights: str,
    device: torch.device,
    precision: str = "fp32",
    opset: int | None = None,
    tensorrt_options=None,
) -> list[str]:
    """``--mode export``: ONNX or TorchScript from a checkpoint (:func:`export_checkpoint`), or a TensorRT
    engine from a checkpoint or ONNX file (tensorrt_integration.export_engine); returns report lines."""
    if fmt != "tensorrt":
        return export_checkpoint(
            source, fmt=fmt, output=output, weights=weights, device=device, opset=opset, precision=precision
        )
    import tensorrt_integration

    source, output = Path(source), Path(output)
    check_export_paths(source, output, "tensorrt")
    options = tensorrt_options or tensorrt_integration.TensorRTOptions(opset=opset)
    if options.backend != "native":
        raise ValueError("--format tensorrt writes native engines; torch_tensorrt compiles when sampling")
    tensorrt_integration.import_tensorrt()  # before anything is loaded: TensorRT and a GPU are needed
    tensorrt_integration.require_cuda(device)
    if artifact_kind(source) not in ("checkpoint", "onnx"):
        raise ValueError(f"engines are built from a checkpoint (.pt) or an ONNX file (.onnx), not {source}")
    artifact = load_artifact(source, device=torch.device("cpu"), weights=weights)
    return tensorrt_integration.export_engine(
        artifact.model,
        model_config=artifact.model_config,
        schedule_config=artifact.schedule_config,
        source=source,
        output=output, weights=weights, device=device, precision=precision, options=options,
        class_names=artifact.class_names,
    )
