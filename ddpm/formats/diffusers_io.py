"""Hugging Face diffusers folders and safetensors files: other tools' models in, this tool's models out.

    python main.py --mode sample --model_path ~/models/ddpm-cifar10-32          # a folder saved by diffusers
    python main.py --mode export --format diffusers --model_path checkpoints/mnist.pt     # -> mnist_diffusers/
    python main.py --mode export --format safetensors --model_path checkpoints/mnist.pt   # -> mnist.safetensors

This tool's U-Net is diffusers' ``UNet2DModel`` with ``DownBlock2D``/``AttnDownBlock2D`` levels (the same
modules in the same order), so a model moves between the two by renaming its weights:

* backends/artifacts.py's ``read_diffusers_folder`` reads a pipeline folder (``unet/`` and ``scheduler/``, as
  ``DDPMPipeline.save_pretrained`` writes) or a ``UNet2DModel`` folder alone (then the schedule is
  diffusers' DDPMScheduler default: linear betas 1e-4 to 0.02 over 1000 steps) as a checkpoint's state:
  :func:`unet_config_from_diffusers` and :func:`schedule_config_from_diffusers` map the configs, and
  refuse in one line, naming the setting, what this U-Net cannot compute (another block type,
  cross-attention, v-prediction, ...); the weights are renamed and later loaded strictly;
* its ``write_diffusers_folder`` writes what ``DDPMPipeline.from_pretrained`` loads (EMA weights in
  safetensors, through formats/safetensors_io.py, which also writes and reads this tool's own
  ``--format safetensors`` files).

Class-conditional models: diffusers' ``num_class_embeds`` rows are this tool's classes plus its null label
(the last row, "no class", which classifier-free guidance needs); a diffusers model's last class is read as
that null label. Reading and writing need no diffusers: the files are read with ``safetensors`` (no
pickle; a ``.bin`` weights file goes through ``torch.load(weights_only=True)``). Only
:class:`DiffusersUNet`, the benchmark's diffusers row, imports diffusers (when it is built).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from basic_diffusion import UNet, UNetConfig
from ddpm.formats.torch_files import check_dense
from ddpm.util.messages import first_line
from ddpm.util.safe_files import parse_json, read_limited
from noise_schedule import MAX_LIST_ITEMS, MAX_TIMESTEPS, ScheduleConfig, config_fields, short_repr

WEIGHTS_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
SCHEDULER_FILE = "scheduler_config.json"
# The diffusers release whose format the exports follow (written into the configs; diffusers reads older ones).
DIFFUSERS_VERSION = "0.42.1"
# The file an export writes last into its folder, recording the sha256 of each file it wrote: a later export
# replaces only a folder whose files it records (diffusers' own save_pretrained writes the same names).
EXPORT_MARKER = "ddpm_export.json"

# UNet2DModel settings this U-Net computes only at one value: key -> that value (None: absent or null).
_FIXED = {
    "center_input_sample": False,
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "mid_block_scale_factor": 1,
    "downsample_type": "conv",
    "upsample_type": "conv",
    "act_fn": "silu",
    "add_attention": True,
    "class_embed_type": None,
    "mid_block_type": "UNetMidBlock2D",
    "num_train_timesteps": None,  # only read by the "learned" time embedding
}
# Settings mapped onto UNetConfig (see unet_config_from_diffusers), with diffusers' defaults.
_MAPPED = {
    "sample_size": None,
    "in_channels": 3,
    "out_channels": 3,
    "freq_shift": 0,
    "flip_sin_to_cos": True,
    "down_block_types": ("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
    "up_block_types": ("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    "block_out_channels": (224, 448, 672, 896),
    "layers_per_block": 2,
    "downsample_padding": 1,
    "dropout": 0.0,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "resnet_time_scale_shift": "default",
    "num_class_embeds": None,
    "attn_norm_num_groups": None,
}
_DOWN_TYPES = {"DownBlock2D": False, "AttnDownBlock2D": True}  # block type -> has attention
_UP_TYPES = {"UpBlock2D": False, "AttnUpBlock2D": True}
_TIME_SCALE_SHIFT = {"default": "add", "scale_shift": "scale_shift"}  # diffusers -> UNetConfig.time_conditioning
_BETA_SCHEDULES = {"linear": "linear", "squaredcos_cap_v2": "cosine"}  # diffusers -> ScheduleConfig.kind
DIFFUSERS_COSINE_S = 0.008  # squaredcos_cap_v2's offset, fixed in diffusers


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _UNetSettings:
    """The types of the UNet2DModel settings mapped onto UNetConfig, checked by noise_schedule.config_fields as
    this tool's own files are (exact types, finite numbers, short lists); block types are lists of names."""

    sample_size: int
    in_channels: int
    out_channels: int
    freq_shift: int
    flip_sin_to_cos: bool
    block_out_channels: tuple[int, ...]
    layers_per_block: int
    downsample_padding: int
    dropout: float
    attention_head_dim: int
    norm_num_groups: int
    norm_eps: float
    resnet_time_scale_shift: str
    num_class_embeds: int
    attn_norm_num_groups: int


