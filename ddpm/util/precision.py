"""Precision names, how "auto" resolves, the TF32/cuDNN policy, and a U-Net with autocast's mixed-precision policy
written into the model itself.

Strongly typed runtimes (TensorRT 11, TensorRT 10.12+, Torch-TensorRT 2.10+) take reduced precision from the
graph, not a flag. :func:`mixed_precision_unet` returns a copy of a U-Net whose modules cast explicitly, following
the policy PyTorch's autocast applies to this network:

* convolutions, linear layers and the attention matmuls run in the low precision (weights cast);
* the timestep embedding (``t * freqs``, ``sin``, ``cos``) and the time MLP stay in float32, since the phase
  of a large t is lost in fp16 or bf16;
* GroupNorm (its statistics and output) and the attention softmax run in float32;
* inputs and output stay float32, so the sampling loop around the model is unchanged.

Exported to ONNX (``--mode export --format onnx --precision fp16``) this gives a mixed-precision
graph that TensorRT 10.12+ and 11 build as it is.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import torch
from torch import nn

# The names (ddpm/choices.py): PRECISIONS autocast; QUANTIZED graphs (formats/quantization.py) are explicit Q/DQ
# ONNX files, exported and run, never trained or autocast.
from ddpm.choices import PRECISIONS, QUANTIZED

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware: AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake) or AMX
    (Intel Sapphire Rapids and later), where oneDNN's bf16 convolutions and the runner's bf16 Winograd GEMMs run on
    bf16 dot products; elsewhere bf16 is emulated. DDPM_NATIVE_BF16=0 or 1 in the environment overrides the
    answer (the test suite sets 0)."""
    import os

    forced = os.environ.get("DDPM_NATIVE_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return _hardware_bf16()


# What a line says of bf16 where DDPM_NATIVE_BF16=1 claims what the CPU lacks (bf16_forced).
FORCED_BF16 = "bf16 forced by DDPM_NATIVE_BF16=1; this CPU emulates it"


def bf16_forced() -> bool:
    """Whether cpu_has_native_bf16 says yes only because DDPM_NATIVE_BF16=1 says so: this CPU reports no bf16
    hardware and emulates it. Lines that say how bf16 runs then say FORCED_BF16, not the CPU's
    dot products."""
    import os

    return os.environ.get("DDPM_NATIVE_BF16", "").strip() == "1" and not _hardware_bf16()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later), whose bf16 convolutions oneDNN runs on
    them; False where torch cannot say."""
    import torch.cpu

    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return "amx_tile" in _cpuinfo_flags()


@functools.cache  # the CPU does not change under a running process; the choice and the runner ask several times
def _hardware_bf16() -> bool:
    import torch.cpu

    try:  # torch's own CPUID reading (private, but stable since 2.3); the kernel flags where it is gone
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return bool(_cpuinfo_flags() & {"avx512_bf16", "amx_bf16"})


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; ValueError naming the choices otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return precision


BF16_TRAINING_PIXELS = 28 * 28  # the smallest image trained in bf16 by default (resolve)


def resolve(requested: str, *, purpose: str, device: torch.device, pixels: int = 0) -> str:
    """The precision ``--precision`` names for ``purpose`` ("training", "distillation", "sampling" or "export"):
    "auto" is bf16 for training, distillation and sampling on a GPU that supports it; on a CPU that computes bf16
    natively (cpu_has_native_bf16) bf16 for sampling (kept only where the fused runner draws the file:
    backends/selection.select) and for training images of ``pixels`` >= 28x28 (BENCHMARKS.md, "bf16 on a CPU that
    computes it"); fp32 otherwise, and for export.
    int8 and fp8 are quantized graphs: exported (``purpose`` "export") and sampled, never trained."""
    if requested in QUANTIZED:
        if purpose in ("training", "distillation"):
            raise ValueError(
                f"--precision {requested} is for exported ONNX graphs (--mode export --format onnx); "
                "training runs in fp32, bf16 or fp16"
            )
        return requested
    if requested != "auto":
        return check_precision(requested)
    if purpose in ("training", "distillation", "sampling") and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    if device.type == "cpu" and (purpose == "sampling" or purpose == "training" and pixels >= BF16_TRAINING_PIXELS):
        if cpu_has_native_bf16():
            return "bf16"
    return "fp32"


@contextlib.contextmanager
def backend_policy(precision: str) -> Iterator[None]:
    """cuDNN autotuning on; TF32 off for fp32 (exact fp32), on for bf16/fp16. Restored on exit."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32)
    tf32 = precision != "fp32"
    cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = True, tf32, tf32
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = saved


def autocast(device_type: str, precision: str, *, cache_enabled: bool = True) -> torch.autocast:
    """The autocast context of ``precision`` on ``device_type`` (a disabled one for fp32)."""
    dtype = LOW_DTYPES.get(check_precision(precision), torch.float32)
    return torch.autocast(device_type, dtype=dtype, enabled=precision != "fp32", cache_enabled=cache_enabled)


def low_dtype(precision: str) -> torch.dtype:
    """The reduced-precision dtype of ``precision`` ("fp16" or "bf16")."""
    if precision not in LOW_DTYPES:
        raise ValueError(f"a mixed-precision model needs --precision fp16 or bf16, got {precision!r}")
    return LOW_DTYPES[precision]


class CastInput(nn.Module):
    """Runs ``inner`` (its parameters already in ``dtype``) on its input cast to ``dtype``."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = inner.to(dtype), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype))


class Float32(nn.Module):
    """Runs ``inner`` (float32 parameters) in float32; its output stays float32."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.float())


class MixedPrecisionUNet(nn.Module):
    """A U-Net copy in explicit mixed precision: float32 in and out, ``config`` kept for the I/O spec."""

    def __init__(self, unet: nn.Module, precision: str) -> None:
        super().__init__()
        self.unet, self.precision, self.config = unet, precision, unet.config

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        eps = self.unet(x, t) if y is None else self.unet(x, t, y)
        return eps.float()  # (B, C, H, W) float32, like the fp32 U-Net


def _cast_explicitly(module: nn.Module, dtype: torch.dtype, *, keep: set[int] = frozenset()) -> None:
    """Rewrite ``module`` in place by the policy above: convolutions and linear layers in ``dtype``
    (weights cast), GroupNorm in float32, attention softmax in float32; modules in ``keep`` (ids) and
    their children untouched."""
    for name, child in module.named_children():
        if id(child) in keep:
            continue
        if isinstance(child, (nn.Conv2d, nn.Conv3d, nn.Linear)):
            setattr(module, name, CastInput(child, dtype))
        elif isinstance(child, nn.GroupNorm):
            setattr(module, name, Float32(child))
        else:
            if hasattr(child, "float32_softmax"):  # basic_diffusion.AttentionBlock
                child.float32_softmax = True
            _cast_explicitly(child, dtype, keep=keep)


def mixed_precision_unet(model: nn.Module, precision: str) -> MixedPrecisionUNet:
    """A copy of ``model`` (a basic_diffusion.UNet) computing in ``precision`` by the policy above.

    The original is left unchanged. The copy is for export and compilation (its state dict has
    other keys); it runs in PyTorch too, which is how tests compare it with the exported graph.
    """
    dtype = low_dtype(precision)
    unet = copy.deepcopy(model).eval()
    _cast_explicitly(unet, dtype, keep=set(map(id, unet.time_mlp.modules())))  # the time MLP stays float32
    return MixedPrecisionUNet(unet, precision)


class MixedPrecisionDecoder(nn.Module):
    """A latent model's decoder copy in explicit mixed precision: float32 latents in, float32 images out."""

    def __init__(self, decoder: nn.Module, precision: str) -> None:
        super().__init__()
        self.decoder, self.precision = decoder, precision

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z).float()  # (B, C, H, W) float32, like the fp32 decoder


def mixed_precision_decoder(decoder: nn.Module, precision: str) -> MixedPrecisionDecoder:
    """A copy of a latent model's decoder (autoencoder.LatentDecoder) in ``precision`` by the same policy:
    its convolutions in the low precision, its GroupNorms in float32; the original is left unchanged."""
    dtype = low_dtype(precision)
    copied = copy.deepcopy(decoder).eval()
    _cast_explicitly(copied, dtype)
    return MixedPrecisionDecoder(copied, precision)
