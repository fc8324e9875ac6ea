"""The U-Net's interface as its exported forms see it: the I/O spec and the metadata every artifact carries.

The interface is defined once, in :class:`UNetIO`: inputs ``x_t`` (B, C, H, W) float32 and ``t``
(B,) int64 (and, for a class-conditional U-Net, ``y`` (B,) int64 labels, its null label included),
output ``eps`` (B, C, H, W) float32, the batch B being the one dynamic axis; a
:class:`BatchRange` gives the (min, opt, max) batch sizes of a TensorRT optimization profile. The
ONNX export (formats/exporters.py), onnxruntime (backends/runtimes.py) and the engine build (tensorrt_integration.py)
all read it. A latent model's decoder has its own, :class:`DecoderIO` (``latents`` in, ``images``
out); both share :class:`IOSpec`'s names, shapes and optimization profile.

Every artifact carries what sampling needs besides the weights (:func:`artifact_metadata`: model
and schedule configs, which weights, the I/O spec): ONNX files in ``metadata_props``, TorchScript
files in an extra file, TensorRT engines in a JSON sidecar; checkpoints.parse_artifact_metadata
validates it on load. The ONNX opsets this tool writes and reads are chosen here too (:func:`check_opset`).
This module imports nothing of the project's: every format stands on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ddpm.choices import DEFAULT_MAX_BATCH, ONNX_OPSETS


class UNetShape(Protocol):
    """What the I/O spec and the metadata read of a U-Net's config (basic_diffusion.UNetConfig): this module
    stands below the U-Net, so it names the fields it reads, not the class."""

    in_channels: int
    image_size: int
    num_classes: int
    dims: int

    def to_dict(self) -> dict: ...


ARTIFACT_FORMAT = "ddpm-unet/1"
METADATA_KEY = "ddpm"  # ONNX metadata_props key; TorchScript extra file "ddpm.json"
BATCH = "batch"  # the name of the dynamic axis
DEFAULT_OPT_BATCH = 16  # the batch an engine is tuned for (the CLI's default --n_samples)


# --------------------------------------------------------------------------------------------
# The I/O spec
# --------------------------------------------------------------------------------------------


# Opset 21 is the first whose GroupNormalization takes per-channel scale and bias, and the one at
# which the exporter emits GroupNormalization natively; opsets 18-20 get an InstanceNormalization
# decomposition instead (use --opset 18 for a TensorRT parser without GroupNormalization-21).
# MAX_OPSET is the newest that torch.onnx's dynamo exporter writes for this U-Net and onnxruntime runs; at 26 the
# exporter's version conversion fails (no Attention adapter from 22).
DEFAULT_OPSET = ONNX_OPSETS["default"]
BF16_MIN_OPSET = ONNX_OPSETS["bf16"]  # ONNX allows bfloat16 convolutions and GroupNormalization from opset 22
MIN_OPSET = 18
MAX_OPSET = 25


def check_opset(opset: int, *, precision: str = "fp32") -> None:
    """``--opset`` must be one the exporter writes for this U-Net and onnxruntime runs (22 or later
    for a bf16 graph)."""
    if type(opset) is not int or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(
            f"--opset must be between {MIN_OPSET} (GroupNormalization) and {MAX_OPSET} (the newest the exporter "
            f"and onnxruntime support here), got {repr(opset)[:40]}"
        )
    if precision == "bf16" and opset < BF16_MIN_OPSET:
        raise ValueError(
            f"a bf16 ONNX graph needs --opset {BF16_MIN_OPSET} or later (bfloat16 convolutions), got {opset}"
        )


def default_opset(precision: str = "fp32") -> int:
    """The opset an export uses when --opset is not given: 21, or 22 for a bf16 graph."""
    return BF16_MIN_OPSET if precision == "bf16" else DEFAULT_OPSET


@runtime_checkable
class FromOnnxFile(Protocol):
    """A module that runs an ONNX file (backends/runtimes.py's onnxruntime U-Net and decoder):
    ``onnx_path`` names the file (None for a graph made in memory), so an engine can be built from it."""

    onnx_path: Path | None


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, dtype and shape, with :data:`BATCH` marking the dynamic axis."""

    name: str
    dtype: torch.dtype
    shape: tuple[int | str, ...]

    def concrete(self, batch_size: int) -> tuple[int, ...]:
        return tuple(batch_size if d == BATCH else int(d) for d in self.shape)

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.shape)}


@dataclass(frozen=True)
class BatchRange:
    """Batch sizes an engine accepts: the (min, opt, max) of its optimization profile; opt is tuned for."""

    min: int = 1
    opt: int = DEFAULT_OPT_BATCH
    max: int = DEFAULT_MAX_BATCH

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"batch sizes need 1 <= min <= opt <= max, got ({self.min}, {self.opt}, {self.max})")

    @classmethod
    def covering(cls, batch_size: int, *, max_batch: int) -> BatchRange:
        """The profile 1 .. max_batch, widened to ``batch_size`` if that is larger."""
        if batch_size < 1 or max_batch < 1:
            raise ValueError(f"batch sizes must be positive, got {batch_size} and --max_batch {max_batch}")
        top = max(max_batch, batch_size)
        return cls(min=1, opt=min(DEFAULT_OPT_BATCH, top), max=top)

    def __contains__(self, batch_size: int) -> bool:
        return self.min <= batch_size <= self.max

    def to_list(self) -> list[int]:
        return [self.min, self.opt, self.max]