_OPTIONAL = ("attention_head_dim", "num_class_embeds", "attn_norm_num_groups")  # null means "unset" in diffusers
_BLOCK_TYPES = ("down_block_types", "up_block_types")


def _typed_settings(config: dict, *, source: str) -> dict:
    """The mapped settings of a UNet2DModel config (diffusers' defaults where absent), their types checked
    before any arithmetic; ValueError naming ``source`` and the setting."""
    if "block_out_channels" not in config:
        raise ValueError(
            f"{source}: no block_out_channels; a UNet2DModel config names its widths (diffusers' save_pretrained "
            "writes them)"
        )
    raw = {key: config.get(key, default) for key, default in _MAPPED.items() if key not in _BLOCK_TYPES}
    size = raw["sample_size"]
    if isinstance(size, list) and len(size) == 2 and type(size[0]) is int and size[0] == size[1]:
        raw["sample_size"] = size[0]  # square images
    unset = {key for key in _OPTIONAL if raw[key] is None}
    try:
        typed = config_fields(_UNetSettings, {**raw, **dict.fromkeys(unset, 0)})
    except ValueError as exc:
        raise ValueError(f"{source}: {first_line(exc)}") from exc
    for key in _BLOCK_TYPES:
        names = config.get(key, _MAPPED[key])
        if not (
            isinstance(names, (list, tuple)) and len(names) <= MAX_LIST_ITEMS and all(type(n) is str for n in names)
        ):
            raise ValueError(f"{source}: {key} must be a list of block names, got {short_repr(names)}")
        typed[key] = tuple(names)
    return {**typed, **dict.fromkeys(unset)}


def unet_config_from_diffusers(config: object, *, source: str) -> UNetConfig:
    """A ``UNet2DModel`` config.json (parsed) as this tool's UNetConfig; ValueError naming what differs."""
    if not isinstance(config, dict):
        raise ValueError(f"{source}: a JSON {type(config).__name__} instead of a UNet2DModel config")
    name = config.get("_class_name", "UNet2DModel")
    if name != "UNet2DModel":
        raise ValueError(f"{source} is a {short_repr(name)}; this tool reads diffusers' UNet2DModel only")
    unknown = [k for k in config if not k.startswith("_") and k not in _FIXED and k not in _MAPPED]
    if unknown:
        raise ValueError(
            f"{source}: setting {short_repr(unknown[0])} is not one of UNet2DModel's that this U-Net computes"
        )
    for key, value in _FIXED.items():
        given = config.get(key, value)
        if given != value:
            raise ValueError(
                f"{source}: {key}={short_repr(given)} is not computed by this U-Net (it computes {value!r})"
            )
    c = _typed_settings(config, source=source)
    fields = _unet_fields(c, fail=lambda problem: ValueError(f"{source}: {problem}"))
    try:
        model_config = UNetConfig.from_dict(fields)
    except ValueError as exc:
        raise ValueError(f"{source}: its config does not describe a U-Net this tool runs ({first_line(exc)})") from exc
    check_same_groups(model_config, source=source)
    return model_config


