"""Artifacts: loading any file a U-Net lives in (checkpoint, TorchScript, ONNX, TensorRT engine) to sample
(writing them is modes/export.py's; which file is which, formats/torch_files.py's).

    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime

``--mode sample --model_path FILE`` takes a checkpoint (.pt), TorchScript (.ts), ONNX (.onnx) or an
engine (.engine/.plan) and needs nothing else: each carries its configs (unet_io.py); a latent
model's export also needs the decoder file it names beside it (``X.decoder.onnx``/``.ts``/``.engine``). This module
sits above formats/exporters.py, backends/runtimes.py and tensorrt_integration.py (imported only for engines), so none
of them imports another's caller.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from basic_diffusion import UNetConfig
from ddpm.backends.runtimes import (
    OnnxRuntimeDecoder,
    check_onnx_graph,
    decoder_memory_cap,
    load_onnx,
    load_torchscript,
    onnxruntime_session,
    parse_onnx,
)
from ddpm.data.catalog import DATASETS
from ddpm.formats.checkpoints import check_pixel_unet
from ddpm.formats.engine_cache import metadata_path
from ddpm.formats.exporters import (
    _quiet_torchscript,
)
from ddpm.formats.model_files import load_model_parts
from ddpm.formats.torch_files import KIND_NAMES, artifact_kind, check_zip
from ddpm.formats.unet_io import DEFAULT_MAX_BATCH, BatchRange
from ddpm.latent.first_stage import FirstStage, check_latent_unet, linked_first_stage
from ddpm.util.messages import first_line
from ddpm.util.safe_files import read_limited
from noise_schedule import ScheduleConfig, short_repr

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
    also_read: tuple[tuple[str, Path], ...] = ()  # the files it named, read with it: (what, path)

    @property
    def inputs(self) -> dict[str, Path]:
        """Every file this model was read from, for the output check: the file and those it names (a
        latent model's autoencoder or exported decoder, an engine's metadata)."""
        return {"--model_path": self.path, **dict(self.also_read)}

    @property
    def output_shape(self) -> tuple[int, ...]:
        """One sample's shape as written: the decoded image's for a latent model, else the U-Net's."""
        return self.first_stage.image_shape if self.first_stage is not None else self.model_config.sample_shape(1)[1:]


def load_artifact(
    path: str | Path,
    *,
    device: torch.device,
    weights: str = "ema",
    trust_torchscript: bool = False,
    autoencoder: str | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> Artifact:
    """Load a checkpoint or an exported U-Net by its suffix, with the configs stored in or beside it.

    Everything is validated first (see the module docstring); a TorchScript file is refused unless
    ``trust_torchscript``, before anything reads it. A latent model's checkpoint brings its autoencoder
    (from the path it names, or ``autoencoder``), checked against the sha256 it stored. An ONNX file's
    sessions may allocate what batches of up to ``max_batch`` need (runtimes.unet_memory_cap).
    """
    path, kind = Path(path), artifact_kind(path)
    if kind == "checkpoint":
        model, schedule_config, class_names, link, dataset = load_model_parts(path, weights=weights, device=device)
        stage, _ = linked_first_stage(
            link,
            model_config=model.config,
            source=f"checkpoint {path}",
            device=device,
            override=autoencoder,
            folder=path.parent,
        )
        read = (("its autoencoder", Path(stage.link["path"])),) if stage is not None else ()
        return Artifact(kind, path, model, model.config, schedule_config, class_names, stage, dataset, read)
    if autoencoder:
        raise ValueError(f"--autoencoder goes with a latent model's .pt checkpoint, not a {KIND_NAMES[kind]} file")
    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file")
    if kind == "torchscript":  # refused before it is read unless trusted
        model, model_config, schedule_config, meta = load_torchscript(path, device=device, trusted=trust_torchscript)
    elif kind == "onnx":
        model, model_config, schedule_config, meta = load_onnx(path, device=device, max_batch=max_batch)
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
            meta["decoder"],
            path=path,
            kind=kind,
            model_config=model_config,
            device=device,
            batch_range=meta.get("batch_range"),
            max_batch=max_batch,
        )
    else:
        check_pixel_unet(model_config, source=str(path))
    class_names = ()
    if model_config.num_classes:
        from ddpm.conditioning import read_class_names

        class_names = read_class_names(meta, num_classes=model_config.num_classes, source=str(path))
    dataset = meta.get("dataset")  # absent from files exported before exports recorded it
    if dataset is not None and dataset not in DATASETS:
        raise ValueError(f"{path} names an unknown training dataset {short_repr(dataset)}; export it again")
    read = [("its metadata", metadata_path(path))] if kind == "tensorrt" else []
    if stage is not None:
        read.append(("its decoder", decoder_path(path)))
    return Artifact(kind, path, model, model_config, schedule_config, class_names, stage, dataset, tuple(read))


