"""Artifacts: the files a U-Net lives in (checkpoint, TorchScript, ONNX, TensorRT engine), loading any
of them to sample, and the export mode that writes one from a checkpoint.

    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime
    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt

``--mode sample --model_path FILE`` takes a checkpoint (.pt), TorchScript (.ts), ONNX (.onnx) or an
engine (.engine/.plan) and needs nothing else: each carries its configs (unet_io.py); a latent
model's export also needs the decoder file it names beside it (``X.decoder.onnx``/``.ts``/``.engine``). This module
sits above export.py, runtimes.py and tensorrt_integration.py (imported only for engines), so none
of them imports another's caller.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from basic_diffusion import UNetConfig
from checkpoints import check_pixel_unet, first_line, load_checkpoint_parts, read_limited
from export import (
    _quiet_torchscript,
    default_opset,
    export_decoder_onnx,
    export_onnx_model,
    import_onnx,
    save_torchscript,
    trace_decoder,
    trace_torchscript,
)
from noise_schedule import ScheduleConfig, short_repr
from runtimes import (
    OnnxRuntimeDecoder,
    OnnxRuntimeUNet,
    _ort_reason,
    import_onnxruntime,
    load_onnx,
    load_torchscript,
    onnxruntime_session,
)
from data import DATASETS
from latents import FirstStage, check_latent_unet, linked_first_stage
from safe_files import atomic_write, check_target
from unet_io import BatchRange, UNetIO, artifact_metadata, max_abs_diff

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
    first_stage: FirstStage | None = None  # a latent model: the autoencoder that decodes its samples
    dataset: str | None = None  # the training data, where the file records it (evaluate's judge)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """One sample's shape as written: the decoded image's for a latent model, else the U-Net's."""
        return self.first_stage.image_shape if self.first_stage is not None else self.model_config.sample_shape(1)[1:]


def artifact_kind(path: str | Path) -> str:
    kind = ARTIFACT_KINDS.get(Path(path).suffix)
    if kind is None:
        raise ValueError(f"--model_path {path}: expected a file ending in {', '.join(ARTIFACT_KINDS)}")
    return kind


def load_artifact(
    path: str | Path, *, device: torch.device, weights: str = "ema", trust_torchscript: bool = False,
    autoencoder: str | None = None,
) -> Artifact:
    """Load a checkpoint or an exported U-Net by its suffix, with the configs stored in or beside it.

    Everything is validated first (see the module docstring); a TorchScript file is refused unless
    ``trust_torchscript``, before anything reads it. A latent model's checkpoint brings its autoencoder
    (from the path it names, or ``autoencoder``), checked against the sha256 it stored.
    """
    path, kind = Path(path), artifact_kind(path)
    if kind == "checkpoint":
        model, schedule_config, class_names, link, dataset = load_checkpoint_parts(path, weights=weights, device=device)
        stage, _ = linked_first_stage(
            link, model_config=model.config, source=f"checkpoint {path}", device=device, override=autoencoder
        )
        return Artifact(kind, path, model, model.config, schedule_config, class_names, stage, dataset)
    if autoencoder:
        raise ValueError(f"--autoencoder goes with a latent model's .pt checkpoint, not a {KIND_NAMES[kind]} file")
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
    stage = None
    if "decoder" in meta:  # a latent model: its decoder file beside it, checked against the hash it names
        stage = load_exported_decoder(
            meta["decoder"], path=path, kind=kind, model_config=model_config, device=device, batch_range=meta.get("batch_range")
        )
    else:
        check_pixel_unet(model_config, source=str(path))
    class_names = ()
    if model_config.num_classes:
        from conditioning import read_class_names

        class_names = read_class_names(meta, num_classes=model_config.num_classes, source=str(path))
    dataset = meta.get("dataset")  # recorded by exports since 2026-11-24; absent from older files
    if dataset is not None and dataset not in DATASETS:
        raise ValueError(f"{path} names an unknown training dataset {short_repr(dataset)}; export it again")
    return Artifact(kind, path, model, model_config, schedule_config, class_names, stage, dataset)


def decoder_path(unet_path: Path) -> Path:
    """Where a latent model's exported decoder lives: beside its U-Net, ``X.onnx`` -> ``X.decoder.onnx``."""
    return unet_path.with_name(f"{unet_path.stem}.decoder{unet_path.suffix}")