def _unet_fields(c: dict, *, fail) -> dict:
    """UNetConfig's fields (a dict for UNetConfig.from_dict) from the typed settings ``c``; ``fail(problem)`` makes
    the ValueError for what this U-Net cannot compute."""
    widths, down, up = c["block_out_channels"], c["down_block_types"], c["up_block_types"]
    if not (widths and all(w > 0 for w in widths)):
        raise fail(f"block_out_channels must be a list of positive integers, got {short_repr(list(widths))}")
    if not len(down) == len(up) == len(widths):
        raise fail(f"down_block_types and up_block_types need one entry per block_out_channels ({len(widths)})")
    for kind, types in (("down", _DOWN_TYPES), ("up", _UP_TYPES)):
        odd = [t for t in (down if kind == "down" else up) if t not in types]
        if odd:
            raise fail(f"{kind} block type {short_repr(odd[0])} is not one this U-Net has ({', '.join(types)})")
    attends = [_DOWN_TYPES[t] for t in down]
    if attends != [_UP_TYPES[t] for t in reversed(up)]:
        raise fail(
            "attention differs between the down and up blocks of a level; this U-Net attends at the same levels both "
            "ways"
        )
    base = widths[0]
    if any(w % base for w in widths):
        raise fail(
            f"block_out_channels {list(widths)} are not multiples of the first; this U-Net's levels are "
            "model_channels x an integer"
        )
    if c["out_channels"] != c["in_channels"]:
        raise fail(
            f"out_channels {c['out_channels']} differs from in_channels {c['in_channels']}; "
            "this U-Net predicts the noise of its input (a learned variance is not read)"
        )
    if c["resnet_time_scale_shift"] not in _TIME_SCALE_SHIFT:
        raise fail(f"resnet_time_scale_shift {short_repr(c['resnet_time_scale_shift'])} is not default or scale_shift")
    # The middle block's attention is normalized in attn_norm_num_groups groups; diffusers leaves that unset to
    # mean norm_num_groups with the "default" time shift, and no normalization at all with "scale_shift".
    attn_groups = c["attn_norm_num_groups"]
    if attn_groups is None and c["resnet_time_scale_shift"] == "scale_shift":
        raise fail(
            "attn_norm_num_groups is unset, so with scale_shift its middle attention has no GroupNorm (this U-Net's "
            "has)"
        )
    if attn_groups is not None and attn_groups != c["norm_num_groups"]:
        raise fail(f"attn_norm_num_groups {attn_groups} differs from norm_num_groups {c['norm_num_groups']}")
    classes = c["num_class_embeds"]
    if classes is not None and classes < 2:
        raise fail(f"num_class_embeds must be 2 or more (the classes and the null label), got {classes}")
    size = c["sample_size"]
    resolutions = [size // 2**level for level in range(len(widths))]
    return {
        "image_size": size,
        "in_channels": c["in_channels"],
        "model_channels": base,
        "channel_mult": tuple(w // base for w in widths),
        "num_res_blocks": c["layers_per_block"],
        "attention_resolutions": tuple(r for r, a in zip(resolutions, attends) if a),
        "num_heads": _heads(c["attention_head_dim"], widths=widths, attends=attends, fail=fail),
        "dropout": c["dropout"],
        "norm_groups": c["norm_num_groups"],
        "num_classes": 0 if classes is None else classes - 1,
        "time_conditioning": _TIME_SCALE_SHIFT[c["resnet_time_scale_shift"]],
        "dims": 2,
        "patch_size": 1,
        "flip_sin_to_cos": c["flip_sin_to_cos"],
        "freq_shift": c["freq_shift"],
        "norm_eps": c["norm_eps"],
        "downsample_padding": c["downsample_padding"],
    }


def _heads(head_dim: int | None, *, widths, attends, fail) -> int:
    """This U-Net's one head count from diffusers' attention_head_dim (None: one head as wide as the block)."""
    attended = [w for w, a in zip(widths, attends) if a] + [widths[-1]]  # the middle block always attends
    if head_dim is None:
        return 1
    if not (head_dim > 0 and all(w % head_dim == 0 for w in attended)):
        raise fail(f"attention_head_dim {head_dim} must divide every attention width {sorted(set(attended))}")
    heads = {w // head_dim for w in attended}
    if len(heads) > 1:
        raise fail(
            f"attention_head_dim {head_dim} gives {sorted(heads)} heads at widths {sorted(set(attended))}; "
            "this U-Net has one head count for all attention layers"
        )
    return heads.pop()


def check_same_groups(config: UNetConfig, *, source: str) -> None:
    """diffusers normalizes every layer in ``norm_groups`` groups; this U-Net, where a width does not divide,
    in gcd(groups, width). Equal only when the groups divide every normalized width."""
    with torch.device("meta"):
        model = UNet(config)
    widths = sorted(
        {m.num_channels for m in model.modules() if isinstance(m, nn.GroupNorm) and m.num_groups != config.norm_groups}
    )
    if widths:
        raise ValueError(
            f"{source}: {config.norm_groups} norm groups do not divide the widths {widths}; diffusers' UNet2DModel "
            "needs them to"
        )


def diffusers_unet_config(config: UNetConfig, *, source: str) -> dict:
    """This tool's UNetConfig as a UNet2DModel config.json; ValueError for what diffusers cannot represent."""
    if config.dims != 2 or config.patch_size != 1:
        raise ValueError(
            f"{source}: diffusers' UNet2DModel is for images without patches; this model is a volume or patched one"
        )
    if config.channel_mult[0] != 1:
        raise ValueError(
            f"{source}: channel_mult starts at {config.channel_mult[0]}; UNet2DModel's first level is its base width"
        )
    check_same_groups(config, source=source)
    widths = [config.model_channels * m for m in config.channel_mult]
    attends = [r in config.attention_resolutions for r in config.resolutions]
    attended = {w for w, a in zip(widths, attends) if a} | {widths[-1]}
    head_dims = {w // config.num_heads for w in attended}
    if len(head_dims) > 1:
        raise ValueError(
            f"{source}: {config.num_heads} heads over widths {sorted(attended)} differ in head size; "
            "UNet2DModel has one attention_head_dim"
        )
    time_shift = {v: k for k, v in _TIME_SCALE_SHIFT.items()}[config.time_conditioning]
    return {
        "_class_name": "UNet2DModel",
        "_diffusers_version": DIFFUSERS_VERSION,
        "sample_size": config.image_size,
        "in_channels": config.in_channels,
        "out_channels": config.in_channels,
        "center_input_sample": False,
        "time_embedding_type": "positional",
        "freq_shift": config.freq_shift,
        "flip_sin_to_cos": config.flip_sin_to_cos,
        "down_block_types": ["AttnDownBlock2D" if a else "DownBlock2D" for a in attends],
        "up_block_types": ["AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attends)],
        "block_out_channels": widths,
        "layers_per_block": config.num_res_blocks,
        "mid_block_scale_factor": 1,
        "downsample_padding": config.downsample_padding,
        "downsample_type": "conv",
        "upsample_type": "conv",
        "dropout": config.dropout,
        "act_fn": "silu",
        "attention_head_dim": head_dims.pop(),
        "norm_num_groups": config.norm_groups,
        "attn_norm_num_groups": config.norm_groups,  # given: see the reader
        "norm_eps": config.norm_eps,
        "resnet_time_scale_shift": time_shift,
        "add_attention": True,
        "class_embed_type": None,
        "num_class_embeds": config.num_classes + 1 if config.num_classes else None,  # the last row: the null label
    }


@dataclass(frozen=True)
class _SchedulerSettings:
    """The types of the scheduler_config.json settings read (noise_schedule.config_fields checks them)."""

    num_train_timesteps: int
    beta_schedule: str
    beta_start: float
    beta_end: float
    prediction_type: str
    rescale_betas_zero_snr: bool


_SCHEDULER_DEFAULTS = {  # DDPMScheduler's
    "num_train_timesteps": 1000,
    "beta_schedule": "linear",
    "beta_start": 1e-4,
    "beta_end": 0.02,
    "prediction_type": "epsilon",
    "rescale_betas_zero_snr": False,
}
_FIXED_VARIANCES = (None, "fixed_small", "fixed_small_log", "fixed_large", "fixed_large_log")
# diffusers' prediction_type -> what this tool's ScheduleConfig calls it (noise_schedule.PREDICTIONS).
PREDICTION_TYPES = {"epsilon": "eps", "v_prediction": "v", "sample": "x0"}
# A distilled student's recipe (noise_schedule.ScheduleConfig), kept in its scheduler_config.json under these keys
# (diffusers' own schedulers ignore them).
STUDENT_KEYS = ("student_sampler", "student_timesteps", "folded_guidance")


def schedule_config_from_diffusers(config: object, *, source: str) -> ScheduleConfig:
    """A scheduler_config.json's forward process (betas) as a ScheduleConfig; ValueError naming what differs.

    Only the training process is read: how a diffusers scheduler samples (clip_sample, variance_type's fixed
    kinds, timestep_spacing, ...) is chosen per run here by --sampler, --sampling_steps and --no_clip.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{source}: a JSON {type(config).__name__} instead of a scheduler config")
    try:
        c = config_fields(_SchedulerSettings, {key: config.get(key, v) for key, v in _SCHEDULER_DEFAULTS.items()})
    except ValueError as exc:
        raise ValueError(f"{source}: {first_line(exc)}") from exc
    checks = (
        (c["prediction_type"] in PREDICTION_TYPES, "prediction_type", " or ".join(PREDICTION_TYPES)),
        (config.get("trained_betas") is None, "trained_betas", "null"),
        (not c["rescale_betas_zero_snr"], "rescale_betas_zero_snr", "false"),
        (config.get("variance_type", "fixed_small") in _FIXED_VARIANCES, "variance_type", "a fixed variance"),
        (c["beta_schedule"] in _BETA_SCHEDULES, "beta_schedule", " or ".join(_BETA_SCHEDULES)),
    )
    for ok, key, supported in checks:
        if not ok:
            raise ValueError(
                f"{source}: {key}={short_repr(config.get(key))} is not supported (this tool needs {supported})"
            )
    steps = c["num_train_timesteps"]
    if not 2 <= steps <= MAX_TIMESTEPS:
        raise ValueError(
            f"{source}: num_train_timesteps must be between 2 and {MAX_TIMESTEPS}, got {short_repr(steps)}"
        )
    fields = {
        "kind": _BETA_SCHEDULES[c["beta_schedule"]],
        "num_timesteps": steps,
        "cosine_s": DIFFUSERS_COSINE_S,
        "prediction": PREDICTION_TYPES[c["prediction_type"]],
        **{key: config[key] for key in STUDENT_KEYS if key in config},  # typed by ScheduleConfig.from_dict
    }
    if fields["kind"] == "cosine":
        fields.update(beta_start=1e-4, beta_end=0.02)  # unused by the cosine schedule
    else:
        scale = steps / 1000.0  # this tool's linear endpoints are for T = 1000 and scale by 1000 / T
        fields.update(beta_start=c["beta_start"] * scale, beta_end=c["beta_end"] * scale)
    try:
        return ScheduleConfig.from_dict(fields)
    except ValueError as exc:
        raise ValueError(f"{source}: its schedule is unusable ({first_line(exc)})") from exc


def diffusers_scheduler_config(schedule: ScheduleConfig, *, source: str) -> dict:
    """A ScheduleConfig as DDPMScheduler's scheduler_config.json (fixed-small variance; its prediction type; a
    student's recipe under :data:`STUDENT_KEYS`)."""
    config = {
        "_class_name": "DDPMScheduler",
        "_diffusers_version": DIFFUSERS_VERSION,
        "num_train_timesteps": schedule.num_timesteps,
    }
    if schedule.kind == "cosine":
        if schedule.cosine_s != DIFFUSERS_COSINE_S:
            raise ValueError(
                f"{source}: a cosine schedule with s={schedule.cosine_s}; diffusers' squaredcos_cap_v2 fixes s=0.008"
            )
        config.update(beta_schedule="squaredcos_cap_v2", beta_start=0.0001, beta_end=0.02)
    else:
        scale = 1000.0 / schedule.num_timesteps
        config.update(
            beta_schedule="linear", beta_start=schedule.beta_start * scale, beta_end=schedule.beta_end * scale
        )
    config.update(
        trained_betas=None,
        variance_type="fixed_small",
        clip_sample=True,
        clip_sample_range=1.0,
        prediction_type={ours: theirs for theirs, ours in PREDICTION_TYPES.items()}[schedule.prediction],
        thresholding=False,
        timestep_spacing="leading",
        steps_offset=0,
        rescale_betas_zero_snr=False,
    )
    if schedule.is_student:
        config.update(
            student_sampler=schedule.student_sampler,
            student_timesteps=list(schedule.student_timesteps),
            folded_guidance=schedule.folded_guidance,
        )
    return config


# --------------------------------------------------------------------------------------------
# Weights: this tool's names <-> diffusers'
# --------------------------------------------------------------------------------------------

_RENAMES = (  # (this tool's key prefix, diffusers'), applied in order, first match
    (r"time_mlp\.0\.", "time_embedding.linear_1."),
    (r"time_mlp\.2\.", "time_embedding.linear_2."),
    (r"label_embedding\.", "class_embedding."),
    (r"(down|up)\.(\d+)\.blocks\.(\d+)\.", r"\1_blocks.\2.resnets.\3."),
    (r"(down|up)\.(\d+)\.attentions\.(\d+)\.", r"\1_blocks.\2.attentions.\3."),
    (r"downsample\.(\d+)\.conv\.", r"down_blocks.\1.downsamplers.0.conv."),
    (r"upsample\.(\d+)\.conv\.", r"up_blocks.\1.upsamplers.0.conv."),
    (r"mid_block1\.", "mid_block.resnets.0."),
    (r"mid_block2\.", "mid_block.resnets.1."),
    (r"mid_attention\.", "mid_block.attentions.0."),
    (r"norm_out\.", "conv_norm_out."),
)
_RESNET_PARTS = {"emb_proj": "time_emb_proj", "skip": "conv_shortcut"}
_ATTENTION_PARTS = {"norm": "group_norm", "proj": "to_out.0"}
# diffusers' attention before 0.14 (files saved then, and Ho et al.'s converted DDPMs): old name -> new
_OLD_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def _rename(key: str) -> tuple[str, str | None]:
    """This tool's key -> (diffusers' key, the attention part it is: "qkv", "proj" or None)."""
    for pattern, replacement in _RENAMES:
        m = re.match(pattern, key)
        if m:
            head, (part, _, leaf) = m.expand(replacement), key[m.end() :].partition(".")
            if ".attentions." in head or head.startswith("mid_block.attentions"):
                if part == "qkv":
                    return head + "to_{}." + leaf, "qkv"
                return head + _ATTENTION_PARTS.get(part, part) + "." + leaf, part if part == "proj" else None
            if ".resnets." in head:
                return head + _RESNET_PARTS.get(part, part) + "." + leaf, None
            return head + key[m.end() :], None
    return key, None  # conv_in, conv_out


def to_diffusers_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This tool's U-Net weights as UNet2DModel's (1x1 attention convolutions as linear layers)."""
    out = {}
    for key, tensor in state.items():
        name, part = _rename(key)
        if part == "qkv":  # (3C, C, 1, 1) -> to_q, to_k, to_v (C, C); biases (3C,) -> three (C,)
            for letter, chunk in zip("qkv", tensor.chunk(3, dim=0)):
                out[name.format(letter)] = (
                    chunk.reshape(chunk.shape[0], -1).contiguous() if chunk.ndim > 1 else chunk.contiguous()
                )
        elif part == "proj" and tensor.ndim > 1:
            out[name] = tensor.reshape(tensor.shape[0], -1).contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def from_diffusers_weights(
    tensors: Mapping[str, torch.Tensor], config: UNetConfig, *, source: str
) -> dict[str, torch.Tensor]:
    """UNet2DModel's weights as this tool's U-Net's for ``config``; every missing, unexpected or misshapen
    tensor is one ValueError naming ``source``. Tensors come back float32."""
    check_dense(tensors, source=source)
    tensors = {_modern_attention_name(k): v for k, v in tensors.items()}
    with torch.device("meta"):
        expected = UNet(config).state_dict()
    out, used = {}, set()
    for key, like in expected.items():
        name, part = _rename(key)
        names = [name.format(letter) for letter in "qkv"] if part == "qkv" else [name]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"{source}: its weights lack {missing[0]} (for this config's {key})")
        pieces = [tensors[n] for n in names]
        if any(not isinstance(p, torch.Tensor) or not p.is_floating_point() for p in pieces):
            raise ValueError(f"{source}: {names[0]} is not a floating-point tensor")
        value = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        if value.numel() != like.numel() or (part is None and tuple(value.shape) != tuple(like.shape)):
            raise ValueError(
                f"{source}: {names[0]} has shape {tuple(pieces[0].shape)}, this config needs {key} {tuple(like.shape)}"
            )
        out[key] = value.reshape(like.shape).to(torch.float32).contiguous()
        used.update(names)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(
            f"{source}: its weights hold {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, "
            "which this config has no place for"
        )
    if any(not torch.isfinite(t).all() for t in out.values()):
        raise ValueError(f"{source}: its weights hold NaN or inf; it is unusable")
    return out


def _modern_attention_name(key: str) -> str:
    m = re.match(r"(.*\.attentions\.\d+\.)(query|key|value|proj_attn)\.(weight|bias)$", key)
    return f"{m[1]}{_OLD_ATTENTION[m[2]]}.{m[3]}" if m else key


# --------------------------------------------------------------------------------------------
# Reading: a folder or a file as a checkpoint's state
# --------------------------------------------------------------------------------------------


def read_json(path: Path, *, what: str, folder: Path) -> object:
    """A config file of the model folder ``folder``, read only from inside it (safe_files.check_inside)."""
    if not present(path):
        raise ValueError(f"{path.parent}: no {path.name} ({what})")
    return parse_json(read_limited(path, kind="metadata", inside=folder), source=path)


def present(path: Path) -> bool:
    """Whether a name exists in a model folder, whatever it is: a FIFO or a dangling link is refused when read."""
    return path.exists() or path.is_symlink()


def unet_folder(folder: Path) -> Path:
    """The folder holding the UNet2DModel's config.json: ``folder/unet`` (a pipeline) or ``folder`` itself."""
    for candidate in (folder / "unet", folder):
        if present(candidate / "config.json"):
            return candidate
    raise ValueError(
        f"--model_path {folder} is a folder but not a diffusers model (no config.json or unet/config.json)"
    )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def diffusers_folder_files(output: Path) -> dict[str, Path]:
    """The files backends/artifacts.write_diffusers_folder writes into ``output`` (each an output of the run); a
    ``output`` that is a file is refused."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file; --format diffusers writes a folder")
    return {
        "--output's unet weights": output / "unet" / WEIGHTS_FILES[0],
        "--output's unet config": output / "unet" / "config.json",
        "--output's scheduler config": output / "scheduler" / SCHEDULER_FILE,
        "--output's model_index.json": output / "model_index.json",
        "--output's export marker": output / EXPORT_MARKER,  # last: util/model_folders.marker_bytes
    }


def json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


class DiffusersUNet(nn.Module):
    """eps = unet(x_t, t[, y]) through diffusers' own ``UNet2DModel`` holding this U-Net's weights (the equal
    network, for the benchmark's diffusers row), in ``dtype``: inputs cast to it, eps returned in float32.
    ImportError (with the install line) without diffusers; ValueError for what UNet2DModel cannot represent."""

    def __init__(self, model: UNet, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        try:
            from diffusers import UNet2DModel
        except ImportError as exc:
            raise ImportError("diffusers is not installed (pip install diffusers)") from exc
        config = diffusers_unet_config(model.config, source="this model")
        weight = next(model.parameters())
        self.unet = UNet2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
        self.unet.load_state_dict(to_diffusers_weights(model.state_dict()), strict=True)
        self.unet = self.unet.to(device=weight.device, dtype=dtype).eval()
        self.dtype = dtype

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.unet(x_t.to(self.dtype), t, class_labels=y).sample.float()
