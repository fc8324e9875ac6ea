"""--implementation auto (the default): the fastest implementation verified on this kind of device.

    choice = choose(DeviceKind.of(device), precision="fp32", kind="checkpoint", dims=2)
    print(choice.line)      # implementation: cuda in fp32 (fused U-Net runner, Winograd convolutions; the fastest ...)

:data:`VERIFIED` is the one table the choice comes from: each entry names a kind of device, the precisions
and models it covers, the implementation, why, and the BENCHMARKS.md section whose measurement it rests on.
The first entry that matches (and whose implementation runs the file) wins; where none does, the first
sample-mode implementation that runs the request is used, and the line says so. :func:`choose` is a pure
function of its arguments (tests hand it fake devices); :meth:`DeviceKind.of` is the only part that looks at
the machine. An explicit ``--implementation`` never comes here.

:data:`verified.RUNNER_VERIFIED` (backends/verified.py, beside :class:`DeviceKind`) says where the ``cuda``
implementation includes the fused U-Net runner
(optimized_diffusion.FusedUNet): where it has been measured faster than the step kernels alone. Elsewhere
``cuda`` is the step kernels alone, which is also always available as ``cuda_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpm.backends.verified import FORCED_BF16, DeviceKind


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


@dataclass(frozen=True)
class Choice:
    implementation: str  # a registry name
    why: str
    precision: str = "fp32"
    faster_than_fp32: bool = True  # where precision is lower: whether this path was measured faster than fp32's

    @property
    def line(self) -> str:
        return f"implementation: {self.implementation} in {self.precision} ({self.why})"


def choose(
    device: DeviceKind,
    *,
    precision: str,
    kind: str = "checkpoint",
    dims: int = 2,
    conditional: bool = False,
    latent: bool = False,
) -> Choice:
    """The implementation ``--implementation auto`` runs: the first entry of :data:`VERIFIED` that matches and
    can run the request, else the first sample-mode implementation that can (saying that nothing faster is
    verified). Raises the last refusal (a one-line ValueError) when no implementation runs the request."""
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
            return Choice(entry.implementation, entry.why_on(device), precision, entry.faster_than_fp32)
    for name in registry.SAMPLE_IMPLEMENTATIONS:
        if runs(name):
            reason = (
                "the diffusion_kernels extension is not built"
                if not device.extension
                else f"nothing faster is verified for {precision} {dims}-D {kind} files on a {device.type.upper()}"
            )
            return Choice(name, reason, precision, precision == "fp32")
    registry.get("original").check(kind=kind, precision=precision, conditional=conditional, latent=latent)
    raise ValueError(f"no implementation here runs --precision {precision} for this file")


def check_runnable(*, kind: str, precision: str) -> None:
    """Refuse, before any file is read, a file kind and precision that no sample-mode implementation runs (the
    last one's one-line reason); :func:`chosen_for` chooses among those that do once the file is read."""
    from ddpm.backends import registry
    from ddpm.formats.kinds import KIND_NAMES

    if not any(registry.get(name).runs(kind, precision) for name in registry.SAMPLE_IMPLEMENTATIONS):
        raise ValueError(
            f"no implementation here runs {KIND_NAMES[kind]} files in --precision {precision}; "
            "drop --precision, or sample from the checkpoint"
        )


def chosen_for(request, artifact) -> Choice | None:
    """``--implementation auto``, chosen once the file is read and says its U-Net's dims, conditioning and
    autoencoder; None where the user named an implementation. ``request`` is a DrawRequest, ``artifact`` the
    opened file (backends/artifacts.py)."""
    if request.implementation != "auto":  # an implementation the user named
        return None
    from ddpm.formats.kinds import artifact_kind

    config = artifact.model_config
    device = DeviceKind.of(request.device)
    facts = dict(
        kind=artifact_kind(request.source.path),
        dims=config.dims,
        conditional=bool(config.num_classes),
        latent=artifact.first_stage is not None,
    )
    choice = choose(device, precision=request.precision, **facts)
    if request.precision_auto and not choice.faster_than_fp32:  # auto: a lower precision only where it is faster
        return choose(device, precision="fp32", **facts)
    return choice