def load_exported_decoder(
    entry: object, *, path: Path, kind: str, model_config: UNetConfig, device: torch.device, batch_range: list | None = None
) -> FirstStage:
    """The decoder an exported latent U-Net names in its metadata, read only if its sha256 is the one named
    (an engine's is deserialized for its U-Net engine's ``batch_range``, validated with that engine's metadata)."""
    def shape_ok(v: object, channels: range) -> bool:  # (C, S, S): a 2-D image's or latent's
        return isinstance(v, list) and len(v) == 3 and all(type(n) is int for n in v) and v[0] in channels and v[1] == v[2] and 1 <= v[1] <= 1024

    if not (
        isinstance(entry, dict) and set(entry) == {"file", "sha256", "latent_shape", "image_shape"}
        and entry["file"] == decoder_path(path).name and isinstance(entry["sha256"], str)
        and shape_ok(entry["latent_shape"], range(1, 65)) and shape_ok(entry["image_shape"], range(1, 4, 2))
    ):  # fmt: skip
        raise ValueError(f"{path} has unusable decoder metadata ({short_repr(entry)}); export it again")
    stage = FirstStage(None, tuple(entry["latent_shape"]), tuple(entry["image_shape"]), link={})
    check_latent_unet(model_config, stage, source=str(path))
    file = decoder_path(path)
    if not file.is_file():
        raise ValueError(f"{path} is a latent model whose decoder {file} is missing; export it again")
    data = read_limited(file, kind=kind)
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"{file} is not the decoder {path} was exported with (its sha256 differs); export it again")
    if kind == "onnx":
        session = onnxruntime_session(data, device=device, source=file)
        decoder = OnnxRuntimeDecoder(session, image_shape=stage.image_shape, path=file)
    elif kind == "tensorrt":  # built with the U-Net's engine, for the same GPU and TensorRT (checked on its load)
        import tensorrt_integration

        engine = tensorrt_integration.Engine.load(data, io=stage.io, batch=BatchRange(*batch_range), device=device)
        decoder = tensorrt_integration.TensorRTDecoder(engine)
    else:  # TorchScript: trusted with the U-Net (load_torchscript refused it otherwise)
        try:
            with _quiet_torchscript():
                decoder = torch.jit.load(io.BytesIO(data), map_location=device).eval()
        except Exception as exc:  # as load_torchscript: broken archives, the file's own code
            raise ValueError(f"{file} is corrupt or not a TorchScript file ({first_line(exc)})") from exc
    return replace(stage, decoder=decoder)


def checked_decoder_target(output: Path, *, source: Path) -> Path:
    """Where a latent model's exported decoder goes (:func:`decoder_path`), refused as an output may be."""
    file = decoder_path(output)
    check_target(file, flag="--output's decoder")
    if file.resolve() == source.resolve():
        raise ValueError(f"the decoder {file} would overwrite the source {source}")
    return file


