"""What this device is, and where the fused U-Net runner is verified: the facts backends/selection.py chooses from.

    DeviceKind.of(torch.device("cpu"))   # DeviceKind(type="cpu", extension=True, capability="AVX2", native_bf16=False)
    runner_verified(device_type="cpu", precision="fp32", dims=2)   # True: cuda runs the fused U-Net runner there

A leaf module (it imports the extension only when asked about the device), so the selection of what draws
(backends/selection.py), the benchmark's rows and the distillation's teacher read the same facts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

# Where the cuda implementation runs the fused U-Net runner: (device type, precision, U-Net dims). Measured in
# BENCHMARKS.md, "The default path on an AVX2 CPU" and "The default path on an AVX-512 CPU" (fp32, 2-D; its
# Winograd convolutions only where they are faster: optimized_diffusion.winograd_is_fast) and
# "The default path on a GPU" (bf16, 2-D, against the eager U-Net in a CUDA graph and torch.compile in the same
# run; fp16 verified against the eager U-Net by the GPU tests, the same kernels in the other 16-bit type). Not on
# a GPU in fp32 nor for 3-D U-Nets there: verified against the eager U-Net by the GPU tests, never timed against
# the step kernels.
RUNNER_VERIFIED = frozenset({("cpu", "fp32", 2), ("cuda", "bf16", 2), ("cuda", "fp16", 2)})
# ... and in bf16 on a CPU that computes bf16 natively (AVX512-BF16 or AMX), its 3x3 convolutions in Winograd on bf16
# dot products: BENCHMARKS.md, "bf16 on a CPU that computes it". Where bf16 is emulated it is slower than fp32.
NATIVE_BF16_RUNNER = ("cpu", "bf16", 2)


def runner_verified(*, device_type: str, precision: str, dims: int, native_bf16: bool | None = None) -> bool:
    """Whether the cuda implementation uses the fused U-Net runner for this device, precision and U-Net.
    ``native_bf16``: whether this CPU computes bf16 in hardware (None: ask it)."""
    if (device_type, precision, dims) == NATIVE_BF16_RUNNER:
        from ddpm.util.precision import cpu_has_native_bf16

        return cpu_has_native_bf16() if native_bf16 is None else native_bf16
    return (device_type, precision, dims) in RUNNER_VERIFIED


def uses_runner(model, *, device_type: str, precision: str, native_bf16: bool | None = None) -> bool:
    """Whether ``cuda`` runs ``model`` through the fused U-Net runner: a PyTorch U-Net (the runner rebuilds one; a
    traced or exported graph never) where :func:`runner_verified` says so."""
    from basic_diffusion import UNet

    return isinstance(model, UNet) and runner_verified(
        device_type=device_type, precision=precision, dims=model.config.dims, native_bf16=native_bf16
    )


@dataclass(frozen=True)
class DeviceKind:
    """What the choice depends on besides the request: the device's type and what it has."""

    type: str  # "cpu" or "cuda"
    extension: bool  # the diffusion_kernels extension is built for it (no JIT compile on first use)
    capability: str = ""  # a CPU's vector capability as PyTorch names it ("AVX512", "AVX2")
    native_bf16: bool = False  # a CPU that computes bf16 in hardware (AVX512-BF16, AMX)
    bf16_forced: bool = False  # native_bf16 only by DDPM_NATIVE_BF16=1: the CPU emulates bf16 (lines say so)

    @classmethod
    def of(cls, device) -> DeviceKind:
        """This machine's ``device`` (a torch.device); loads the extension if it is built."""
        import torch

        from ddpm.util.precision import bf16_forced, cpu_has_native_bf16

        on_cpu = device.type == "cpu"
        capability = torch.backends.cpu.get_cpu_capability() if on_cpu else ""
        native = on_cpu and cpu_has_native_bf16()
        return cls(device.type, _extension_built(device.type), capability, native, native and bf16_forced())


def _extension_built(device_type: str) -> bool:
    if importlib.util.find_spec("_diffusion_kernels") is None:
        return False
    try:
        from ddpm.kernels import ops

        ops.load_extension(allow_jit=False)
        return device_type != "cuda" or ops.has_cuda_kernels()
    except ImportError:
        return False
