"""Artifacts: loading any file a U-Net lives in to sample, evaluate, export, benchmark or fine-tune from: a
checkpoint (.pt), a ``--format safetensors`` export or a Hugging Face diffusers model folder (all "checkpoint"
kinds, rebuilt as a PyTorch U-Net: :func:`load_model_parts`), TorchScript (.ts), ONNX (.onnx) or a TensorRT engine
(.engine/.plan) (:func:`load_artifact`). Writing them is modes/export.py's (the diffusers folder is written here);
which file is which, formats/torch_files.py's.

    python main.py --mode sample --model_path checkpoints/mnist.onnx --implementation onnxruntime
    model, schedule_config, class_names, link, dataset = load_model_parts("ddpm-cifar10-32")

``--mode sample --model_path FILE`` needs nothing else: each file carries its configs (unet_io.py); a latent
model's export also needs the decoder file it names beside it (``X.decoder.onnx``/``.ts``/``.engine``). Whatever the
checkpoint kind, every mode gets the same parts, validated the same way (formats/checkpoints.model_parts); a
safetensors export's or diffusers folder's state has step 0, the same tensors as model and EMA weights, and
``source_format`` saying which it was (formats/diffusers_io.py maps diffusers' configs and weight names,
formats/safetensors_io.py reads and writes the files); tensorrt_integration.py is imported only for engines."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from basic_diffusion import UNet, UNetConfig
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
from ddpm.formats.checkpoints import (
    FORMAT_VERSION,
    check_pixel_unet,
    load_checkpoint,
    model_parts,
    parse_artifact_metadata,
)
from ddpm.formats.diffusers_io import (
    DIFFUSERS_VERSION,
    SCHEDULER_FILE,
    WEIGHTS_FILES,
    diffusers_folder_files,
    diffusers_scheduler_config,
    diffusers_unet_config,
    from_diffusers_weights,
    json_bytes,
    present,
    read_json,
    schedule_config_from_diffusers,
    to_diffusers_weights,
    unet_config_from_diffusers,
    unet_folder,
)
from ddpm.formats.engine_cache import metadata_path
from ddpm.formats.exporters import _quiet_torchscript
from ddpm.formats.safetensors_io import METADATA_KEY, read_safetensors, safetensors_bytes
from ddpm.formats.torch_files import KIND_NAMES, artifact_kind, check_zip, load_pt, weight_mismatches
from ddpm.formats.unet_io import DEFAULT_MAX_BATCH, BatchRange
from ddpm.latent.autoencoder import FirstStage, check_latent_unet, linked_first_stage
from ddpm.util.messages import first_line
from ddpm.util.model_folders import marker_bytes
from ddpm.util.safe_files import atomic_write, read_limited
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


def load_model_parts(path: str | Path, *, weights: str = "ema", device: torch.device | str = "cpu"):
    """checkpoints.load_checkpoint_parts for any of this module's files: (U-Net in eval mode, schedule config,
    class names, autoencoder link, training dataset)."""
    return model_parts(load_model_state(path), path=path, weights=weights, device=device)


def load_model_state(path: str | Path) -> dict:
    """The checkpoint's state of ``path``: a diffusers folder, a safetensors export, or a checkpoint."""
    path = Path(path)
    if path.is_dir():
        return read_diffusers_folder(path)
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise ValueError(f"{path} does not exist or is not a file")
        return read_safetensors_export(path)
    return load_checkpoint(path)


def read_safetensors_export(path: Path) -> dict:
    """A ``--format safetensors`` export (formats/safetensors_io.py): its metadata through
    checkpoints.parse_artifact_metadata, its tensors exactly its config's."""
    tensors, metadata = read_safetensors(path, source=str(path))
    if METADATA_KEY not in metadata:
        raise ValueError(
            f"{path} carries no model metadata; a diffusers model's safetensors file is read from its folder "
            "(--model_path FOLDER)"
        )
    model_config, schedule_config, meta = parse_artifact_metadata(metadata[METADATA_KEY], source=path)
    with torch.device("meta"):
        expected = UNet(model_config).state_dict()
    problems = weight_mismatches(expected, tensors)
    if problems:
        raise ValueError(f"{path}: its weights do not match its model config ({'; '.join(problems)})")
    state = {
        "format_version": FORMAT_VERSION,
        "model_config": model_config.to_dict(),
        "schedule_config": asdict(schedule_config),
        "model": tensors,
        "ema": tensors,
        "step": 0,
        "source_format": "safetensors",
        "weights_kind": meta["weights"],
    }
    if "class_names" in meta:
        state["class_names"] = meta["class_names"]
    if "dataset" in meta:
        state["train_config"] = {"dataset": meta["dataset"]}
    return state


