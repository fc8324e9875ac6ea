"""Every file a PyTorch U-Net is rebuilt from, read as a checkpoint's state: a checkpoint (.pt), a
``--format safetensors`` export, or a Hugging Face diffusers model folder (which is also written here;
formats/diffusers_io.py maps its configs and weight names, formats/safetensors_io.py reads and writes the files).

    model, schedule_config, class_names, link, dataset = load_model_parts("ddpm-cifar10-32")

To the implementations these are all "checkpoint" kinds (torch_files.artifact_kind): whatever the file, sampling,
evaluation, export, benchmarks and fine-tuning (``--init_from``) get the same parts, validated the same
way (formats/checkpoints.model_parts). A safetensors export's or diffusers folder's state has step 0,
the same tensors as model and EMA weights, and ``source_format`` saying which it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from basic_diffusion import UNet
from ddpm.formats.checkpoints import FORMAT_VERSION, load_checkpoint, model_parts, parse_artifact_metadata
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
from ddpm.formats.safetensors_io import METADATA_KEY, read_safetensors, safetensors_bytes
from ddpm.formats.torch_files import load_pt, weight_mismatches
from ddpm.util.model_folders import marker_bytes
from ddpm.util.safe_files import atomic_write, read_limited
from noise_schedule import ScheduleConfig


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
