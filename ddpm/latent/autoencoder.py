"""Latent diffusion's first stage: a small KL-regularized convolutional autoencoder, and the link between a DDPM
checkpoint and the autoencoder whose latents it models.

In the style of the latent diffusion paper's first stage (Rombach et al. 2022, the "KL" models):
residual blocks (GroupNorm, SiLU, 3x3 convolutions), strided-convolution downsampling and
nearest + convolution upsampling, no attention. The encoder gives a diagonal Gaussian posterior
(mean, log-variance) over a latent of ``latent_channels`` x (side / downsample)^2; training
reconstructs from a reparameterized sample with an L1 loss plus a small KL term to N(0, I).
Images whose side does not divide are padded (edge pixels repeated) to the next multiple of
2 x downsample in the encoder and cropped back in the decoder, so the latent side is even:
28x28 -> 32 -> 8x8 with factor 4; 8x8 digits -> 4x4 with factor 2.

A latent model's U-Net denoises the scaled latents of such an autoencoder (trained with ``--mode
train_autoencoder``); sampling decodes its latents to images, so grids, ``.npz`` files and evaluate see images as
they do for a pixel model. The checkpoint names its autoencoder by path and sha256, and sampling refuses a file that
is not the one it was trained with (:func:`linked_first_stage`).

    python main.py --mode train_autoencoder --dataset digits            # -> checkpoints/digits_autoencoder.pt
    python main.py --mode train --dataset digits --autoencoder checkpoints/digits_autoencoder.pt
    python main.py --mode sample --model_path checkpoints/digits.pt      # decodes with the linked autoencoder

    loaded = load_autoencoder("checkpoints/digits_autoencoder.pt", device=torch.device("cpu"))
    z = encode_images(loaded, images_uint8)              # (N, 4, 4, 4) float32, unit variance on the training set
    x = LatentDecoder(loaded.model, loaded.latent_scale)(z)   # (N, 1, 8, 8) in [-1, 1]; traces and exports to ONNX

Training (the loop, the latent scale, PSNR/SSIM and the reconstructions PNG) is training/autoencoder_trainer.py."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from basic_diffusion import Downsample, Upsample, _norm, norm_act
from ddpm.choices import AUTOENCODER_DEFAULTS
from ddpm.formats.torch_files import check_dense, load_pt, load_weights
from ddpm.util.messages import first_line
from ddpm.util.safe_files import read_limited
from noise_schedule import config_fields, short_repr

if TYPE_CHECKING:
    from ddpm.requests import AutoencoderTrainRequest

KIND, FORMAT = "autoencoder", 1  # a checkpoint's "kind" and "format"
DOWNSAMPLE_FACTORS = (2, 4, 8)
NORM_GROUPS = 8  # GroupNorm groups (fewer where a width has fewer channels)
LOGVAR_RANGE = (-30.0, 20.0)  # the posterior's log-variance is clamped here, as in the paper's code
# Entries of the checkpoint: required, and informative (checked when present).
REQUIRED_KEYS = ("kind", "format", "config", "state_dict", "latent_scale")
OPTIONAL_KEYS = {"dataset": str, "metrics": dict, "step": int}


@dataclass(frozen=True)
class AutoencoderConfig:
    """Shape and loss weight of the autoencoder.

    Valid values (checked at construction; :meth:`from_dict`, for configs read from files, also refuses
    unknown or missing keys and wrong types): ``image_size`` 4..1024; ``in_channels`` 1 or 3;
    ``latent_channels`` 1..64; ``downsample`` 2, 4 or 8 (0: the default, 4 from 16 pixels up, else 2);
    ``base_channels`` 4..256; ``kl_weight`` in [0, 1].
    """

    image_size: int
    in_channels: int
    latent_channels: int = AUTOENCODER_DEFAULTS["latent_channels"]
    downsample: int = 0  # 0: 4 for images of 16 pixels or more, 2 for smaller ones (resolved here)
    base_channels: int = AUTOENCODER_DEFAULTS["ae_channels"]
    # See autoencoder_loss. Larger than the paper's 1e-6 so that noisy latents decode well (BENCHMARKS.md,
    # "Latent diffusion on the digits").
    kl_weight: float = AUTOENCODER_DEFAULTS["kl_weight"]

    def __post_init__(self) -> None:
        for name, low, high in (("image_size", 4, 1024), ("latent_channels", 1, 64), ("base_channels", 4, 256)):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(
                    f"autoencoder {name} must be an integer between {low} and {high}, got {short_repr(value)}"
                )
        if self.in_channels not in (1, 3) or type(self.in_channels) is not int:
            raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {short_repr(self.in_channels)}")
        if self.downsample == 0:
            object.__setattr__(self, "downsample", 4 if self.image_size >= 16 else 2)
        if self.downsample not in DOWNSAMPLE_FACTORS or type(self.downsample) is not int:
            raise ValueError(f"autoencoder downsample factor must be 2, 4 or 8, got {short_repr(self.downsample)}")
        if not (isinstance(self.kl_weight, (int, float)) and 0.0 <= self.kl_weight <= 1.0):  # also refuses NaN
            raise ValueError(f"autoencoder kl_weight must be between 0 and 1, got {short_repr(self.kl_weight)}")
        object.__setattr__(self, "kl_weight", float(self.kl_weight))

    @classmethod
    def from_dict(cls, data: object) -> AutoencoderConfig:
        """A config read from a file: refuses unknown or missing keys, wrong types, bad ranges."""
        return cls(**config_fields(cls, data))

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def padded_size(self) -> int:
        """The side the encoder sees: the next multiple of 2 x downsample (so the latent side is even)."""
        unit = 2 * self.downsample
        return -(-self.image_size // unit) * unit

    @property
    def padding(self) -> tuple[int, int]:
        """Pixels added before and after the image along each side (the decoder crops them)."""
        extra = self.padded_size - self.image_size
        return extra // 2, extra - extra // 2

    @property
    def latent_side(self) -> int:
        return self.padded_size // self.downsample

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of one image's latent."""
        return (self.latent_channels, self.latent_side, self.latent_side)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, self.image_size, self.image_size)

    @property
    def widths(self) -> tuple[int, ...]:
        """Channels at each resolution, finest first: base_channels, and twice that at the latent's."""
        levels = int(math.log2(self.downsample))
        return (self.base_channels,) * levels + (2 * self.base_channels,)


