"""The implementations that sample, each declared once: what it accepts and how it is built.

    impl = get("cuda")
    impl.check(kind="checkpoint", precision="bf16", device=device)   # one-line ValueError if not
    network = impl.prepare(model, options)                           # once per model (export, compile, trace)
    sampler = impl.build(network, plan, shape=(16, 1, 28, 28), options=options)   # once per batch shape
    images = sampler(generator=torch.Generator(device).manual_seed(0), progress=False)   # (B, C, H, W), [-1, 1]

:data:`REGISTRY` holds what ``--implementation`` offers: sample and evaluate mode build them from here, and
benchmark mode's rows (benchmarks/rows.py) are these with parameters (a precision, the runner or torch.compile
forced) beside :data:`PEERS`, the implementations only the benchmark times. Every implementation takes its
coefficients from ``plan`` and draws its noise from the caller's generator in the original loop's order, so with
one seed they all draw the same images (to float tolerance in fp32).

The fp32 implementations run under ``precision.backend_policy("fp32")``: no TF32 in cuDNN or
cuBLAS, true fp32 like the fused cuda implementation's fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ddpm.conditioning import Guidance
from ddpm.formats.torch_files import KIND_NAMES
from ddpm.formats.unet_io import DEFAULT_OPSET
from ddpm.util.phases import phase
from ddpm.util.precision import PRECISIONS, QUANTIZED, backend_policy

if TYPE_CHECKING:
    from ddpm.latent.autoencoder import FirstStage
    from noise_schedule import SamplingPlan
    from tensorrt_integration import TensorRTOptions

ALL_KINDS = tuple(KIND_NAMES)


class Sampler(Protocol):
    def __call__(
        self, *, generator: torch.Generator, progress: bool = False, guidance: Guidance | None = None
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplerOptions:
    """What an implementation may need besides the model and plan (each reads what applies to it)."""

    precision: str = "fp32"
    opset: int | None = None  # the ONNX opset of an in-memory export (None: unet_io.DEFAULT_OPSET)
    tensorrt: TensorRTOptions | None = None  # engines: profile, builder level, cache folder
    log: Callable[[str], None] = print  # one-line notices (an engine built, a graph capture refused)
    guidance: Guidance | None = None  # class-conditional models: the null label and scale (labels come per batch)
    fused_unet: bool = False  # cuda: the U-Net through the fused U-Net runner (backends/selection.py decides)
    compile: bool | str = False  # cuda: the U-Net through torch.compile (a mode name: that mode) inside the graph
    openvino_precision: str | None = None  # openvino: its inference precision hint (None: OpenVINO's default)
    winograd: bool = True  # cuda's runner: Winograd convolutions where they are faster (False: oneDNN's everywhere)


@dataclass(frozen=True)
class Selection:
    """What draws, decided once (backends/selection.select): every later step reads it and none decides again."""

    implementation: str  # a registry name (a sample-mode implementation)
    precision: str
    why: str
    fused: bool = False  # cuda: its U-Net through the fused U-Net runner (RUNNER_VERIFIED)
    compile: bool = False  # cuda with --compile: its U-Net through torch.compile inside the graph
    auto: bool = False  # chosen by --implementation auto (the mode prints the line)
    faster_than_fp32: bool = True  # where precision is lower: whether this path was measured faster than fp32's

    @property
    def line(self) -> str:
        return f"implementation: {self.implementation} in {self.precision} ({self.why})"

    @property
    def name(self) -> str:
        """The run's name for its profile folder: cuda with --compile is the benchmark's cuda_compile row."""
        return f"{self.implementation}_compile" if self.compile else self.implementation

    def options(self, **more) -> SamplerOptions:
        """The implementation's options as this selection says (``more``: the run's opset, engine, guidance)."""
        return SamplerOptions(precision=self.precision, fused_unet=self.fused, compile=self.compile, **more)


@dataclass(frozen=True)
class Implementation:
    name: str
    summary: str
    build: Callable[..., Sampler]  # build(network, plan, *, shape, options) -> Sampler
    prepare: Callable[[nn.Module, SamplerOptions], nn.Module] = lambda model, options: model
    kinds: tuple[str, ...] = ("checkpoint",)  # artifact kinds it runs
    precisions: tuple[str, ...] = ("fp32",)
    devices: tuple[str, ...] = ("cpu", "cuda")
    conditional: bool = False  # runs class-conditional models (labels and guidance)
    # A latent model's decoder as this implementation runs it, built once (an export, a trace, an engine):
    # decoder(first_stage, options, device=the sampling device) -> images = f(latents); None: latent models are refused.
    decoder: Callable[..., Callable[[torch.Tensor], torch.Tensor]] | None = None

    def runs(self, kind: str, precision: str) -> bool:
        """Whether it runs ``kind`` files in ``precision`` (what :meth:`check` would accept of the two)."""
        return kind in self.kinds and precision in self.precisions

    def check(
        self,
        *,
        kind: str | None = None,
        precision: str | None = None,
        device: torch.device | None = None,
        conditional: bool = False,
        latent: bool = False,
    ) -> None:
        """One-line ValueError if this implementation cannot run ``kind`` files, ``precision``, ``device``,
        (``conditional``) a class-conditional model or (``latent``) a latent model."""
        if latent and self.decoder is None:
            runs = " or ".join(name for name in SAMPLE_IMPLEMENTATIONS if REGISTRY[name].decoder is not None)
            raise ValueError(
                f"the {self.name} implementation does not run latent models yet; use --implementation {runs}"
            )
        if conditional and not self.conditional:
            runs = " or ".join(name for name in SAMPLE_IMPLEMENTATIONS if REGISTRY[name].conditional)
            raise ValueError(
                f"the {self.name} implementation does not run class-conditional models yet; use --implementation {runs}"
            )
        if kind is not None and kind not in self.kinds:
            runs = implementations_for(kind)
            raise ValueError(
                f"the {self.name} implementation cannot run {KIND_NAMES[kind]} files; "
                f"use --implementation {' or '.join(runs)}, or sample from the checkpoint"
            )
        if precision is not None and precision not in self.precisions:
            if precision in QUANTIZED:
                runs = " or ".join(name for name in SAMPLE_IMPLEMENTATIONS if precision in REGISTRY[name].precisions)
                if not runs:
                    raise ValueError(
                        f"no implementation here runs --precision {precision} (TensorRT on a Hopper or newer GPU would)"
                    )
                raise ValueError(
                    f"--precision {precision} is a quantized ONNX graph; the {self.name} implementation does not run "
                    "one: "
                    f"use --implementation {runs}"
                )
            if self.name == "original":
                raise ValueError(
                    "the original implementation is the fp32 baseline; use --implementation cuda for bf16/fp16"
                )
            raise ValueError(
                f"the {self.name} implementation runs in {' or '.join(self.precisions)}; drop --precision {precision}"
            )
        if device is not None and device.type not in self.devices:
            raise ValueError(
                f"the {self.name} implementation needs a {' or '.join(d.upper() for d in self.devices)} device"
            )


# ----- builders ------------------------------------------------------------------------------------
def loop(network: nn.Module, plan: SamplingPlan, *, shape, options: SamplerOptions) -> Sampler:
    """The original loop (basic_diffusion.sample) around any eps = network(x_t, t), in true fp32."""
    from basic_diffusion import sample

    def run(*, generator: torch.Generator, progress: bool = False, guidance: Guidance | None = None) -> torch.Tensor:
        with backend_policy("fp32"):
            return sample(network, plan, shape=shape, generator=generator, progress=progress, guidance=guidance)

    return run


def _fused(compile_model: bool | str | None = None, *, fused_unet: bool | None = None) -> Callable[..., Sampler]:
    """FusedSampler builders. ``compile_model`` and ``fused_unet``: what the builder always runs (the U-Net through
    torch.compile, the fused U-Net runner), None: what ``options`` say (the selection's)."""

    def build(network: nn.Module, plan: SamplingPlan, *, shape, options: SamplerOptions) -> Sampler:
        try:
            import optimized_diffusion
        except ImportError as exc:  # the extension neither built nor buildable here
            raise ImportError(f"the cuda implementation's extension is not built: {exc}") from exc
        return optimized_diffusion.FusedSampler(
            network,
            plan,
            shape=shape,
            precision=options.precision,
            compile_model=options.compile if compile_model is None else compile_model,
            log=options.log,
            guidance=options.guidance,
            fused_unet=options.fused_unet if fused_unet is None else fused_unet,
            winograd=options.winograd,
        )

    return build


def _tensorrt(network: nn.Module, plan: SamplingPlan, *, shape, options: SamplerOptions) -> Sampler:
    import tensorrt_integration

    return tensorrt_integration.tensorrt_sampler(
        network,
        plan,
        shape=shape,
        precision=options.precision,
        options=options.tensorrt,
        log=options.log,
        guidance=options.guidance,
    )


def _as_onnxruntime(model: nn.Module, options: SamplerOptions) -> nn.Module:
    # Only the U-Net call goes through onnxruntime (a checkpoint's U-Net exported in memory); the
    # original loop draws the noise, so the images match the original's.
    from ddpm.backends import runtimes

    if options.precision == "int8":  # quantized in _onnxruntime_int8, calibrated on the plan it will run
        return model
    weight = next(model.parameters(), None)  # None: an .onnx file's model, returned as it is
    device = weight.device if weight is not None else torch.device("cpu")
    return runtimes.as_onnxruntime(model, device=device, opset=options.opset or DEFAULT_OPSET)


def _onnxruntime_int8(network: nn.Module, plan: SamplingPlan, *, shape, options: SamplerOptions) -> Sampler:
    """--precision int8: a checkpoint's U-Net quantized in memory (formats/quantization.py), calibrated on
    trajectories of the plan it will run (its own seed, not the run's noise); an INT8 .onnx file as it is."""
    from ddpm.backends import runtimes
    from ddpm.formats import quantization

    if options.precision == "int8":
        if isinstance(network, runtimes.OnnxRuntimeUNet):
            if network.metadata.get("precision") != "int8":
                raise ValueError(
                    "--precision int8 needs an INT8 .onnx file or a checkpoint; this file's graph is fp32: drop "
                    "--precision"
                )
        else:
            feeds = quantization.calibration_feeds(network, plan, samples=quantization.DEFAULT_CALIBRATION_SAMPLES)
            device = next(network.parameters()).device
            network = runtimes.as_onnxruntime(
                network, device=device, opset=options.opset or DEFAULT_OPSET, calibration=feeds
            )
    return loop(network, plan, shape=shape, options=options)


def compiled_unet(model: nn.Module, options: SamplerOptions) -> nn.Module:
    on_gpu = any(p.is_cuda for p in model.parameters())
    return torch.compile(model, mode="max-autotune" if on_gpu else "default")


# ----- decoders (latent models: the autoencoder's decoder after the sampling loop) -------------------
def eager_decoder(
    stage: FirstStage, options: SamplerOptions, *, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decoder in plain PyTorch, true fp32 (the original's)."""

    def decode(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), backend_policy("fp32"):
            return stage.decoder(z)

    return decode


def _autocast_decoder(
    stage: FirstStage, options: SamplerOptions, *, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cuda implementation's: the decoder in its precision (autocast for bf16/fp16), images in fp32."""
    from ddpm.util.precision import autocast

    def decode(z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), backend_policy(options.precision), autocast(z.device.type, options.precision):
            return stage.decoder(z).float()

    return decode


def compiled_decoder(
    stage: FirstStage, options: SamplerOptions, *, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    return eager_decoder(replace(stage, decoder=compiled_unet(stage.decoder, options)), options, device=device)


def _cuda_decoder(
    stage: FirstStage, options: SamplerOptions, *, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cuda implementation's decoder: compiled where its U-Net is (--compile), else under autocast."""
    return (compiled_decoder if options.compile else _autocast_decoder)(stage, options, device=device)


def _onnxruntime_decoder(
    stage: FirstStage, options: SamplerOptions, *, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decoder exported to ONNX in memory and run by onnxruntime, like the U-Net."""
    from ddpm.backends import runtimes

    if isinstance(stage.decoder, runtimes.OnnxRuntimeDecoder):  # an exported model's .decoder.onnx
        return stage.decoder
    return runtimes.OnnxRuntimeDecoder.exported(
        stage.decoder, io=stage.io, device=device, opset=options.opset or DEFAULT_OPSET
    )


def _tensorrt_decoder(
    stage: FirstStage, options: SamplerOptions, *, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decoder as a TensorRT engine in the implementation's precision.

    An exported model's .decoder.engine is used as it is."""
    import tensorrt_integration

    return tensorrt_integration.tensorrt_decoder(
        stage, device=device, precision=options.precision, options=options.tensorrt, log=options.log
    )


REGISTRY: dict[str, Implementation] = {
    impl.name: impl
    for impl in (
        Implementation(
            "original",
            "the plain PyTorch loop (basic_diffusion.py): the fp32 baseline and the reference",
            loop,
            kinds=ALL_KINDS,
            conditional=True,
            decoder=eager_decoder,
        ),
        Implementation(
            "cuda",
            "the fastest custom-kernel path: fused step ops, static buffers, CUDA graphs (the whole plan in one for "
            "short plans), and the fused U-Net runner where it is verified (a CPU in fp32, a GPU in bf16/fp16 for "
            "2-D U-Nets) (optimized_diffusion.py)",
            _fused(),
            kinds=("checkpoint", "torchscript"),
            precisions=PRECISIONS,
            conditional=True,
            decoder=_cuda_decoder,
        ),
        Implementation(
            "cuda_steps",
            "the fused step ops alone around the eager U-Net (static buffers, CUDA graph): the original's "
            "bit-for-bit twin on the CPU in fp32",
            _fused(False, fused_unet=False),
            kinds=("checkpoint", "torchscript"),
            precisions=PRECISIONS,
            conditional=True,
            decoder=_autocast_decoder,
        ),
        Implementation(
            "onnxruntime",
            "the original loop around the U-Net run by onnxruntime (backends/runtimes.py); int8: quantized",
            _onnxruntime_int8,
            prepare=_as_onnxruntime,
            kinds=("checkpoint", "onnx"),
            precisions=("fp32", "int8"),
            conditional=True,
            decoder=_onnxruntime_decoder,
        ),
        Implementation(
            "tensorrt",
            "the U-Net as a TensorRT engine (tensorrt_integration.py)",
            _tensorrt,
            kinds=("checkpoint", "onnx", "tensorrt"),
            precisions=PRECISIONS + QUANTIZED,
            devices=("cuda",),
            conditional=True,
            decoder=_tensorrt_decoder,
        ),
    )
}
SAMPLE_IMPLEMENTATIONS = tuple(REGISTRY)  # what --implementation offers (besides auto)


# ----- peers: implementations the benchmark times beside the registry's, not offered by --implementation ---
def _openvino(network: nn.Module, plan: SamplingPlan, *, shape, options: SamplerOptions) -> Sampler:
    """The original loop around the U-Net compiled by OpenVINO (in ``options.openvino_precision``, None: OpenVINO's
    default). The sampler carries ``precision`` (what OpenVINO used) and ``detail``."""
    from ddpm.backends.openvino_runtime import as_openvino

    unet = as_openvino(network, hint=options.openvino_precision, opset=options.opset)
    run = loop(unet, plan, shape=shape, options=options)
    run.precision, run.detail = unet.precision, unet.provider
    return run


def _torchscript(model: nn.Module, options: SamplerOptions) -> nn.Module:
    from ddpm.formats import exporters

    return exporters.trace_torchscript(model)


def _as_diffusers(model: nn.Module, options: SamplerOptions) -> nn.Module:
    """diffusers' UNet2DModel with the model's weights, in the row's precision (a baseline row, not a feature)."""
    from ddpm.formats.diffusers_io import DiffusersUNet
    from ddpm.util.precision import LOW_DTYPES

    return DiffusersUNet(model, dtype=LOW_DTYPES.get(options.precision, torch.float32))


def _traced_decoder(
    stage: FirstStage, options: SamplerOptions, *, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decoder traced to TorchScript (an exported model's .decoder.ts as it is)."""
    from ddpm.formats import exporters

    if not isinstance(stage.decoder, torch.jit.ScriptModule):
        stage = replace(stage, decoder=exporters.trace_decoder(stage.decoder, latent_shape=stage.latent_shape))
    return eager_decoder(stage, options, device=device)


_DIFFUSERS = Implementation(
    "diffusers",
    "the original loop around diffusers' UNet2DModel holding the same weights (a baseline; needs diffusers)",
    loop,
    prepare=_as_diffusers,
    precisions=PRECISIONS,
    conditional=True,
)
_COMPILE = Implementation(
    "compile",
    "the original loop around torch.compile(U-Net) (max-autotune on a GPU)",
    loop,
    prepare=compiled_unet,
    conditional=True,
    decoder=compiled_decoder,
)
_OPENVINO = Implementation(
    "openvino",
    "the original loop around the U-Net's ONNX export run by OpenVINO in its default precision (bf16 on CPUs with "
    "AVX-512 bf16 or AMX; needs openvino)",
    _openvino,
    devices=("cpu",),
    conditional=True,
)
_TORCHSCRIPT = Implementation(
    "torchscript",
    "the original loop around the traced U-Net",
    loop,
    prepare=_torchscript,
    conditional=True,
    decoder=_traced_decoder,
)

PEERS: dict[str, Implementation] = {impl.name: impl for impl in (_DIFFUSERS, _COMPILE, _OPENVINO, _TORCHSCRIPT)}


def get(name: str) -> Implementation:
    """The sample-mode implementation ``name``; a ValueError naming the choices for another."""
    if name not in REGISTRY:
        raise ValueError(f"unknown implementation {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def implementations_for(kind: str) -> tuple[str, ...]:
    """The sample-mode implementations that run ``kind`` files."""
    return tuple(name for name in SAMPLE_IMPLEMENTATIONS if kind in REGISTRY[name].kinds)


def batch_generator(seed: int, index: int, *, device: torch.device) -> torch.Generator:
    """The generator of sampling batch ``index``: a function of (seed, index) only, so a batch draws the
    same images whichever process draws it (ranks under torchrun share batches out), and batch 0 is
    what ``--seed`` alone gives."""
    return torch.Generator(device).manual_seed(seed if index == 0 else (seed * 1_000_003 + index) % 2**63)


def check_finite(x: torch.Tensor, *, name: str) -> None:
    """One-line ValueError if ``x`` holds NaN or inf, so an overflow never becomes a black image."""
    if not bool(torch.isfinite(x).all()):  # sync: one flag per batch
        raise ValueError(
            f"the {name} implementation drew non-finite values (NaN or inf): the model overflowed; if it ran in "
            "fp16 (--precision fp16 or an fp16 export), sample in fp32 or bf16 (fp32's range), or from the checkpoint"
        )


def make_drawer(
    name: str | Implementation,
    model: nn.Module,
    plan: SamplingPlan,
    *,
    options: SamplerOptions,
    first_stage: FirstStage | None = None,
):
    """``draw(shape, generator, progress)`` -> (B, C, H, W) images in [-1, 1], for one implementation (a registry
    name, or an Implementation a benchmark row declares), as ``options`` say (backends/selection.py chose them).

    The network is prepared once (an ONNX export, a compile, a trace); a sampler (captured graphs,
    an engine) is built once per batch shape and reused for every batch of that shape. For a latent
    model (``first_stage``), ``shape`` is the latents' and the implementation's decoder turns the
    sampled latents into images.
    """
    impl = get(name) if isinstance(name, str) else name
    network = impl.prepare(model, options)
    decode = impl.decoder(first_stage, options, device=plan.coefficients.device) if first_stage is not None else None
    samplers: dict[tuple[int, ...], Sampler] = {}

    def draw(
        shape: tuple[int, int, int, int], generator: torch.Generator, progress: bool, guidance: Guidance | None = None
    ) -> torch.Tensor:
        if shape not in samplers:
            samplers[shape] = impl.build(network, plan, shape=shape, options=options)
        with phase("sample"):
            x = samplers[shape](generator=generator, progress=progress, guidance=guidance)
        check_finite(x, name=impl.name)  # a latent model's latents too: its decoder clamps inf away
        if decode is not None:
            with phase("decode"):
                x = decode(x)  # latents (B, c, h, w) -> images (B, C, H, W)
            check_finite(x, name=impl.name)
        return x

    return draw