class IOSpec:
    """What every I/O spec derives from its ``inputs`` and ``outputs``: names, shapes at a batch size,
    a TensorRT optimization profile and the dynamic batch axes for torch.onnx.export."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.inputs + self.outputs

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [spec.name for spec in self.outputs]

    def shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape at one batch size."""
        return {spec.name: spec.concrete(batch_size) for spec in self.tensors}

    def profile(self, batch: BatchRange) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) shapes of each input: a TensorRT optimization profile."""
        return {spec.name: tuple(spec.concrete(b) for b in batch.to_list()) for spec in self.inputs}

    def torch_dynamic_shapes(self) -> tuple[dict[int, torch.export.Dim], ...]:
        """The batch axis of each input as one shared ``torch.export.Dim`` (for torch.onnx.export)."""
        batch = torch.export.Dim(BATCH, min=1)
        return tuple({spec.shape.index(BATCH): batch} for spec in self.inputs)

    def to_dict(self) -> dict:
        return {"inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs]}


@dataclass(frozen=True)
class UNetIO(IOSpec):
    """The U-Net's inputs and outputs: the one definition read by the ONNX export and the engine build."""

    in_channels: int
    image_size: int
    num_classes: int = 0  # > 0: a class-conditional U-Net, which also takes labels y
    dims: int = 2  # 3: volumes, x_t and eps are (B, C, S, S, S)

    @classmethod
    def from_config(cls, config: UNetShape) -> UNetIO:
        return cls(
            in_channels=config.in_channels,
            image_size=config.image_size,
            num_classes=config.num_classes,
            dims=config.dims,
        )

    @property
    def image(self) -> tuple:
        """x_t's and eps's shape: (BATCH, C, S, S) or (BATCH, C, S, S, S)."""
        return (BATCH, self.in_channels, *[self.image_size] * self.dims)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        image = self.image
        specs = (TensorSpec("x_t", torch.float32, image), TensorSpec("t", torch.int64, (BATCH,)))
        return specs + ((TensorSpec("y", torch.int64, (BATCH,)),) if self.num_classes else ())

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("eps", torch.float32, self.image),)

    def example_inputs(
        self, batch_size: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, ...]:
        """Random (x_t, t[, y]): x_t ~ N(0, I) (B, C, H, W), t uniform in [0, 1000) (B,) and, for a
        conditional U-Net, y uniform over its labels and the null label (B,)."""
        x_t = torch.randn(self.inputs[0].concrete(batch_size), generator=generator).to(device)
        t = torch.randint(0, 1000, (batch_size,), generator=generator).to(device)
        if not self.num_classes:
            return x_t, t
        return x_t, t, torch.randint(0, self.num_classes + 1, (batch_size,), generator=generator).to(device)


@dataclass(frozen=True)
class DecoderIO(IOSpec):
    """A latent model's decoder (latent/autoencoder.py): ``latents`` (B, c, h, w) float32 in, ``images`` (B, C, H, W)
    float32 out; read by its ONNX export and its engine build like :class:`UNetIO`."""

    latent_shape: tuple[int, ...]
    image_shape: tuple[int, ...]

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latents", torch.float32, (BATCH, *self.latent_shape)),)

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("images", torch.float32, (BATCH, *self.image_shape)),)


# --------------------------------------------------------------------------------------------
# Metadata, hashes, comparison
# --------------------------------------------------------------------------------------------


def artifact_metadata(*, model_config: UNetShape, schedule_config: object | None, weights: str | None, **extra) -> dict:
    """What an artifact carries besides its weights, as plain JSON data (``weights``: "ema" or "model";
    ``schedule_config``: noise_schedule.ScheduleConfig, a dataclass)."""
    return {
        "format": ARTIFACT_FORMAT,
        "model_config": model_config.to_dict(),
        "schedule_config": asdict(schedule_config) if schedule_config is not None else None,
        "weights": weights,
        "io": UNetIO.from_config(model_config).to_dict(),
        **extra,
    }


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(model: nn.Module) -> str:
    """A fingerprint of a model's weights and buffers (names, dtypes, shapes and values)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        # sync: each tensor comes to the host once, to be hashed.
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def max_abs_diff(
    candidate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reference: nn.Module,
    *,
    io: UNetIO,
    batch_sizes: Sequence[int] = (1, 3),
    seed: int = 0,
) -> float:
    """Largest |eps_candidate - eps_reference| over random inputs at each batch size."""
    generator = torch.Generator().manual_seed(seed)
    device = next(reference.parameters()).device
    worst = 0.0
    with torch.no_grad():
        for batch_size in batch_sizes:
            inputs = io.example_inputs(batch_size, generator=generator, device=device)  # (x_t, t[, y])
            diff = (candidate(*inputs).float() - reference(*inputs).float()).abs().max()
            worst = max(worst, diff.item())  # sync: one number per batch size
    return worst
