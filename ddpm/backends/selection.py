"""What draws: the one decision of the implementation, its precision and whether ``cuda`` runs the fused U-Net runner.

    selection = select(DeviceKind.of(device), artifact, request)   # once, after the model file is read
    selection.line   # implementation: cuda in fp32 (fused U-Net runner, Winograd convolutions; the fastest ...)
    draw = opened.drawer(plan, selection)   # its options (selection.options()): precision, fused_unet, compile

:func:`select` is the only place that decides; everything after it (the drawer, the sampler's build) reads the
Selection (registry.Selection). :func:`check_request` refuses, while the flags resolve and before any file is
read, what no implementation would run (a file kind, a precision), from the same registry entries :func:`select`
checks.

The tables it decides from: :data:`VERIFIED` (``--implementation auto``: on each kind of device, for these
precisions and models, the implementation to run, why, and the BENCHMARKS.md section its measurement is in; the
first entry that matches and whose implementation runs the file wins, else the first sample-mode implementation
that runs it, and the line says so) and backends/verified.RUNNER_VERIFIED (where ``cuda`` includes the fused U-Net
runner, optimized_diffusion.FusedUNet: where it was measured faster than the step kernels alone, which are always
available as ``cuda_steps``). :func:`choose` and :func:`select` are pure functions of their arguments (tests hand
them fake devices); verified.DeviceKind.of is the only part that looks at the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ddpm.backends.registry import Selection
from ddpm.backends.verified import DeviceKind, runner_verified, uses_runner
from ddpm.util.precision import FORCED_BF16

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Verified:
    """One row of the table: on ``device``, for these precisions, kinds and U-Net dims, use ``implementation``."""

    device: str
    precisions: tuple[str, ...]
    implementation: str
    why: str
    evidence: str  # the BENCHMARKS.md section the choice rests on
    kinds: tuple[str, ...] = ("checkpoint",)
    dims: tuple[int, ...] = (2, 3)
    capabilities: tuple[str, ...] | None = None  # a CPU's vector capabilities it covers (None: any)
    native_bf16: bool = False  # only on a CPU that computes bf16 in hardware
    faster_than_fp32: bool = True  # False: verified to run, but slower than fp32 here (not auto precision's choice)
    forced_why: str = ""  # native_bf16 entries: the why where DDPM_NATIVE_BF16=1 forced bf16 on a CPU emulating it

    def why_on(self, device: DeviceKind) -> str:
        """The reason the line gives on ``device``: a native-bf16 entry forced on a CPU that emulates bf16 does not
        claim the CPU's bf16 hardware."""
        return self.forced_why if self.native_bf16 and device.bf16_forced else self.why

    def matches(self, device: DeviceKind, *, precision: str, kind: str, dims: int) -> bool:
        return (
            device.type == self.device
            and device.extension  # every entry is a custom-kernel path
            and (self.capabilities is None or device.capability in self.capabilities)
            and (device.native_bf16 or not self.native_bf16)
            and precision in self.precisions
            and kind in self.kinds
            and dims in self.dims
        )


VERIFIED: tuple[Verified, ...] = (
    Verified(
        "cpu",
        ("bf16",),
        "cuda",
        "fused U-Net runner in bf16, Winograd convolutions on the CPU's bf16 dot products; the fastest verified on a "
        "CPU with native bf16",
        evidence="BENCHMARKS.md: 'bf16 on a CPU that computes it'",
        dims=(2,),
        native_bf16=True,
        forced_why=f"fused U-Net runner in bf16, Winograd convolutions; {FORCED_BF16}",
    ),
    Verified(
        "cpu",
        ("fp32",),
        "cuda",
        "fused U-Net runner, Winograd convolutions; the fastest verified on an AVX-512 CPU",
        evidence="BENCHMARKS.md: 'The default path on an AVX-512 CPU: the quick plan'",
        dims=(2,),
        capabilities=("AVX512",),
    ),
    Verified(
        "cpu",
        ("fp32",),
        "cuda",
        "fused U-Net runner, oneDNN convolutions (Winograd's are slower without AVX-512); the fastest verified on an "
        "AVX2 CPU",
        evidence="BENCHMARKS.md: 'The default path on an AVX2 CPU, against the runtimes a user would pick'",
        dims=(2,),
        capabilities=("AVX2",),
    ),
    Verified(
        "cuda",
        ("bf16", "fp16"),
        "cuda",
        "fused U-Net runner in a CUDA graph (NHWC, one-pass GroupNorm kernels, weights cast once); the fastest "
        "verified on a GPU, torch.compile's build time counted",
        evidence="BENCHMARKS.md: 'The default path on a GPU, against torch.compile'",
        dims=(2,),
    ),
    Verified(
        "cuda",
        ("fp32", "bf16", "fp16"),
        "cuda",
        "fused step kernels in a CUDA graph around the eager U-Net; the fused U-Net runner is verified on a GPU for "
        "2-D U-Nets in bf16 and fp16 only",
        evidence="BENCHMARKS.md: 'The default path on a GPU, against torch.compile'",
        kinds=("checkpoint", "torchscript"),
    ),
    Verified(
        "cpu",
        ("bf16", "fp16"),
        "cuda",
        "fused step kernels under autocast; the original runs fp32 only",
        evidence="BENCHMARKS.md: 'Lower precision against fp32 on a CPU'",
        kinds=("checkpoint", "torchscript"),
        faster_than_fp32=False,
    ),
)