def decoder_path(unet_path: Path) -> Path:
    """Where a latent model's exported decoder lives: beside its U-Net, ``X.onnx`` -> ``X.decoder.onnx``."""
    return unet_path.with_name(f"{unet_path.stem}.decoder{unet_path.suffix}")


def load_exported_decoder(
    entry: object,
    *,
    path: Path,
    kind: str,
    model_config: UNetConfig,
    device: torch.device,
    batch_range: list | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> FirstStage:
    """The decoder an exported latent U-Net names in its metadata, read only if its sha256 is the one named
    (an engine's is deserialized for its U-Net engine's ``batch_range``, validated with that engine's metadata)."""

    def shape_ok(v: object, channels: range) -> bool:  # (C, S, S): a 2-D image's or latent's
        return (
            isinstance(v, list)
            and len(v) == 3
            and all(type(n) is int for n in v)
            and v[0] in channels
            and v[1] == v[2]
            and 1 <= v[1] <= 1024
        )

    if not (
        isinstance(entry, dict)
        and set(entry) == {"file", "sha256", "latent_shape", "image_shape"}
        and entry["file"] == decoder_path(path).name
        and isinstance(entry["sha256"], str)
        and shape_ok(entry["latent_shape"], range(1, 65))
        and shape_ok(entry["image_shape"], range(1, 4, 2))
    ):
        raise ValueError(f"{path} has unusable decoder metadata ({short_repr(entry)}); export it again")
    stage = FirstStage(None, tuple(entry["latent_shape"]), tuple(entry["image_shape"]), link={})
    check_latent_unet(model_config, stage, source=str(path))
    file = decoder_path(path)
    if not file.is_file():
        raise ValueError(f"{path} is a latent model whose decoder {file} is missing; export it again")
    data = read_limited(file, kind=kind, inside=path.parent)  # a side file: never followed elsewhere
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"{file} is not the decoder {path} was exported with (its sha256 differs); export it again")
    if kind == "onnx":  # through the U-Net graph's checks: the same parser, domains, opsets, I/O spec, checker
        check_onnx_graph(parse_onnx(data, source=file), io=stage.io, source=file)
        cap = decoder_memory_cap(stage.image_shape, max_batch=max_batch, file_bytes=len(data))
        session = onnxruntime_session(data, device=device, source=file, memory_cap=cap)
        decoder = OnnxRuntimeDecoder(session, image_shape=stage.image_shape, path=file)
    elif kind == "tensorrt":  # built with the U-Net's engine, for the same GPU and TensorRT (checked on its load)
        import tensorrt_integration

        engine = tensorrt_integration.Engine.load(data, io=stage.io, batch=BatchRange(*batch_range), device=device)
        decoder = tensorrt_integration.TensorRTDecoder(engine)
    else:  # TorchScript: trusted with the U-Net (load_torchscript refused it otherwise)
        check_zip(data, source=str(file), what="a TorchScript file")
        try:
            with _quiet_torchscript():
                decoder = torch.jit.load(io.BytesIO(data), map_location=device).eval()
        except Exception as exc:  # as load_torchscript: broken archives, the file's own code
            raise ValueError(f"{file} is corrupt or not a TorchScript file ({first_line(exc)})") from exc
    return replace(stage, decoder=decoder)