def requested_config(request: AutoencoderTrainRequest) -> AutoencoderConfig:
    """The autoencoder's config a --mode train_autoencoder request asks for (validated); flags left unset take
    AutoencoderConfig's defaults."""
    given = dict(
        latent_channels=request.latent_channels,
        downsample=request.downsample,
        base_channels=request.base_channels,
        kl_weight=request.kl_weight,
    )
    return AutoencoderConfig(
        image_size=request.image_size, in_channels=request.channels, **{k: v for k, v in given.items() if v is not None}
    )


class ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> conv, GroupNorm -> SiLU -> conv, plus the (1x1-projected) input. ``norm_act`` holds the
    function its norms call, as the U-Net's blocks do: a trainer may swap in a fused kernel of the same arithmetic
    (kernels/ops.use_fused_norms)."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.norm1 = _norm(in_ch, NORM_GROUPS)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = _norm(out_ch, NORM_GROUPS)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()
        self.norm_act = norm_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.norm_act(self.norm1, x))
        h = self.conv2(self.norm_act(self.norm2, h))
        return self.skip(x) + h


class Autoencoder(nn.Module):
    """``encode(x) -> (mean, logvar)`` of the latent posterior; ``decode(z) -> x_hat``; images in [-1, 1]."""

    def __init__(self, config: AutoencoderConfig) -> None:
        super().__init__()
        self.config = config
        widths, c, z = config.widths, config.in_channels, config.latent_channels
        # Encoder: a residual block per resolution, a strided convolution between them.
        layers: list[nn.Module] = [nn.Conv2d(c, widths[0], 3, padding=1)]
        previous = widths[0]
        for level, width in enumerate(widths):
            layers.append(ResnetBlock(previous, width))
            previous = width
            if level < len(widths) - 1:
                layers.append(Downsample(width))
        layers += [_norm(previous, NORM_GROUPS), nn.SiLU(), nn.Conv2d(previous, 2 * z, 3, padding=1)]
        self.encoder = nn.Sequential(*layers)
        # Decoder: the mirror image, nearest-neighbour upsampling followed by a convolution.
        layers = [nn.Conv2d(z, widths[-1], 3, padding=1)]
        previous = widths[-1]
        for level in reversed(range(len(widths))):
            layers.append(ResnetBlock(previous, widths[level]))
            previous = widths[level]
            if level > 0:
                layers.append(Upsample(previous))
        layers += [_norm(previous, NORM_GROUPS), nn.SiLU(), nn.Conv2d(previous, c, 3, padding=1)]
        self.decoder = nn.Sequential(*layers)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C, H, W) in [-1, 1] -> the posterior's mean and log-variance, each (B, *latent_shape)."""
        before, after = self.config.padding
        if before or after:
            x = F.pad(x, (before, after, before, after), mode="replicate")  # (B, C, P, P)
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        return mean, logvar.clamp(*LOGVAR_RANGE)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(B, *latent_shape) -> (B, C, H, W), unclamped (the padding cropped off)."""
        x = self.decoder(z)  # (B, C, P, P)
        before, size = self.config.padding[0], self.config.image_size
        return x[:, :, before : before + size, before : before + size]

    def forward(self, x: torch.Tensor, *, generator: torch.Generator | None = None):
        """Reconstruct from a reparameterized posterior sample: (x_hat, mean, logvar)."""
        mean, logvar = self.encode(x)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return self.decode(mean + torch.exp(0.5 * logvar) * noise), mean, logvar


def autoencoder_loss(
    x: torch.Tensor, x_hat: torch.Tensor, mean: torch.Tensor, logvar: torch.Tensor, *, kl_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, L1, KL): mean |x - x_hat| + kl_weight * KL / (C H W).

    KL is KL(N(mean, exp(logvar)) || N(0, I)) summed over each image's latent, averaged over the batch; both terms
    are divided by the pixel count, so ``kl_weight`` means what the latent diffusion paper's does.
    """
    l1 = (x - x_hat).abs().mean()
    kl = 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).flatten(1).sum(1).mean()
    return l1 + kl_weight * kl / x[0].numel(), l1, kl


