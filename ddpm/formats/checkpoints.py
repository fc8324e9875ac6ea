"""Checkpoints: the one file a training run writes, and reading it back safely.

A checkpoint is one file holding everything a run needs: the model and schedule configs, the
model and EMA weights, the optimizer, LR schedule and grad-scaler states, the step and the RNG
states. It is written atomically (safe_files.atomic_write), and it is read with
``torch.load(weights_only=True)`` (formats/torch_files.py), so loading one never runs code from it.

Everything read from a file is validated, not trusted; each failure is a one-line ValueError
naming the file (files are read within size limits by safe_files.read_limited). The shared pieces
live here (the artifact modules import them):

* :func:`read_configs`: the model and schedule configs, through ``UNetConfig.from_dict`` and
  ``ScheduleConfig.from_dict`` (known keys, types, ranges);
* :func:`load_checkpoint_model`: a checkpoint's U-Net, its EMA or raw weights, ready to sample.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from basic_diffusion import UNet, UNetConfig
from ddpm.choices import ALL_PRECISIONS
from ddpm.formats.torch_files import check_dense, load_pt, load_weights
from ddpm.formats.unet_io import ARTIFACT_FORMAT, UNetIO
from ddpm.util.messages import first_line
from ddpm.util.safe_files import atomic_write, parse_json, read_limited
from noise_schedule import ScheduleConfig, short_repr

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "model_config", "schedule_config", "model", "ema", "step")
MAX_STEP = 10**9  # the most optimizer steps a run may take (--max_steps) and a checkpoint may record

WEIGHTS = ("ema", "model")  # the checkpoint entry an artifact was exported from
LINK_KEY = (
    "autoencoder"  # a latent model's entry naming its autoencoder (latent/autoencoder.py): {"path": str, "sha256": hex}
)
MAX_PATH_CHARS = 4096
_SHA256 = re.compile(r"[0-9a-f]{64}")


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Atomically write ``state`` (see :data:`REQUIRED_KEYS`) to ``path``."""
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise KeyError(f"checkpoint state lacks {missing}")  # a programming error, not a user one
    return atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint this tool wrote; anything else is refused with a ValueError.

    The file must be a regular file within ``safe_files.MAX_FILE_BYTES["checkpoint"]``; a TorchScript
    archive (a program) is refused before torch sees it; the configs must pass :func:`read_configs`.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist (train one with --mode train, or pass --model_path)")
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is not a file")
    state = load_pt(
        read_limited(path, kind="checkpoint"),
        source=f"checkpoint {path}",
        kind="a checkpoint",
        program_hint="; if it comes from a source you trust, name it .ts and pass --trust_torchscript",
    )
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        raise ValueError(f"{path} is not a checkpoint written by this tool (missing model, EMA or config)")
    version = state["format_version"]
    if type(version) is not int or version != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {short_repr(version)}; this tool reads {FORMAT_VERSION}"
        )
    read_configs(state, source=f"checkpoint {path}")
    step = state["step"]
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"checkpoint {path} records step {short_repr(step)}; a checkpoint's step is 0 to {MAX_STEP:,}")
    for weights in ("model", "ema"):
        check_dense(state[weights], source=f"checkpoint {path}")
        tensors = state[weights].values() if isinstance(state[weights], dict) else ()
        if any(isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all() for t in tensors):
            raise ValueError(
                f"checkpoint {path}: its {'EMA ' if weights == 'ema' else ''}weights hold NaN or inf; it is unusable"
            )
    return state


def read_configs(meta: Mapping, *, source: str) -> tuple[UNetConfig, ScheduleConfig]:
    """``meta["model_config"]`` and ``meta["schedule_config"]`` (plain dicts from a file) as configs,
    through their ``from_dict``; ValueError naming ``source`` (e.g. "checkpoint ck.pt") otherwise."""
    configs = []
    for key, config_class in (("model_config", UNetConfig), ("schedule_config", ScheduleConfig)):
        try:
            configs.append(config_class.from_dict(meta[key]))
        except ValueError as exc:
            raise ValueError(f"{source}: its {key.replace('_', ' ')} is unusable ({first_line(exc)})") from exc
    model_config, schedule_config = configs
    return model_config, schedule_config


