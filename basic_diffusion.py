"""The U-Net denoiser, the DDPM training loss and the "original" sampling loop, in plain PyTorch.

The U-Net follows Ho et al. (2020): a sinusoidal time embedding fed through an MLP into every
residual block (GroupNorm, SiLU, dropout), multi-head self-attention at chosen resolutions,
skip connections between the down and up paths. :func:`sample` is the reference loop every faster
implementation is checked against.

    model = UNet(unet_preset("small", image_size=28, in_channels=1))
    images = sample(model, schedule.make_plan("ddim"), shape=(16, 1, 28, 28), generator=g)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ddpm.choices import PRESETS, TIME_CONDITIONING
from ddpm.conditioning import Guidance
from ddpm.util.phases import phase
from noise_schedule import MAX_LIST_ITEMS, NoiseSchedule, SamplingPlan, config_fields, guided_eps, p_step, short_repr

# Sane bounds of each integer setting (inclusive); ddpm_cifar10 is 128 channels, (1, 2, 2, 2), 2 blocks, 1 head.
UNET_BOUNDS = {
    "image_size": (1, 1024),
    "model_channels": (1, 512),
    "num_res_blocks": (1, 8),
    "num_heads": (1, 64),
    "norm_groups": (1, 256),
    "num_classes": (0, 1000),
    "patch_size": (1, 8),
}
MAX_LEVELS = 8  # entries of channel_mult
MAX_CHANNEL_MULT = 8
MAX_LATENT_CHANNELS = 64  # a latent model's U-Net takes its autoencoder's latent channels (autoencoder.py)


@dataclass(frozen=True)
class UNetConfig:
    """Shape of the denoiser. ``attention_resolutions`` are feature-map sizes in pixels.

    Valid values (checked at construction; :meth:`from_dict`, for configs read from files, also
    refuses unknown or missing keys and wrong types): ``in_channels`` 1 or 3 (1..64 for the U-Net of a
    latent model, whose file names its autoencoder: latent/autoencoder.py checks which); ``image_size``
    1..1024, divisible by 2 ** (levels - 1); ``model_channels`` 1..512; ``channel_mult`` 1..8
    levels, each 1..8; ``num_res_blocks`` 1..8; ``num_heads`` 1..64, dividing every attention
    width; ``norm_groups`` 1..256; ``attention_resolutions`` at most 16 sizes, each 1..image_size;
    ``dropout`` in [0, 1); ``num_classes`` 0..1000. Out-of-range values raise ValueError.

    ``num_classes`` > 0 makes a class-conditional U-Net: a label embedding (one row per class and a
    last, "null" row for "no label") is added to the time embedding, for classifier-free guidance.
    """

    # Fields that checkpoints written before them lack, and the value that reproduces those models.
    ADDED_LATER = {
        "num_classes": 0,
        "time_conditioning": "add",
        "dims": 2,
        "patch_size": 1,
        "flip_sin_to_cos": True,
        "freq_shift": 0,
        "norm_eps": 1e-5,
        "downsample_padding": 1,
    }

    image_size: int = 28
    in_channels: int = 1
    model_channels: int = 64
    channel_mult: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 2
    attention_resolutions: tuple[int, ...] = (7,)
    num_heads: int = 4
    dropout: float = 0.1
    norm_groups: int = 32
    num_classes: int = 0  # 0: unconditional
    # How a residual block takes the (time + label) embedding: "scale_shift" modulates the normalized
    # features, GroupNorm(h) * (1 + scale) + shift (Dhariwal & Nichol 2021), which reaches the output
    # whatever the group size; "add" adds it before the norm (Ho et al. 2020), where groups of one
    # channel cancel it (as the first level of a 32-channel U-Net with 32 groups does).
    time_conditioning: str = "scale_shift"
    dims: int = 2  # spatial dimensions: 2 (images, H x W) or 3 (volumes, D x H x W, all image_size)
    # Side of the patches folded into channels before the first convolution and unfolded after the last
    # (space-to-depth, as in Hoogeboom et al. 2023's "simple diffusion"); 1: none.
    patch_size: int = 1
    # Details in which published DDPMs differ (formats/diffusers_io.py maps diffusers' UNet2DModel onto these):
    # the sinusoidal time embedding as [cos, sin] (True) or [sin, cos], its frequencies exp(-ln(10^4) i / (half
    # - freq_shift)); GroupNorm's epsilon; downsampling convolutions padded 1 on every side (1) or, as Ho et
    # al.'s TensorFlow network, by one row and column after the image only (0).
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    norm_eps: float = 1e-5
    downsample_padding: int = 1

    @property
    def null_label(self) -> int:
        """The label meaning "no class" (the unconditional eps of a conditional model)."""
        return self.num_classes

    def __post_init__(self) -> None:
        # Tuples may arrive as lists from a checkpoint; normalize so equality and hashing work.
        object.__setattr__(self, "channel_mult", tuple(int(m) for m in self.channel_mult))
        object.__setattr__(self, "attention_resolutions", tuple(int(r) for r in self.attention_resolutions))
        if not (
            self.in_channels in (1, 3) or 1 <= self.in_channels <= MAX_LATENT_CHANNELS
        ):  # latents: see latent/autoencoder.py
            raise ValueError(
                f"channels must be 1 (grayscale), 3 (RGB) or a latent's 1 to {MAX_LATENT_CHANNELS}, got "
                f"{short_repr(self.in_channels)}"
            )
        levels = len(self.channel_mult)
        if not 1 <= levels <= MAX_LEVELS or not all(1 <= m <= MAX_CHANNEL_MULT for m in self.channel_mult):
            raise ValueError(
                f"channel_mult must be 1 to {MAX_LEVELS} integers between 1 and {MAX_CHANNEL_MULT}, "
                f"got {short_repr(list(self.channel_mult))}"
            )
        factor = 2 ** (len(self.channel_mult) - 1) * max(self.patch_size, 1)  # a bad patch size is named below
        if self.image_size < factor or self.image_size % factor:
            unit = "voxel" if self.dims == 3 else "pixel"
            patches = f" after {self.patch_size}-{unit} patches" if self.patch_size > 1 else ""
            raise ValueError(
                f"image size {self.image_size} cannot be downsampled {len(self.channel_mult) - 1} times{patches} by "
                "this U-Net: "
                f"use a multiple of {factor} (for example {max(factor, self.image_size // factor * factor)})"
            )
        for name, (low, high) in UNET_BOUNDS.items():
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be between {low} and {high}, got {short_repr(getattr(self, name))}")
        attention = self.attention_resolutions
        if len(attention) > MAX_LIST_ITEMS or not all(1 <= r <= self.image_size // self.patch_size for r in attention):
            raise ValueError(
                f"attention_resolutions must be at most {MAX_LIST_ITEMS} sizes between 1 and the image size "
                f"{self.image_size}, got {short_repr(list(attention))}"
            )
        if type(self.flip_sin_to_cos) is not bool:
            raise ValueError(f"flip_sin_to_cos must be true or false, got {short_repr(self.flip_sin_to_cos)}")
        if self.freq_shift not in (0, 1):
            raise ValueError(f"freq_shift must be 0 or 1, got {short_repr(self.freq_shift)}")
        if not 1e-12 <= self.norm_eps <= 1e-1:  # also False for NaN
            raise ValueError(f"norm_eps must be between 1e-12 and 0.1, got {short_repr(self.norm_eps)}")
        if self.downsample_padding not in (0, 1):
            raise ValueError(
                f"downsample_padding must be 0 (after the image only) or 1, got {short_repr(self.downsample_padding)}"
            )
        if not 0.0 <= self.dropout < 1.0:  # also False for NaN
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        widths = [self.model_channels * m for m in self.channel_mult]
        if self.dims not in (2, 3):
            raise ValueError(f"dims must be 2 (images) or 3 (volumes), got {short_repr(self.dims)}")
        if self.time_conditioning not in TIME_CONDITIONING:
            raise ValueError(
                f"time_conditioning must be one of {', '.join(TIME_CONDITIONING)}, got "
                f"{short_repr(self.time_conditioning)}"
            )
        if (
            self.num_classes
            and self.time_conditioning == "add"
            and all(math.gcd(self.norm_groups, w) == w for w in widths)
        ):
            # Each residual block adds the (time + label) embedding per channel and then normalizes groups of
            # one channel: the shift cancels, so the label could not reach the output.
            raise ValueError(
                f"a class-conditional U-Net needs a level with more channels than norm groups ({self.norm_groups}); "
                f"its widths are {widths}: use --model_channels 32 or more"
            )
        attended = [
            self.model_channels * m
            for m, r in zip(self.channel_mult, self.resolutions)
            if r in self.attention_resolutions
        ]
        attended.append(self.model_channels * self.channel_mult[-1])  # the middle block always attends
        if any(c % self.num_heads for c in attended):
            raise ValueError(
                f"attention widths {sorted(set(attended))} must divide by num_heads={self.num_heads}; "
                "pick --model_channels accordingly"
            )

    @classmethod
    def from_dict(cls, data: object) -> UNetConfig:
        """A model config read from a file: refuses unknown or missing keys, wrong types, bad ranges."""
        return cls(**config_fields(cls, data))

    def sample_shape(self, batch: int) -> tuple[int, ...]:
        """The U-Net's input shape for ``batch`` samples: (B, C, S, S) or (B, C, S, S, S)."""
        return (batch, self.in_channels, *[self.image_size] * self.dims)

    @property
    def resolutions(self) -> tuple[int, ...]:
        """Feature-map size at each level of the down path (after the patches are folded into channels)."""
        return tuple(self.image_size // self.patch_size // 2**level for level in range(len(self.channel_mult)))

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def build(self) -> UNet:
        """The U-Net of this config (ddpm/batch_memory.py builds one on the meta device to estimate a step)."""
        return UNet(self)


def unet_preset(name: str, *, image_size: int, in_channels: int, dims: int = 2, **overrides) -> UNetConfig:
    """Named configurations: "small" suits MNIST-size data (and, with ``dims=3``, volumes of 16, 32 or 64
    voxels a side); "ddpm_cifar10" is Ho et al.'s 35.7M network."""
    if name == "small" and dims == 3:
        # Volumes: 2-voxel patches from 32^3 up (the U-Net sees 8x fewer positions), then one residual block
        # per level down to 4 voxels a side, attention there only (4^3 = 64 positions); groups of 2+ channels.
        patch = overrides.get("patch_size") or (2 if image_size >= 32 else 1)
        inner = image_size // patch
        levels = max(1, int(math.log2(max(inner, 4) // 4)) + 1)
        mult = (1, 2, 2, 2, 4, 4)[:levels]
        base = dict(model_channels=16, channel_mult=mult, num_res_blocks=1, num_heads=4, dropout=0.0, norm_groups=8)
        base.update(patch_size=patch, attention_resolutions=(inner // 2 ** (levels - 1),))
    elif name == "small":
        # Down to a quarter of the side; small inputs (a latent model's 4x4 latents) stop at 2x2, where
        # GroupNorm still has more than one value per group at batch 1.
        mult = (1, 2, 2) if image_size >= 8 else (1, 2) if image_size >= 4 else (1,)
        base = dict(model_channels=64, channel_mult=mult, num_res_blocks=2, num_heads=4, dropout=0.1)
        base["attention_resolutions"] = (image_size // 2 ** (len(mult) - 1),)  # the lowest resolution
    elif name == "ddpm_cifar10" and dims == 2:
        base = dict(model_channels=128, channel_mult=(1, 2, 2, 2), num_res_blocks=2, num_heads=1, dropout=0.1)
        base["attention_resolutions"] = (16,) if image_size >= 16 else ()
        base["time_conditioning"] = "add"  # the paper's network (groups of 4+ channels keep the embedding)
    elif name == "ddpm_cifar10":
        raise ValueError("the ddpm_cifar10 preset is for images; volumes use the small preset")
    else:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    base.update({k: v for k, v in overrides.items() if v is not None})
    if name == "small" and dims == 2 and "norm_groups" not in base:
        base["norm_groups"] = small_norm_groups(base["model_channels"])
    return UNetConfig(image_size=image_size, in_channels=in_channels, dims=dims, **base)


def small_norm_groups(model_channels: int) -> int:
    """The small preset's GroupNorm groups: 32, but groups of 4 channels below 64 base channels, since one channel
    a group (an instance norm) removes each feature map's mean (BENCHMARKS.md, "Real digits")."""
    return 32 if model_channels >= 64 else max(1, model_channels // 4)


def timestep_embedding(
    t: torch.Tensor, dim: int, max_period: float = 10000.0, *, flip_sin_to_cos: bool = True, freq_shift: int = 0
) -> torch.Tensor:
    """Sinusoidal embedding of (B,) timesteps -> (B, dim), as in Transformer positional encodings:
    [cos, sin] of t * exp(-ln(max_period) * i / (dim // 2 - freq_shift)), or [sin, cos] (``flip_sin_to_cos=False``)."""
    half = dim // 2
    exponent = torch.arange(half, device=t.device, dtype=torch.float32) / (half - freq_shift)
    args = t.float()[:, None] * torch.exp(-math.log(max_period) * exponent)[None, :]
    pair = (torch.cos(args), torch.sin(args)) if flip_sin_to_cos else (torch.sin(args), torch.cos(args))
    emb = torch.cat(pair, dim=1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def _norm(channels: int, groups: int, eps: float = 1e-5) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(groups, channels), channels, eps=eps)


def norm_act(
    norm: nn.GroupNorm,
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    *,
    silu: bool = True,
) -> torch.Tensor:
    """``norm(x)``, then the time embedding's per-sample ``scale`` and ``shift`` (B, C) when given
    (``h * (1 + scale) + shift``), then SiLU: the norms of every block. A block's ``norm_act`` attribute holds the
    function it calls; a trainer may swap in a fused kernel of the same arithmetic (kernels/ops.py)."""
    h = norm(x)
    if scale is not None:
        spatial = (1,) * (h.ndim - 2)
        h = h * (1 + scale.view(*scale.shape, *spatial)) + shift.view(*shift.shape, *spatial)
    return F.silu(h) if silu else h


def norm_and_skip(
    block: ResBlock, x: torch.Tensor, x2: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a residual block computes from its input before its first convolution: the first norm (with SiLU) and
    the skip connection, both of x, or of x and x2's channels concatenated when x2 is given (the U-Net's up path).
    A block's ``norm_and_skip`` attribute holds the function it calls; a trainer may swap in one that computes both
    without building the concatenation (training/winograd.py)."""
    if x2 is not None:
        x = torch.cat([x, x2], dim=1)
    return block.norm_act(block.norm1, x), block.skip(x)


def conv_nd(dims: int, *args, **kwargs) -> nn.Module:
    """nn.Conv2d for images, nn.Conv3d for volumes: every block is written once for both."""
    return (nn.Conv2d if dims == 2 else nn.Conv3d)(*args, **kwargs)


class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> conv, take the time embedding, GroupNorm -> SiLU -> dropout -> conv.

    The embedding enters as a per-channel scale and shift of the second norm's output
    (``scale_shift``) or as a per-channel bias added before it (``add``).
    """

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        *,
        emb_dim: int,
        dropout: float,
        groups: int,
        scale_shift: bool = True,
        dims: int = 2,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.scale_shift = scale_shift
        self.norm1 = _norm(in_ch, groups, eps)
        self.conv1 = conv_nd(dims, in_ch, out_ch, 3, padding=1)
        self.emb_proj = nn.Linear(emb_dim, 2 * out_ch if scale_shift else out_ch)
        self.norm2 = _norm(out_ch, groups, eps)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = conv_nd(dims, out_ch, out_ch, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)  # each block starts as the identity
        nn.init.zeros_(self.conv2.bias)
        self.skip = conv_nd(dims, in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()
        self.norm_act = norm_act
        self.norm_and_skip = norm_and_skip

    def forward(self, x: torch.Tensor, emb: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, in, ...), or x and x2 whose channels together are ``in`` (the up path's skip connection)."""
        h, skipped = self.norm_and_skip(self, x, x2)
        h = self.conv1(h)  # (B, out, H, W) or (B, out, D, H, W)
        e = self.emb_proj(F.silu(emb))  # (B, 2*out) or (B, out)
        if self.scale_shift:
            scale, shift = e.chunk(2, dim=1)
            h = self.norm_act(self.norm2, h, scale, shift)
        else:
            h = self.norm_act(self.norm2, h + e.view(*e.shape, *[1] * (h.ndim - 2)))
        h = self.conv2(self.dropout(h))
        return skipped + h


class AttentionBlock(nn.Module):
    """Multi-head self-attention over the H*W (or D*H*W) positions, with a residual connection."""

    def __init__(self, channels: int, *, num_heads: int, groups: int, dims: int = 2, eps: float = 1e-5) -> None:
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"attention channels {channels} are not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        # True in precision.mixed_precision_unet: the softmax in float32 (as autocast does), the
        # matmuls in the low precision. Otherwise one fused scaled_dot_product_attention.
        self.float32_softmax = False
        self.norm = _norm(channels, groups, eps)
        self.qkv = conv_nd(dims, channels, 3 * channels, 1)
        self.proj = conv_nd(dims, channels, channels, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.norm_act = norm_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, *spatial = x.shape
        heads, n = self.num_heads, math.prod(spatial)
        qkv = self.qkv(self.norm_act(self.norm, x, silu=False))  # (B, 3C, *spatial)
        # A channels-last qkv is (B, HW, 3, heads, C/heads) in memory: its heads are views, not a copy of it.
        channels_last = qkv.dim() == 4 and qkv.is_contiguous(memory_format=torch.channels_last)
        if channels_last:
            q, k, v = (t.transpose(1, 2) for t in qkv.permute(0, 2, 3, 1).reshape(B, n, 3, heads, C // heads).unbind(2))
        else:
            q, k, v = qkv.reshape(B, 3, heads, C // heads, n).transpose(-1, -2).unbind(1)
        # q, k, v: each (B, heads, HW, C/heads)
        if self.float32_softmax:
            scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # (B, heads, HW, HW)
            h = scores.softmax(dim=-1).to(v.dtype) @ v
        else:
            h = F.scaled_dot_product_attention(q, k, v)  # (B, heads, HW, C/heads)
        if channels_last:
            h = h.transpose(1, 2).reshape(B, *spatial, C).permute(0, 3, 1, 2)  # channels-last, as x
        else:
            h = h.transpose(-1, -2).reshape(B, C, *spatial)
        return x + self.proj(h)


class Downsample(nn.Module):
    """A stride-2 3x3 convolution, padded 1 on every side or (``padding=0``) by one after the image only."""

    def __init__(self, channels: int, dims: int = 2, padding: int = 1) -> None:
        super().__init__()
        self.conv = conv_nd(dims, channels, channels, 3, stride=2, padding=padding)
        self.pad_after = (0, 1) * dims if padding == 0 else None

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution's input: ``x``, or ``x`` with one more row and column (and slice) of zeros."""
        return x if self.pad_after is None else F.pad(x, self.pad_after)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.padded(x))


class Upsample(nn.Module):
    def __init__(self, channels: int, dims: int = 2) -> None:
        super().__init__()
        self.conv = conv_nd(dims, channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution of the U-Net: residual blocks, each optionally followed by attention."""

    def __init__(self, blocks: list[ResBlock], attentions: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.attentions = nn.ModuleList(attentions)


class UNet(nn.Module):
    """eps_theta(x_t, t[, y]): predicts the noise in ``x_t`` (B, C, H, W) at timesteps ``t`` (B,) and, for a
    class-conditional config, labels ``y`` (B,) int64 (``config.null_label``: unconditional)."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        ch, groups = config.model_channels, config.norm_groups
        emb_dim = 4 * ch
        self.time_mlp = nn.Sequential(nn.Linear(ch, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        # Class labels, and the null label, as embeddings added to the time embedding.
        self.label_embedding = nn.Embedding(config.num_classes + 1, emb_dim) if config.num_classes else None
        dims = config.dims
        folded = config.in_channels * config.patch_size**dims  # channels after space-to-depth
        self.conv_in = conv_nd(dims, folded, ch, 3, padding=1)
        # Activation checkpointing of the residual blocks in training (training/trainer.py sets it): recompute
        # their activations in the backward pass to save memory.
        self.grad_checkpoint = False

        def block(i: int, o: int) -> ResBlock:
            return ResBlock(
                i,
                o,
                emb_dim=emb_dim,
                dropout=config.dropout,
                groups=groups,
                scale_shift=config.time_conditioning == "scale_shift",
                dims=dims,
                eps=config.norm_eps,
            )

        def attention(c: int, resolution: int) -> nn.Module:
            if resolution in config.attention_resolutions:
                return AttentionBlock(c, num_heads=config.num_heads, groups=groups, dims=dims, eps=config.norm_eps)
            return nn.Identity()

        # Down path: remember every output's channel count for the skip connections.
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        skip_channels, cur = [ch], ch
        for level, (mult, res) in enumerate(zip(config.channel_mult, config.resolutions)):
            blocks, attns = [], []
            for _ in range(config.num_res_blocks):
                blocks.append(block(cur, ch * mult))
                cur = ch * mult
                attns.append(attention(cur, res))
                skip_channels.append(cur)
            self.down.append(Level(blocks, attns))
            last = level == len(config.channel_mult) - 1
            self.downsample.append(nn.Identity() if last else Downsample(cur, dims, config.downsample_padding))
            if not last:
                skip_channels.append(cur)

        self.mid_block1 = block(cur, cur)
        self.mid_attention = AttentionBlock(
            cur, num_heads=config.num_heads, groups=groups, dims=dims, eps=config.norm_eps
        )
        self.mid_block2 = block(cur, cur)

        # Up path: one more block per level than the down path, each eating one skip.
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for level in reversed(range(len(config.channel_mult))):
            mult, res = config.channel_mult[level], config.resolutions[level]
            blocks, attns = [], []
            for _ in range(config.num_res_blocks + 1):
                blocks.append(block(cur + skip_channels.pop(), ch * mult))
                cur = ch * mult
                attns.append(attention(cur, res))
            self.up.append(Level(blocks, attns))
            self.upsample.append(Upsample(cur, dims) if level > 0 else nn.Identity())

        self.norm_out = _norm(cur, groups, config.norm_eps)
        self.conv_out = conv_nd(dims, cur, folded, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)
        self.norm_act = norm_act

    def embedding(self, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """The (B, 4ch) embedding every residual block takes: the time MLP's, plus the label's when conditional."""
        c = self.config
        sinusoids = timestep_embedding(t, c.model_channels, flip_sin_to_cos=c.flip_sin_to_cos, freq_shift=c.freq_shift)
        emb = self.time_mlp(
            sinusoids.to(self.time_mlp[0].weight.dtype)
        )  # (B, 4ch); a float64 reference model runs in float64
        if self.label_embedding is not None:
            if y is None:
                raise ValueError("this U-Net is class-conditional: pass labels y (B,), or its null label")
            emb = emb + self.label_embedding(y)
        elif y is not None:
            raise ValueError("this U-Net is unconditional: it takes no labels")
        return emb

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.embedding(t, y)  # (B, 4ch)
        run = self._checkpointed if self.grad_checkpoint and self.training and torch.is_grad_enabled() else _call
        p = self.config.patch_size
        h = self.conv_in(space_to_depth(x, p) if p > 1 else x)
        skips = [h]
        for level, down in zip(self.down, self.downsample):
            for blk, attn in zip(level.blocks, level.attentions):
                h = attn(run(blk, h, emb))
                skips.append(h)
            if not isinstance(down, nn.Identity):
                h = down(h)
                skips.append(h)
        h = run(self.mid_block2, self.mid_attention(run(self.mid_block1, h, emb)), emb)
        for level, up in zip(self.up, self.upsample):
            for blk, attn in zip(level.blocks, level.attentions):
                h = attn(run(blk, h, emb, skips.pop()))
            h = up(h)
        out = self.conv_out(self.norm_act(self.norm_out, h))
        return depth_to_space(out, p) if p > 1 else out  # x's shape

    @staticmethod
    def _checkpointed(
        block: nn.Module, h: torch.Tensor, emb: torch.Tensor, skip: torch.Tensor | None = None
    ) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block, h, emb, skip, use_reentrant=False)


def _call(block: nn.Module, h: torch.Tensor, emb: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
    return block(h, emb, skip)


def space_to_depth(x: torch.Tensor, p: int) -> torch.Tensor:
    """Folds each p x p (x p) patch into channels: (B, C, S1, .., Sd) -> (B, C * p^d, S1/p, .., Sd/p)."""
    c, sizes = x.shape[1], x.shape[2:]
    d = len(sizes)
    x = x.reshape(-1, c, *[n for s in sizes for n in (s // p, p)])  # (B, C, S1/p, p, .., Sd/p, p)
    x = x.permute(0, 1, *range(3, 3 + 2 * d, 2), *range(2, 2 + 2 * d, 2))  # (B, C, p, .., p, S1/p, .., Sd/p)
    return x.reshape(-1, c * p**d, *[s // p for s in sizes])


def depth_to_space(x: torch.Tensor, p: int) -> torch.Tensor:
    """The inverse of :func:`space_to_depth`: (B, C * p^d, S1, .., Sd) -> (B, C, S1 * p, .., Sd * p)."""
    sizes = x.shape[2:]
    d = len(sizes)
    c = x.shape[1] // p**d
    x = x.reshape(-1, c, *[p] * d, *sizes)  # (B, C, p, .., p, S1, .., Sd)
    x = x.permute(0, 1, *[n for i in range(d) for n in (2 + d + i, 2 + i)])  # (B, C, S1, p, .., Sd, p)
    return x.reshape(-1, c, *[s * p for s in sizes])


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def diffusion_loss(
    model: nn.Module,
    schedule: NoiseSchedule,
    x_start: torch.Tensor,
    *,
    t: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    min_snr_gamma: float | None = None,
) -> torch.Tensor:
    """The DDPM objective at a uniform t: the mean of :func:`per_sample_losses`, each sample's MSE between the
    U-Net's output and its target (the noise, or the velocity or x_0 for a schedule whose ``prediction`` says so:
    ``NoiseSchedule.training_target``).

    ``t`` (B,) and ``noise`` (like ``x_start``) are drawn from ``generator``, t first, unless given
    (the trainer draws them for a whole global batch and passes each rank its rows). ``y`` (B,):
    the labels of a class-conditional model.

    ``min_snr_gamma=None`` is Ho et al.'s simplified (unweighted) loss; a number gamma applies Min-SNR weighting
    (Hang et al. 2023, ``NoiseSchedule.loss_weights``).
    """
    if t is None:
        t = torch.randint(0, schedule.num_timesteps, (x_start.shape[0],), device=x_start.device, generator=generator)
    losses = per_sample_losses(
        model, schedule, x_start, t, noise=noise, y=y, generator=generator, min_snr_gamma=min_snr_gamma
    )
    return losses.mean()


def per_sample_losses(
    model: nn.Module,
    schedule: NoiseSchedule,
    x_start: torch.Tensor,
    t: torch.Tensor,
    *,
    noise: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    min_snr_gamma: float | None = None,
) -> torch.Tensor:
    """Each sample's output MSE at its timestep ``t`` (B,), min-SNR weighted when gamma is given: (B,).
    ``noise`` is drawn from ``generator`` unless given."""
    if noise is None:
        noise = torch.randn(x_start.shape, device=x_start.device, generator=generator, dtype=x_start.dtype)
    x_t = schedule.q_sample(x_start, t, noise)
    target = schedule.training_target(x_start, noise, t).float()
    losses = (eps_of(model, x_t, t, y).float() - target).pow(2).flatten(1).mean(1)  # (B,)
    return losses if min_snr_gamma is None else losses * schedule.loss_weights(t, min_snr_gamma=min_snr_gamma)


def eps_of(model: nn.Module, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """The model's eps: called as ``model(x_t, t)``, with ``y`` only for a class-conditional model (so a
    traced or exported unconditional U-Net keeps its two inputs)."""
    return model(x_t, t) if y is None else model(x_t, t, y)


def guided_model_eps(model: nn.Module, x: torch.Tensor, t: torch.Tensor, guidance: Guidance | None) -> torch.Tensor:
    """eps for one step: the plain U-Net, or a conditional one with its labels and guidance (float32)."""
    if guidance is None:
        return model(x, t).float()
    if not guidance.doubled:
        return model(x, t, guidance.labels).float()
    eps_pair = model(torch.cat([x, x]), torch.cat([t, t]), guidance.model_labels())  # (2B, C, H, W)
    return guided_eps(eps_pair, guidance.scale)


@torch.no_grad()
def sample(
    model: nn.Module,
    plan: SamplingPlan,
    *,
    shape: tuple[int, int, int, int],
    generator: torch.Generator,
    progress: bool = False,
    guidance: Guidance | None = None,
) -> torch.Tensor:
    """Draw images (B, C, H, W) in [-1, 1] by running ``plan`` from pure noise, one step at a time.

    Noise is drawn from ``generator`` in a fixed order (x_T first, then one tensor per stochastic
    step), which the other implementations reproduce to give the same images from the same seed.
    A class-conditional model draws the classes of ``guidance`` (see :class:`Guidance`).
    """
    device = plan.coefficients.device
    B = shape[0]
    guidance = guidance.to(device) if guidance is not None else None
    x = torch.randn(shape, generator=generator, device=device)  # x_T ~ N(0, I)
    prev_xstart = None
    for i in tqdm(range(plan.num_steps), desc=f"sampling ({plan.sampler})", disable=not progress, leave=False):
        t = plan.timesteps[i].expand(B)
        with phase("unet"):
            eps = guided_model_eps(model, x, t, guidance)
        with phase("noise"):
            noise = torch.randn(shape, generator=generator, device=device) if plan.noise_steps[i] else None
        with phase("step"):
            x, prev_xstart = p_step(
                plan, i, x, eps, noise=noise, prev_xstart=prev_xstart if plan.uses_prev_xstart else None
            )
    return x