class LatentDecoder(nn.Module):
    """Scaled latents (B, *latent_shape) -> images (B, C, H, W) in [-1, 1]: decode(z / latent_scale),
    clamped. Plain tensor ops with no branching on values, so it traces and exports to ONNX."""

    def __init__(self, autoencoder: Autoencoder, latent_scale: float) -> None:
        super().__init__()
        self.autoencoder = autoencoder
        self.latent_scale = float(latent_scale)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.autoencoder.decode(z * (1.0 / self.latent_scale)).clamp(-1.0, 1.0)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def checkpoint_state(model: Autoencoder, *, latent_scale: float, dataset: str, metrics: dict, step: int) -> dict:
    """The dict an autoencoder checkpoint holds (written with safe_files.atomic_write)."""
    return {
        "kind": KIND,
        "format": FORMAT,
        "config": model.config.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "latent_scale": float(latent_scale),
        "dataset": dataset,
        "metrics": metrics,
        "step": int(step),
    }


@dataclass(frozen=True)
class LoadedAutoencoder:
    """An autoencoder checkpoint, validated: the model (eval mode, on its device, frozen), its config,
    the latent scale, and the file's sha256 (hex) and path."""

    model: Autoencoder
    config: AutoencoderConfig
    latent_scale: float
    sha256: str
    path: str

    def decoder(self) -> LatentDecoder:
        return LatentDecoder(self.model, self.latent_scale).eval()


def load_autoencoder(path: str | Path, *, device: torch.device | str) -> LoadedAutoencoder:
    """Read an autoencoder checkpoint once, validate everything, and build its model on ``device``.

    Refused with a one-line ValueError naming the path: a missing file or one over the size limit,
    a TorchScript archive, bytes torch cannot load with ``weights_only=True``, a DDPM checkpoint,
    another kind or format, a bad config, a latent scale that is not finite and positive, weights
    whose keys, shapes or dtypes do not match the config, non-finite weights.
    """
    name = f"autoencoder {path}"
    if not Path(path).exists():
        raise ValueError(f"{name} does not exist (train one with --mode train_autoencoder)")
    data = read_limited(path, kind="checkpoint")  # a regular file within the checkpoint size limit
    state = load_pt(data, source=name, kind="an autoencoder checkpoint")
    config, latent_scale = check_state(state, name=name)
    with torch.device("meta"):  # nothing allocated until the weights are known to fit the config
        model = Autoencoder(config)
    check_dense(state["state_dict"], source=name)
    load_weights(model, state["state_dict"], source=name, assign=True)
    if not all(bool(t.isfinite().all()) for t in model.state_dict().values()):
        raise ValueError(f"{name}: its weights hold NaN or inf")
    model = model.to(device).eval().requires_grad_(False)
    return LoadedAutoencoder(model, config, latent_scale, hashlib.sha256(data).hexdigest(), str(path))