def parse_artifact_metadata(raw: str | bytes | dict | None, *, source: Path) -> tuple[UNetConfig, ScheduleConfig, dict]:
    """Model config, schedule config and the whole metadata of an artifact; ValueError if unusable.

    ``raw`` is JSON text (parsed by safe_files.parse_json: size- and depth-limited) or its parsed
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
    elif meta.get("precision", "fp32") not in ALL_PRECISIONS:
        problem = f"precision {short_repr(meta.get('precision'))}, expected one of {', '.join(ALL_PRECISIONS)}"
    else:
        problem = None
    if problem is None:
        model_config, schedule_config = read_configs(meta, source=str(source))
        if meta.get("io") != UNetIO.from_config(model_config).to_dict():
            problem = "its inputs and outputs differ from this version's U-Net interface"
    if problem is not None:
        raise ValueError(f"{source} has unusable model metadata ({problem}); export it again")
    return model_config, schedule_config, meta


def read_link(state: Mapping, *, source: str) -> dict | None:
    """A checkpoint's link to its autoencoder (None for a pixel model), its types checked."""
    link = state.get(LINK_KEY)
    if link is None:
        return None
    if not (
        isinstance(link, dict)
        and set(link) == {"path", "sha256"}
        and isinstance(link["path"], str)
        and 0 < len(link["path"]) <= MAX_PATH_CHARS
        and isinstance(link["sha256"], str)
        and _SHA256.fullmatch(link["sha256"])
    ):
        raise ValueError(f"{source}: its autoencoder entry is unusable ({short_repr(link)})")
    return link


def check_pixel_unet(model_config, *, source: str) -> None:
    """A model without an autoencoder draws images: 1 or 3 channels."""
    if model_config.in_channels not in (1, 3):
        raise ValueError(
            f"{source}: its U-Net has {model_config.in_channels} channels but no autoencoder to decode them "
            "(images have 1 or 3; latent models are sampled from their .pt checkpoint)"
        )


def load_checkpoint_model(
    path: str | Path, *, weights: str = "ema", device: torch.device | str = "cpu"
) -> tuple[UNet, ScheduleConfig]:
    """The U-Net of a checkpoint with its EMA (or raw) weights, in eval mode, and its schedule config."""
    model, schedule_config, *_ = load_checkpoint_parts(path, weights=weights, device=device)
    return model, schedule_config


def training_dataset(state: Mapping) -> str | None:
    """The dataset a checkpoint's model was trained on (its train_config), or None where it names no known one."""
    from ddpm.data.catalog import DATASETS

    config = state.get("train_config")
    dataset = config.get("dataset") if isinstance(config, Mapping) else None
    return dataset if dataset in DATASETS else None


def load_checkpoint_parts(
    path: str | Path, *, weights: str = "ema", device: torch.device | str = "cpu"
) -> tuple[UNet, ScheduleConfig, tuple[str, ...], dict | None, str | None]:
    """:func:`load_checkpoint_model`, the model's class names (empty for an unconditional model), for a
    latent model its link to its autoencoder (latent/autoencoder.py; None for a pixel model), and the dataset it was
    trained on (:func:`training_dataset`), all from one read of the file.

    The U-Net is built on the meta device and takes the checkpoint's tensors (torch_files.load_weights
    with ``assign``), so nothing is allocated for a config until its weights are known to match it.
    """
    return model_parts(load_checkpoint(path), path=path, weights=weights, device=device)


def model_parts(
    state: Mapping, *, path: str | Path, weights: str = "ema", device: torch.device | str = "cpu"
) -> tuple[UNet, ScheduleConfig, tuple[str, ...], dict | None, str | None]:
    """:func:`load_checkpoint_parts` from a checkpoint's state read from ``path``: a checkpoint's, or one
    backends/artifacts.py made of a safetensors export or a diffusers folder (``source_format``)."""
    from ddpm.conditioning import read_class_names

    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    source = f"checkpoint {path}" if "source_format" not in state else str(path)
    held = state.get("weights_kind", "ema")  # a checkpoint holds both; a safetensors export or diffusers folder one set
    if "source_format" in state and weights != held:
        what = (
            "one set of weights"
            if state["source_format"] == "diffusers"
            else f"the {'EMA' if held == 'ema' else 'raw'} weights only"
        )
        raise ValueError(
            f"{path} holds {what}; drop --no_ema"
            if weights == "model"
            else f"{path} holds {what}; sample it with --no_ema"
        )
    model_config, schedule_config = read_configs(state, source=source)
    link = read_link(state, source=source)
    if link is None:
        check_pixel_unet(model_config, source=source)
    class_names = (
        read_class_names(state, num_classes=model_config.num_classes, source=source) if model_config.num_classes else ()
    )
    with torch.device("meta"):
        model = UNet(model_config)
    load_weights(model, state[weights], source=source, assign=True)
    return model.to(device).eval(), schedule_config, class_names, link, training_dataset(state)