def choose(
    device: DeviceKind,
    *,
    precision: str,
    kind: str = "checkpoint",
    dims: int = 2,
    conditional: bool = False,
    latent: bool = False,
) -> Selection:
    """What ``--implementation auto`` runs in ``precision``: the first entry of :data:`VERIFIED` that matches and
    can run the request, else the first sample-mode implementation that can (saying that nothing faster is
    verified). Raises the last refusal (a one-line ValueError) when no implementation runs the request. Its
    ``fused`` is the runner's verification for a checkpoint's U-Net (:func:`select` asks of the model itself)."""
    from ddpm.backends import registry

    def runs(name: str) -> bool:
        if name.startswith("cuda") and not device.extension:
            return False
        try:
            registry.get(name).check(kind=kind, precision=precision, conditional=conditional, latent=latent)
        except ValueError:
            return False
        return device.type in registry.get(name).devices

    for entry in VERIFIED:
        if entry.matches(device, precision=precision, kind=kind, dims=dims) and runs(entry.implementation):
            fused = entry.implementation == "cuda" and kind == "checkpoint"
            fused = fused and runner_verified(
                device_type=device.type, precision=precision, dims=dims, native_bf16=device.native_bf16
            )
            why, faster = entry.why_on(device), entry.faster_than_fp32
            return Selection(entry.implementation, precision, why, fused, auto=True, faster_than_fp32=faster)
    for name in registry.SAMPLE_IMPLEMENTATIONS:
        if runs(name):
            reason = (
                "the diffusion_kernels extension is not built"
                if not device.extension
                else f"nothing faster is verified for {precision} {dims}-D {kind} files on a {device.type.upper()}"
            )
            return Selection(name, precision, reason, auto=True, faster_than_fp32=precision == "fp32")
    registry.get("original").check(kind=kind, precision=precision, conditional=conditional, latent=latent)
    raise ValueError(f"no implementation here runs --precision {precision} for this file")


def check_request(*, implementation: str, precision: str, precision_auto: bool, kind: str, compile: bool) -> None:
    """Refuse, while the flags resolve and before any file is read, what the named implementation (or, for
    ``auto``, every sample-mode implementation) cannot run: the file's ``kind``, a ``precision`` asked for (with
    ``precision_auto`` every implementation draws in one it runs), ``compile`` for another than cuda."""
    from ddpm.backends import registry
    from ddpm.formats.torch_files import KIND_NAMES

    if compile and implementation != "cuda":
        raise ValueError("--compile applies to training and to sampling with --implementation cuda")
    if compile and kind != "checkpoint":
        raise ValueError(
            f"--compile compiles a checkpoint's U-Net, not a {KIND_NAMES[kind]} file's; drop --compile, or sample "
            "from the checkpoint"
        )
    asked = None if precision_auto else precision
    if implementation != "auto":
        registry.get(implementation).check(kind=kind, precision=asked)
    elif asked is not None and not any(
        registry.get(name).runs(kind, asked) for name in registry.SAMPLE_IMPLEMENTATIONS
    ):
        raise ValueError(
            f"no implementation here runs {KIND_NAMES[kind]} files in --precision {asked}; "
            "drop --precision, or sample from the checkpoint"
        )


def select(device: DeviceKind, artifact, request) -> Selection:
    """What draws ``artifact`` (backends/artifacts.Artifact: its kind, U-Net and autoencoder) for ``request`` (a
    DrawRequest: the implementation named or ``auto``, the precision asked for, ``precision_auto``, ``compile``)
    on ``device``. With --precision auto, ``request.precision`` is the device's fastest (util/precision.resolve):
    kept where the implementation draws this file in it faster than in fp32, else fp32. A named implementation
    that cannot run the model (class-conditional, latent) is refused in one line."""
    from ddpm.backends import registry

    config = artifact.model_config
    facts = dict(kind=artifact.kind, conditional=bool(config.num_classes), latent=artifact.first_stage is not None)
    precision, named = request.precision, request.implementation
    if request.precision_auto and precision != "fp32":  # lower only where that path is faster than fp32
        if named == "auto":
            precision = precision if artifact.kind == "checkpoint" else "fp32"
        elif device.type == "cpu" or not registry.get(named).runs(artifact.kind, precision):
            precision = "fp32"  # on a CPU only auto's choice (the runner) is faster in bf16
    if named != "auto":
        registry.get(named).check(precision=precision, **facts)
        fused = (
            named == "cuda"
            and not request.compile
            and uses_runner(
                artifact.model, device_type=device.type, precision=precision, native_bf16=device.native_bf16
            )
        )
        return Selection(named, precision, f"--implementation {named}", fused, request.compile)
    choice = choose(device, precision=precision, dims=config.dims, **facts)
    if request.precision_auto and not choice.faster_than_fp32:
        choice = choose(device, precision="fp32", dims=config.dims, **facts)
    fused = choice.implementation == "cuda" and uses_runner(
        artifact.model, device_type=device.type, precision=choice.precision, native_bf16=device.native_bf16
    )
    return replace(choice, fused=fused)


def teacher_forward(model: nn.Module, *, device: torch.device) -> nn.Module:
    """The teacher's forward through the fused U-Net runner where the cuda implementation uses it (the same
    outputs to float rounding; uses_runner says where), else the model itself."""
    if not uses_runner(model, device_type=device.type, precision="fp32") or not DeviceKind.of(device).extension:
        return model
    from optimized_diffusion import FusedUNet

    return FusedUNet(model).eval()