def check_state(state: object, *, name: str) -> tuple[AutoencoderConfig, float]:
    """The config and latent scale of a loaded checkpoint dict; everything else in it checked too."""
    if not isinstance(state, dict):
        # A file's content is the user's mistake (exit 2): a ValueError, not a TypeError.
        raise ValueError(f"{name} holds a {type(state).__name__}, not an autoencoder checkpoint")  # noqa: TRY004
    if "kind" not in state and "model_config" in state:
        raise ValueError(
            f"{name} is a DDPM checkpoint (a U-Net), not an autoencoder; train one with --mode train_autoencoder"
        )
    if type(state.get("kind")) is not str or state["kind"] != KIND:
        raise ValueError(
            f"{name} is not an autoencoder checkpoint written by this tool (kind {short_repr(state.get('kind'))})"
        )
    missing = [key for key in REQUIRED_KEYS if key not in state]
    unknown = [key for key in state if key not in REQUIRED_KEYS and key not in OPTIONAL_KEYS]
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown entries {short_repr(unknown)}"
        raise ValueError(f"{name} {problem}; it was not written by this tool's --mode train_autoencoder")
    if type(state["format"]) is not int or state["format"] != FORMAT:
        raise ValueError(f"{name} has format {short_repr(state['format'])}; this tool reads format {FORMAT}")
    for key, kind in OPTIONAL_KEYS.items():
        if key in state and type(state[key]) is not kind:
            raise ValueError(f"{name}: its {key} is a {type(state[key]).__name__}, not a {kind.__name__}")
    try:
        config = AutoencoderConfig.from_dict(state["config"])
    except ValueError as exc:
        raise ValueError(f"{name}: its config is unusable ({first_line(exc)})") from exc
    scale = state["latent_scale"]
    if type(scale) is not float or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}: its latent scale must be a finite positive number, got {short_repr(scale)}")
    return config, scale