def read_diffusers_folder(folder: str | Path) -> dict:
    """A diffusers model folder as a checkpoint's state (formats/checkpoints.py's REQUIRED_KEYS, step 0,
    the same weights as model and EMA); ValueError naming the file for anything unusable. Every file is read
    only from inside ``folder`` (safe_files.check_inside): a symlink out of it, a FIFO or a device is refused."""
    folder = Path(folder)
    unet = unet_folder(folder)
    config_file = unet / "config.json"
    model_config = unet_config_from_diffusers(
        read_json(config_file, what="the U-Net's config", folder=folder), source=str(config_file)
    )
    tensors, source = _folder_weights(folder, unet)
    weights = from_diffusers_weights(tensors, model_config, source=source)
    return {
        "format_version": FORMAT_VERSION,
        "model_config": model_config.to_dict(),
        "schedule_config": asdict(_folder_schedule(folder, unet)),
        "model": weights,
        "ema": weights,
        "step": 0,
        "source_format": "diffusers",
    }


def _folder_schedule(folder: Path, unet: Path) -> ScheduleConfig:
    """A pipeline's scheduler config, or for a UNet2DModel alone DDPMScheduler's defaults (linear, 1e-4 to
    0.02, T = 1000)."""
    if unet == folder:
        return ScheduleConfig()
    scheduler = folder / "scheduler" / SCHEDULER_FILE
    if not present(scheduler):
        raise ValueError(f"{folder}: a pipeline folder without scheduler/{SCHEDULER_FILE}")
    return schedule_config_from_diffusers(
        read_json(scheduler, what="the scheduler's config", folder=folder), source=str(scheduler)
    )


def _folder_weights(folder: Path, unet: Path) -> tuple[dict, str]:
    """The U-Net's tensors of a diffusers folder and the file they came from (for messages)."""
    if any(present(unet / f"{name}.index.json") for name in WEIGHTS_FILES):
        raise ValueError(f"{unet}: sharded weights are not read; save the model with a larger max_shard_size")
    weights_file = next((unet / name for name in WEIGHTS_FILES if present(unet / name)), None)
    if weights_file is None:
        raise ValueError(f"{unet}: no {' or '.join(WEIGHTS_FILES)}")
    source = str(weights_file)
    if weights_file.suffix == ".safetensors":
        tensors, _ = read_safetensors(weights_file, source=source, inside=folder)
        return tensors, source
    data = read_limited(weights_file, kind="checkpoint", inside=folder)
    tensors = load_pt(data, source=source, kind="a weights file")
    if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
        raise ValueError(f"{weights_file} is not a state dict of named tensors")
    return tensors, source


def write_diffusers_folder(model: UNet, schedule: ScheduleConfig, output: Path, *, source: str) -> list[Path]:
    """A folder ``DDPMPipeline.from_pretrained`` loads: each file written atomically, then the export's marker
    recording what each holds (util/model_folders.marker_bytes: a folder without it is no export of this tool's).
    Returns the files written."""
    unet_config = diffusers_unet_config(model.config, source=source)
    scheduler_config = diffusers_scheduler_config(schedule, source=source)
    weights = to_diffusers_weights(model.state_dict())
    index = {
        "_class_name": "DDPMPipeline",
        "_diffusers_version": DIFFUSERS_VERSION,
        "scheduler": ["diffusers", "DDPMScheduler"],
        "unet": ["diffusers", "UNet2DModel"],
    }
    files = diffusers_folder_files(output)
    contents: list[tuple[Path, Callable[[], bytes]]] = [
        (files["--output's unet weights"], lambda: safetensors_bytes(weights, {"format": "pt"})),
        (files["--output's unet config"], lambda: json_bytes(unet_config)),
        (files["--output's scheduler config"], lambda: json_bytes(scheduler_config)),
        (files["--output's model_index.json"], lambda: json_bytes(index)),
        (files["--output's export marker"], lambda: marker_bytes(output, names, writer="--format diffusers")),
    ]
    names = [path.relative_to(output).as_posix() for path, _ in contents]
    for path, make in contents:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = make()
        atomic_write(path, lambda f, data=data: f.write(data))
    return [path for path, _ in contents]