def export_decoder(
    stage: FirstStage, *, fmt: str, source: Path, output: Path, device: torch.device, opset: int, precision: str = "fp32"
) -> tuple[dict, str, Callable[[], None]]:
    """A latent model's decoder exported for beside its U-Net (ONNX in ``precision`` too) and checked
    against PyTorch; returns (the metadata entry naming it, a report line, write(): the file written,
    atomically, just before the U-Net)."""
    file = checked_decoder_target(output, source=source)
    decoder = stage.decoder.to(device).eval()
    reference, compared = decoder, "against PyTorch"
    if fmt == "onnx":
        data = export_decoder_onnx(decoder, io=stage.io, opset=opset, precision=precision).SerializeToString()
        if precision != "fp32":
            from precision import mixed_precision_decoder

            reference, compared = mixed_precision_decoder(decoder, precision), f"against PyTorch's {precision} decoder"
        try:
            runner = OnnxRuntimeDecoder(onnxruntime_session(data, device=device), image_shape=stage.image_shape)
        except ValueError as exc:
            if precision == "fp32":
                raise
            # as for the U-Net: onnxruntime's CPU provider lacks some low-precision kernels
            runner, reference = reference, decoder
            compared = f"onnxruntime here cannot run it ({_ort_reason(exc)}); PyTorch's {precision} decoder against fp32"
    else:
        buffer = io.BytesIO()
        traced = trace_decoder(decoder, latent_shape=stage.latent_shape)
        with _quiet_torchscript():  # torch.jit.save's deprecation warning
            torch.jit.save(traced, buffer)
        data, runner = buffer.getvalue(), traced
    z = torch.randn(3, *stage.latent_shape, generator=torch.Generator().manual_seed(1)).to(device)  # another batch size
    with torch.no_grad():
        diff = (runner(z) - reference(z)).abs().max().item()
    entry = {"file": file.name, "sha256": hashlib.sha256(data).hexdigest(),
             "latent_shape": list(stage.latent_shape), "image_shape": list(stage.image_shape)}  # fmt: skip
    line = f"wrote {file} (the decoder; {compared}: max abs diff {diff:.3e})"
    return entry, line, lambda: atomic_write(file, lambda f: f.write(data))


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
    autoencoder: str | None = None,
) -> list[str]:
    """Export a checkpoint's U-Net to ONNX or TorchScript, check it against PyTorch; returns report lines.
    A latent model's decoder is exported beside it (:func:`export_decoder`).

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
    model, schedule_config, class_names, link, dataset = load_checkpoint_parts(source, weights=weights, device=device)
    labels = {"class_names": list(class_names)} if class_names else {}  # a conditional U-Net's classes travel along
    if dataset is not None:  # evaluate judges the file as its training data without --dataset
        labels["dataset"] = dataset
    report = []
    if link is not None:  # a latent model: its decoder goes beside the U-Net, named (and hashed) in its metadata
        stage, _ = linked_first_stage(link, model_config=model.config, source=f"checkpoint {source}", device=device, override=autoencoder)
        entry, line, write_decoder = export_decoder(
            stage, fmt=fmt, source=source, output=output, device=device, opset=opset, precision=precision
        )
        labels["decoder"] = entry
        report.append(line)
    else:
        write_decoder = lambda: None  # noqa: E731  (a pixel model has none)
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
        write_decoder()
        atomic_write(output, lambda f: f.write(data))
        diff = max_abs_diff(runtime, reference, io=io, batch_sizes=batch_sizes)
    else:
        metadata = artifact_metadata(
            model_config=model.config, schedule_config=schedule_config, weights=weights, traced_on=device.type, **labels
        )
        module = trace_torchscript(model)
        write_decoder()
        save_torchscript(module, output, metadata=metadata)
        loaded, *_ = load_torchscript(output, device=device, trusted=True)  # the file traced just now
        diff = max_abs_diff(loaded, model, io=io, batch_sizes=batch_sizes)
        checked = f"traced on {device.type}"
        compared = f"TorchScript vs PyTorch ({weights} weights)"
    sizes = ", ".join(map(str, batch_sizes))
    return [f"wrote {output} ({checked})", f"{compared}: max abs diff {diff:.3e} at batch sizes {sizes}", *report]


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
    autoencoder: str | None = None,
) -> list[str]:
    """``--mode export``: ONNX or TorchScript from a checkpoint (:func:`export_checkpoint`), or a TensorRT
    engine from a checkpoint or ONNX file (tensorrt_integration.export_engine); returns report lines."""
    if fmt != "tensorrt":
        return export_checkpoint(
            source, fmt=fmt, output=output, weights=weights, device=device, opset=opset, precision=precision,
            autoencoder=autoencoder,
        )  # fmt: skip
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
    artifact = load_artifact(source, device=torch.device("cpu"), weights=weights, autoencoder=autoencoder)
    decoder_output = None
    if artifact.first_stage is not None:  # a latent model: the decoder's engine goes beside the U-Net's
        decoder_output = checked_decoder_target(output, source=source)
    return tensorrt_integration.export_engine(
        artifact.model,
        model_config=artifact.model_config,
        schedule_config=artifact.schedule_config,
        source=source,
        output=output, weights=weights, device=device, precision=precision, options=options,
        class_names=artifact.class_names, first_stage=artifact.first_stage, decoder_output=decoder_output,
        dataset=artifact.dataset,
    )