# --------------------------------------------------------------------------------------------
# Latents
# --------------------------------------------------------------------------------------------


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, H, W) -> float32 in [-1, 1], as data.ImageSet.batch scales training images."""
    return images.float().div_(127.5).sub_(1.0)


@torch.no_grad()
def posterior_means(model: Autoencoder, images: torch.Tensor, *, batch_size: int = 256) -> torch.Tensor:
    """The unscaled posterior means of uint8 (N, C, H, W) images, float32 (N, *latent_shape) on the CPU."""
    device = next(model.parameters()).device
    means = [
        model.encode(to_unit_range(chunk.to(device)))[0].float().cpu()  # sync: each batch comes back to the host
        for chunk in images.split(batch_size)
    ]
    return torch.cat(means) if means else torch.empty(0, *model.config.latent_shape)


def encode_images(loaded: LoadedAutoencoder, images: torch.Tensor, *, batch_size: int = 256) -> torch.Tensor:
    """uint8 (N, C, H, W) images -> float32 scaled latents (N, *latent_shape) on the CPU: the posterior
    mean times the latent scale (unit variance over the autoencoder's training set)."""
    config = loaded.config
    if images.dtype != torch.uint8 or images.ndim != 4 or tuple(images.shape[1:]) != config.image_shape:
        shape = "x".join(map(str, config.image_shape))
        found = f"{images.dtype} {'x'.join(map(str, images.shape[1:]))}"
        raise ValueError(f"{loaded.path} encodes uint8 {shape} images; got {found}")
    if batch_size < 1:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    return posterior_means(loaded.model, images, batch_size=batch_size).mul_(loaded.latent_scale)


@dataclass(frozen=True)
class FirstStage:
    """A latent model's autoencoder, loaded and checked: its decoder (scaled latents -> images in [-1, 1]),
    the latents' shape (C, h, w), the images' shape (C, H, W), and the link a checkpoint stores."""

    decoder: nn.Module
    latent_shape: tuple[int, ...]
    image_shape: tuple[int, ...]
    link: dict

    @property
    def io(self):
        """The decoder's I/O spec (unet_io.DecoderIO), read by its ONNX export and its engine build."""
        from ddpm.formats.unet_io import DecoderIO

        return DecoderIO(latent_shape=tuple(self.latent_shape), image_shape=tuple(self.image_shape))


def load_first_stage(path: str | Path, *, device: torch.device) -> tuple[FirstStage, object]:
    """(the first stage, the LoadedAutoencoder) of the autoencoder checkpoint at ``path``."""
    loaded = load_autoencoder(path, device=device)  # one-line ValueError for anything but an autoencoder
    link = {"path": str(Path(path).resolve()), "sha256": loaded.sha256}
    stage = FirstStage(loaded.decoder(), tuple(loaded.config.latent_shape), tuple(loaded.config.image_shape), link)
    return stage, loaded


def linked_first_stage(
    link: dict | None,
    *,
    model_config,
    source: str,
    device: torch.device,
    override: str | None = None,
    folder: str | Path | None = None,
) -> tuple[FirstStage | None, object]:
    """(the first stage, the LoadedAutoencoder) a latent model was trained with, at its stored path or at
    ``override`` (--autoencoder, for a moved file: its link then names the new path); refused unless its
    sha256 and latent shape are the model's. A pixel model (``link`` None) has none: (None, None), and an
    ``override`` is refused rather than ignored.

    The stored path is followed only inside ``folder`` (the checkpoint's folder and below), so a checkpoint cannot
    make the tool read any other file; outside it, --autoencoder must name the file."""
    if link is None:
        if override:
            raise ValueError(f"--autoencoder: {source} is a pixel model; it has no autoencoder to replace")
        return None, None
    path = override or link["path"]
    if not override and folder is not None and not Path(path).resolve().is_relative_to(Path(folder).resolve()):
        raise ValueError(
            f"{source} names its autoencoder at {path}, outside the checkpoint's folder (a file's links are followed "
            "only inside its folder); "
            f"pass --autoencoder {path} if it is the one"
        )
    if not Path(path).is_file():
        given = "--autoencoder" if override else "its autoencoder"
        problem = (
            "is missing"
            if not Path(path).exists()
            else "is a folder, not a checkpoint file"
            if Path(path).is_dir()
            else "is not a regular file"
        )
        raise ValueError(
            f"{source} is a latent model, and {given} {path} {problem}; pass --autoencoder with the autoencoder's "
            ".pt file"
        )
    stage, loaded = load_first_stage(path, device=device)
    if stage.link["sha256"] != link["sha256"]:
        raise ValueError(
            f"{source} was trained on the latents of another autoencoder than {path} (sha256 {link['sha256'][:12]}..., "
            f"this file {stage.link['sha256'][:12]}...); pass --autoencoder with the one it was trained with"
        )
    check_latent_unet(model_config, stage, source=source)
    return stage, loaded


def clips_x0(requested: bool, first_stage: FirstStage | None) -> bool:
    """Whether a sampling plan clips x0 to [-1, 1]: as asked for a pixel model, never for a latent model,
    whose latents have unit variance (a clip would cut real values)."""
    return requested and first_stage is None


def check_latent_unet(model_config, stage: FirstStage, *, source: str) -> None:
    """The U-Net must take the autoencoder's latents: same channels and side."""
    expected = stage.latent_shape
    found = model_config.sample_shape(1)[1:]
    if tuple(found) != tuple(expected):
        raise ValueError(
            f"{source}: its U-Net takes {'x'.join(map(str, found))} latents but the autoencoder makes "
            f"{'x'.join(map(str, expected))}"
        )


def encode_dataset(images, loaded, *, source: str):
    """The training set as scaled latents (an ImageSet of float32 (N, C, h, w)), encoded once, in memory."""
    expected = tuple(loaded.config.image_shape)
    found = tuple(images.images.shape[1:])
    if found != expected:
        raise ValueError(
            f"{source} encodes {'x'.join(map(str, expected))} images; the {images.name} data are "
            f"{'x'.join(map(str, found))} (match --img_size and --channels to the autoencoder's)"
        )
    latents = encode_images(loaded, images.images)  # (N, C, h, w) float32
    # No flips: a flipped image's latent is not the flipped latent.
    return replace(images, images=latents, hflip=False)
