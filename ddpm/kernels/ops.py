"""The diffusion_kernels extension's ops from Python: loading the extension once, the fake kernels that let
``torch.compile`` trace them, and one wrapper per op (with the Winograd and upsampling weight transforms that
prepare conv3x3_winograd's operand); and seeded dropout, the op as an ``nn.Dropout`` for training on a CPU.

    from ddpm.kernels import ops
    ops.load_extension()  # the module setup.py built, else a JIT build (ddpm/kernels/build.py)
    out = ops.group_norm_act(x, weight, bias, groups=32)
    ops.use_seeded_dropout(model)   # -> how many nn.Dropout modules became SeededDropout (0 without the extension)

The ops' schemas and CPU kernels are in diffusion_ops.cpp, their CUDA kernels in diffusion_kernels.cu; each wrapper
loads the extension on first use.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddpm.kernels import build
from ddpm.kernels.build import BUILD_COMMAND
from ddpm.util.messages import first_line

# ----- Loading the extension ----------------------------------------------------------------------

_loaded_from: str | None = None  # "compiled" or "jit" once the ops are registered


class ExtensionUnavailableError(ImportError):
    """The diffusion_kernels extension is neither built nor JIT-compilable (or lacks CUDA kernels)."""


def load_extension(*, allow_jit: bool = True) -> str:
    """Register ``torch.ops.diffusion_kernels`` once; returns "compiled" or "jit".

    Imports the module built by setup.py; if there is none (or it was built against another
    torch), JIT-compiles the same sources with ``torch.utils.cpp_extension.load``: with the .cu
    when a GPU and a CUDA toolkit are present, CPU-only otherwise.
    """
    global _loaded_from
    if _loaded_from is not None:
        return _loaded_from
    try:
        importlib.import_module(build.EXTENSION_NAME)
        source = "compiled"
    except ImportError as exc:  # not built, or built against another torch (undefined symbols)
        if not allow_jit:
            raise ExtensionUnavailableError(
                f"the diffusion_kernels extension is not built ({first_line(exc)}); build it with: {BUILD_COMMAND}"
            ) from exc
        try:
            build.jit_compile()
        except Exception as exc:  # compiler missing, compile error, ...: one line, with the fix
            raise ExtensionUnavailableError(
                f"the diffusion_kernels extension is not built and JIT compilation failed ({first_line(exc)}); "
                f"build it with: {BUILD_COMMAND}"
            ) from exc
        source = "jit"
    _register_fakes()
    _register_dropout()
    _register_norm_training()
    _loaded_from = source
    return source


def has_op(name: str) -> bool:
    """Whether the extension (loaded now if need be) has op ``name``: a build older than the op has not."""
    if _loaded_from is None:
        load_extension()
    return hasattr(torch.ops.diffusion_kernels, name)


def has_cuda_kernels() -> bool:
    """Whether the loaded extension was built with its CUDA kernels."""
    load_extension()
    return torch._C._dispatch_has_kernel_for_dispatch_key("diffusion_kernels::fused_step_", "CUDA")


def _register_fakes() -> None:
    """Fake (meta) kernels, so the ops trace under torch.compile: the in-place ops return nothing; the others an
    empty tensor of the output's shape and memory format."""

    @torch.library.register_fake("diffusion_kernels::fused_step_")
    def _fused_step_fake(x, eps, noise, xstart, coefficients, step, *, clip_denoised, use_prev, guidance=None):
        return None

    @torch.library.register_fake("diffusion_kernels::gather_timestep_")
    def _gather_timestep_fake(t, timesteps, step):
        return None

    if not hasattr(torch.ops.diffusion_kernels, "group_norm_act"):  # an extension built before the op existed
        return

    @torch.library.register_fake("diffusion_kernels::group_norm_act")
    def _group_norm_act_fake(x, x2, weight, bias, x_bias, scale, shift, *, groups, eps, silu):
        shape = (x.shape[0], weight.shape[0], *x.shape[2:])
        return x.new_empty(shape).contiguous(memory_format=torch._prims_common.suggest_memory_format(x))

    if not hasattr(torch.ops.diffusion_kernels, "conv3x3_winograd"):
        return

    @torch.library.register_fake("diffusion_kernels::conv3x3_winograd")
    def _conv3x3_winograd_fake(x, weight, bias, *, upsample=False):
        scale = 2 if upsample else 1
        shape = (x.shape[0], weight.shape[2], scale * x.shape[2], scale * x.shape[3])
        return x.new_empty(shape).contiguous(memory_format=torch.channels_last)

    if not hasattr(torch.ops.diffusion_kernels, "bias_add_"):
        return

    @torch.library.register_fake("diffusion_kernels::bias_add_")
    def _bias_add_fake(h, bias, residual, residual2):
        return None

    if not hasattr(torch.ops.diffusion_kernels, "conv3x3_winograd_weight_grad"):
        return

    @torch.library.register_fake("diffusion_kernels::conv3x3_winograd_weight_grad")
    def _conv3x3_winograd_weight_grad_fake(x, grad_out, tile=2):
        return x.new_empty(((tile + 2) ** 2, x.shape[1], grad_out.shape[1]), dtype=torch.float32)

    if not hasattr(torch.ops.diffusion_kernels, "conv3x3_winograd_backward"):
        return

    @torch.library.register_fake("diffusion_kernels::winograd_kernel")
    def _winograd_kernel_fake(weight, tile, rotated=False):
        cout, cin = weight.shape[:2]
        return weight.new_empty(((tile + 2) ** 2, *((cout, cin) if rotated else (cin, cout))))

    @torch.library.register_fake("diffusion_kernels::conv3x3_winograd_backward")
    def _conv3x3_winograd_backward_fake(grad_out, x, weight, tile, output_mask):
        grads = (  # dL/dx channels-last, dL/dweight, dL/dbias; empty where output_mask does not ask
            torch.empty(x.shape, dtype=x.dtype, memory_format=torch.channels_last),
            weight.new_empty(weight.shape),
            weight.new_empty(weight.shape[:1]),
        )
        return tuple(g if wanted else weight.new_empty((0,)) for g, wanted in zip(grads, output_mask))

    if not hasattr(torch.ops.diffusion_kernels, "conv3x3_thin"):
        return

    @torch.library.register_fake("diffusion_kernels::conv3x3_thin")
    def _conv3x3_thin_fake(x, weight, bias):
        shape = (x.shape[0], weight.shape[0], *x.shape[2:])
        return x.new_empty(shape).contiguous(memory_format=torch.channels_last)

    @torch.library.register_fake("diffusion_kernels::conv3x3_thin_backward")
    def _conv3x3_thin_backward_fake(grad_out, x, weight, output_mask):
        return _conv3x3_winograd_backward_fake(grad_out, x, weight, 0, output_mask)


def _register_norm_training() -> None:
    """The fake kernel of group_norm_act's backward op (for torch.compile), registered as the extension loads."""
    if not hasattr(torch.ops.diffusion_kernels, "group_norm_act_backward"):  # a build older than the op
        return

    @torch.library.register_fake("diffusion_kernels::group_norm_act_backward")
    def _fake(grad, x, x2, weight, bias, scale, shift, *, groups, eps, silu):
        rows = x.shape[0] if scale is not None else 0
        return (
            torch.empty_like(x, memory_format=torch.channels_last),
            torch.empty_like(x2, memory_format=torch.channels_last) if x2 is not None else x.new_empty((0,)),
            weight.new_empty(weight.shape),
            bias.new_empty(bias.shape),
            weight.new_empty((rows, weight.shape[0])),  # x's channels and x2's
            weight.new_empty((rows, weight.shape[0])),
        )


class _GroupNormAct(torch.autograd.Function):
    """group_norm_act with its gradients by the backward op. An autograd.Function rather than a formula registered
    on the op, so that the sampling runner's calls (no gradients) keep the op's bare dispatch."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, shift, groups: int, eps: float, silu: bool):
        ctx.save_for_backward(x, weight, bias, scale, shift)
        ctx.options = dict(groups=groups, eps=eps, silu=silu)
        return torch.ops.diffusion_kernels.group_norm_act(
            x, None, weight, bias, None, scale, shift, groups=groups, eps=eps, silu=silu
        )

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, scale, shift = ctx.saved_tensors
        dx, _, dweight, dbias, dscale, dshift = torch.ops.diffusion_kernels.group_norm_act_backward(
            grad.contiguous(memory_format=torch.channels_last), x, None, weight, bias, scale, shift, **ctx.options
        )
        if scale is None:
            dscale = dshift = None
        return dx, dweight, dbias, dscale, dshift, None, None, None


def group_norm_act_trainable(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    groups: int,
    eps: float = 1e-5,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """:func:`group_norm_act` (no x2, no x_bias) with gradients for x, weight, bias, scale and shift, on a CPU:
    x (B, C, H, W) channels-last float32 or bfloat16, the rest float32."""
    if _loaded_from is None:
        load_extension()
    return _GroupNormAct.apply(x, weight, bias, scale, shift, groups, eps, silu)


def fused_norm_act(
    norm: nn.GroupNorm,
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    *,
    silu: bool = True,
) -> torch.Tensor:
    """basic_diffusion.norm_act through group_norm_act on a CPU, with its gradients (the backward op): one pass
    forward, two backward, in x's dtype (float32 or bfloat16; the statistics and gradients in float32). x is
    made channels-last, the layout the backward takes; scale and shift (B, C) are read in float32."""
    if scale is not None:
        scale, shift = scale.float(), shift.float()
    return group_norm_act_trainable(
        x.contiguous(memory_format=torch.channels_last),
        norm.weight,
        norm.bias,
        groups=norm.num_groups,
        eps=norm.eps,
        scale=scale,
        shift=shift,
        silu=silu,
    )


def built_has_op(name: str) -> bool:
    """Whether the built extension has op ``name``, without a JIT compile (a trainer without it keeps PyTorch's
    modules; a build older than the op has not)."""
    try:
        load_extension(allow_jit=False)
    except ExtensionUnavailableError:
        return False
    return hasattr(torch.ops.diffusion_kernels, name)


def norm_training_available() -> bool:
    """Whether the built extension trains through group_norm_act (its backward op)."""
    return built_has_op("group_norm_act_backward")


# ----- Op wrappers --------------------------------------------------------------------------------


def fused_step_(
    x: torch.Tensor,
    eps: torch.Tensor,
    *,
    noise: torch.Tensor | None,
    xstart: torch.Tensor | None,
    coefficients: torch.Tensor,
    step: torch.Tensor,
    clip_denoised: bool,
    use_prev: bool,
    guidance: float | None = None,
) -> None:
    """One reverse step (:func:`noise_schedule.p_step`) in place, at the step held in ``step``.

    x: (B, C, H, W) x_t, overwritten with x_prev. eps: the U-Net output, same shape and memory
    layout. noise: z for stochastic steps (x's dtype) or None. xstart: overwritten with
    pred_xstart (x's dtype), or None to not store it; with ``use_prev`` its old content is the
    previous step's pred_xstart (DPM-Solver++). coefficients: the plan's (S, 7) float32 table.
    step: one-element int64 step counter on the same device (never read by the host).
    x/eps/noise/xstart may be float32, float16 or bfloat16; arithmetic is float32.
    guidance: a classifier-free guidance scale w; eps is then (2B, C, H, W), the U-Net's conditional
    rows and then its unconditional ones (contiguous), combined as :func:`noise_schedule.guided_eps`.
    """
    if _loaded_from is None:
        load_extension()
    # guidance only when given: an extension built before it existed still runs unguided steps.
    extra = {} if guidance is None else {"guidance": guidance}
    torch.ops.diffusion_kernels.fused_step_(
        x, eps, noise, xstart, coefficients, step, clip_denoised=clip_denoised, use_prev=use_prev, **extra
    )


def gather_timestep_(t: torch.Tensor, *, timesteps: torch.Tensor, step: torch.Tensor) -> None:
    """``t[:] = timesteps[step]`` on the device: the U-Net's (B,) int64 timestep input."""
    if _loaded_from is None:
        load_extension()
    torch.ops.diffusion_kernels.gather_timestep_(t, timesteps, step)


def group_norm_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    groups: int,
    eps: float = 1e-5,
    x2: torch.Tensor | None = None,
    x_bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """SiLU(GroupNorm([x + x_bias, x2]) * (1 + scale) + shift) in one pass: a new tensor (B, C, *spatial)
    in x's dtype and memory format, without materializing the concatenation or the biased x.

    x: (B, C1, *spatial), contiguous or channels-last, float32/float16/bfloat16. x2: (B, C2, *spatial)
    of x's dtype (a skip connection; a group may straddle x and x2), or None. weight, bias: (C,) float32,
    C = C1 + C2. x_bias: (C1,) float32, the bias of the convolution that produced x, or None.
    scale, shift: (B, C) float32 with dense rows (slices of one wider table, or one row expanded), or None.
    silu: apply SiLU last. Statistics in float32 in a fixed order, so the CUDA and CPU kernels agree bit for bit.
    """
    if _loaded_from is None:
        load_extension()
    return torch.ops.diffusion_kernels.group_norm_act(
        x, x2, weight, bias, x_bias, scale, shift, groups=groups, eps=eps, silu=silu
    )


def bias_add_(
    h: torch.Tensor,
    bias: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    residual2: torch.Tensor | None = None,
) -> torch.Tensor:
    """``h += bias`` per channel (and ``+ [residual, residual2]``, the residual stream, never concatenated) in
    place, in one pass, and returns h. h: a dense channels-last (B, C, H, W) or (B, C, D, H, W) tensor in
    float32/float16/bfloat16; bias: (C,) float32; residual (B, C1, *spatial) and residual2 (B, C - C1, *spatial):
    h's dtype, channels-last.
    Sums in float32, each rounded (diffusion_kernels.h), one rounding to h's dtype."""
    if _loaded_from is None:
        load_extension()
    torch.ops.diffusion_kernels.bias_add_(h, bias, residual, residual2)
    return h


# Winograd's kernel transforms G (Lavin and Gray 2016): U = G g G^T is the kernel that multiplies the transformed
# input tile elementwise (the input and output transforms are in diffusion_winograd.cpp). F(2x2, 3x3) and F(4x4, 3x3)
# for a 3x3 kernel, by the output tile's side; F(2x2, 2x2) for the 2x2 phase kernels of an upsampling's convolution
# (upsample_phase_weights).
WINOGRAD_G = {
    2: ((1.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0.0, 0.0, 1.0)),
    4: (
        (1 / 4, 0.0, 0.0),
        (-1 / 6, -1 / 6, -1 / 6),
        (-1 / 6, 1 / 6, -1 / 6),
        (1 / 24, 1 / 12, 1 / 6),
        (1 / 24, -1 / 12, 1 / 6),
        (0.0, 0.0, 1.0),
    ),
}
_WINOGRAD_G2 = ((1.0, 0.0), (1.0, 1.0), (0.0, 1.0))


def winograd_weight(
    weight: torch.Tensor, *, upsample: bool = False, dtype: torch.dtype = torch.float32, tile: int = 2
) -> torch.Tensor:
    """A 3x3 convolution's weight (Cout, Cin, 3, 3) as :func:`conv3x3_winograd`'s operand, computed in float64:
    (16, Cin, Cout), U[4a + b, ci, co] = (G g G^T)[a, b] of the kernel g = weight[co, ci] in F(2x2, 3x3); with
    ``tile=4`` (float32 only) F(4x4, 3x3)'s (36, Cin, Cout), U[6a + b, ci, co]; or, for the
    convolution of the input upsampled 2x, (36, Cin, Cout): for each output phase p (upsample_phase_weights'
    order) its 2x2 kernel k's G2 k G2^T at rows 9p .. 9p + 8. float32; or, with ``dtype=torch.bfloat16`` (for a
    bfloat16 x), rounded to bfloat16 once and laid out in input-channel pairs, (16 or 36, Cin / 2, Cout, 2): the
    operand of AVX512-BF16's dot product."""
    if tile not in WINOGRAD_G or (tile != 2 and (upsample or dtype != torch.float32)):
        raise ValueError(f"winograd_weight: tile={tile} is not one of 2, or 4 for a float32 3x3 convolution")
    if not upsample:
        G = torch.tensor(WINOGRAD_G[tile], dtype=torch.float64, device=weight.device)
        u = torch.einsum("ai,ocij,bj->abco", G, weight.detach().double(), G)  # (t + 2, t + 2, Cin, Cout)
        u = u.reshape(G.shape[0] ** 2, weight.shape[1], weight.shape[0])
    else:
        G2 = torch.tensor(_WINOGRAD_G2, dtype=torch.float64, device=weight.device)
        phases = [
            torch.einsum("ai,ocij,bj->abco", G2, kernel, G2).reshape(9, weight.shape[1], weight.shape[0])
            for _, kernel in upsample_phase_weights(weight.detach())
        ]
        u = torch.cat(phases)
    if dtype == torch.float32:
        return u.float().contiguous()
    P, cin, cout = u.shape  # (P, Cin, Cout) -> (P, Cin / 2, Cout, 2): input channels 2c, 2c + 1 side by side
    return u.view(P, cin // 2, 2, cout).transpose(2, 3).to(dtype).contiguous()


def conv3x3_winograd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, upsample: bool = False
) -> torch.Tensor:
    """conv2d(x, g, bias, padding=1) for a 3x3 kernel g given as ``weight = winograd_weight(g)``, on the CPU in
    Winograd's F(2x2, 3x3) (``winograd_weight(g, tile=4)``: F(4x4, 3x3)) (BENCHMARKS.md, "Where the runner's time
    goes"). x: (B, Cin, H, W) channels-last, Cin and Cout multiples of 16: float32; or bfloat16 with the bfloat16
    transform (``dtype=torch.bfloat16``: bf16 GEMMs); or bfloat16 with a float32 transform (the mixed path: bf16 read
    and written, everything between in float32). Returns (B, Cout, H, W) channels-last in x's dtype. With
    ``upsample`` (weight from ``winograd_weight(g, upsample=True)``): conv2d(nearest-2x-upsample(x), g, bias,
    padding=1), (B, Cout, 2H, 2W), each output phase's 2x2 kernel in F(2x2, 2x2) and no upsampled tensor."""
    if _loaded_from is None:
        load_extension()
    extra = {"upsample": True} if upsample else {}
    return torch.ops.diffusion_kernels.conv3x3_winograd(x, weight, bias, **extra)


@functools.cache  # the loaded extension does not change under a running process
def winograd_mixed_available() -> bool:
    """Whether the extension (built, not compiled now) takes a bfloat16 x with a float32 transform in
    :func:`conv3x3_winograd` and its gradients (the mixed path): a build older than the path refuses it."""
    try:
        load_extension(allow_jit=False)
        x = torch.zeros(1, 16, 2, 2, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        conv3x3_winograd_weight_grad(x, x, tile=2)
        conv3x3_winograd(x, torch.zeros(16, 16, 16))
    except (ExtensionUnavailableError, RuntimeError):
        return False
    return True


def conv3x3_winograd_weight_grad(x: torch.Tensor, grad_out: torch.Tensor, *, tile: int = 2) -> torch.Tensor:
    """The gradient of the loss with respect to conv3x3_winograd's ``weight`` (float32 (16, Cin, Cout); ``tile=4``:
    F(4x4, 3x3)'s (36, Cin, Cout)), given the gradient ``grad_out`` (B, Cout, H, W) of its output for the input x
    (B, Cin, H, W), both channels-last float32 or both bfloat16 (the mixed path's; the sums in float32). Training
    takes it inside :func:`conv3x3_winograd_backward`, which also turns it into the 3x3 kernel's gradient."""
    if _loaded_from is None:
        load_extension()
    extra = {"tile": tile} if tile != 2 else {}
    return torch.ops.diffusion_kernels.conv3x3_winograd_weight_grad(x, grad_out, **extra)


def winograd_kernel(weight: torch.Tensor, *, tile: int, rotated: bool = False) -> torch.Tensor:
    """A float32 (Cout, Cin, 3, 3) kernel's transform in F(tile x tile, 3x3) as :func:`conv3x3_winograd`'s operand,
    (n * n, Cin, Cout) with n = tile + 2, computed in float32 (training's, each step; :func:`winograd_weight` is the
    runner's, once, in float64); ``rotated``: the kernel turned 180 degrees with its channels swapped, (n * n, Cout,
    Cin), the operand of the input's gradient."""
    if _loaded_from is None:
        load_extension()
    return torch.ops.diffusion_kernels.winograd_kernel(weight, tile, rotated)


def conv3x3_winograd_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, tile: int, wanted: tuple[bool, bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of conv2d(x, weight, bias, padding=1) computed in F(tile x tile, 3x3), given grad_out (B, Cout,
    H, W): (dL/dx channels-last, dL/dweight in weight's layout, dL/dbias), None where ``wanted`` says not. x and
    grad_out channels-last float32, or both bfloat16 (the mixed path's: dL/dx bfloat16, the others float32), weight a
    contiguous float32 (Cout, Cin, 3, 3)."""
    if _loaded_from is None:
        load_extension()
    grads = torch.ops.diffusion_kernels.conv3x3_winograd_backward(grad_out, x, weight, tile, list(wanted))
    return tuple(g if w else None for g, w in zip(grads, wanted))


def conv3x3_thin(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """conv2d(x, weight, bias, padding=1) for a channels-last float32 CPU x and a contiguous float32 weight (Cout,
    Cin, 3, 3) with 1 to THIN_MAX_CHANNELS channels on one side and a multiple of 8 on the other
    (:func:`thin_applies`), computed directly with the wide side along the vectors; channels-last out."""
    if _loaded_from is None:
        load_extension()
    return torch.ops.diffusion_kernels.conv3x3_thin(x, weight, bias)


def conv3x3_thin_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, wanted: tuple[bool, bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """:func:`conv3x3_winograd_backward`'s three gradients for :func:`conv3x3_thin`, None where ``wanted`` says not."""
    if _loaded_from is None:
        load_extension()
    grads = torch.ops.diffusion_kernels.conv3x3_thin_backward(grad_out, x, weight, list(wanted))
    return tuple(g if w else None for g, w in zip(grads, wanted))


# More channels on the thin side are as fast on oneDNN (BENCHMARKS.md, "The training step against its peers").
THIN_MAX_CHANNELS = 4  # diffusion_cpu.h's kThinChannels
# The capabilities whose oneDNN computes such convolutions slower than conv3x3_thin
# (BENCHMARKS.md, "The training step against its peers").
_THIN_FASTER_ON = ("AVX2", "AVX512")


def thin_is_fast() -> bool:
    """Whether this CPU computes the thin convolutions (:func:`thin_applies`) faster by :func:`conv3x3_thin` than by
    oneDNN, training and sampling alike, and the loaded extension has the ops."""
    return torch.backends.cpu.get_cpu_capability() in _THIN_FASTER_ON and has_op("conv3x3_thin_backward")


def thin_applies(conv: nn.Module) -> bool:
    """Whether :func:`conv3x3_thin` computes this module: a 2-D 3x3 convolution, stride 1, padding 1, no dilation or
    groups, zero padding, 1 to THIN_MAX_CHANNELS channels on one side and a multiple of 8 on the other."""
    if not _plain_3x3(conv):
        return False
    thin, wide = sorted((conv.in_channels, conv.out_channels))
    return 1 <= thin <= THIN_MAX_CHANNELS and wide % 8 == 0


@functools.cache
def has_winograd_tile4() -> bool:
    """Whether the loaded extension computes F(4x4, 3x3) (a build older than it has the 2x2 tile alone)."""
    if not has_op("conv3x3_winograd_weight_grad"):
        return False
    schema = torch.ops.diffusion_kernels.conv3x3_winograd_weight_grad.default._schema
    return any(argument.name == "tile" for argument in schema.arguments)


def winograd_tile(side: int) -> int:
    """The output tile of a float32 Winograd convolution of maps ``side`` on their shorter side: F(4x4, 3x3) from 4x4
    on, where it does fewer multiply-adds than F(2x2, 3x3) (BENCHMARKS.md, "The training step against its peers"),
    F(2x2, 3x3) below it or with an extension built before F(4x4, 3x3)."""
    return 4 if side >= 4 and has_winograd_tile4() else 2


# Wider layers stay on oneDNN: their transformed kernels (16 or 36 (Cin, Cout) matrices) no longer fit the cache
# (BENCHMARKS.md, "Where the runner's time goes", measured with F(2x2, 3x3)).
WINOGRAD_MAX_CHANNELS = 256


def _plain_3x3(conv: nn.Module) -> bool:
    """A 2-D 3x3 convolution, stride 1, padding 1, no dilation or groups, zero padding: the extension's 3x3 kernels'."""
    return (
        isinstance(conv, nn.Conv2d)
        and tuple(conv.kernel_size) == (3, 3)
        and tuple(conv.stride) == (1, 1)
        and tuple(conv.padding) == (1, 1)
        and tuple(conv.dilation) == (1, 1)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
    )


def winograd_applies(conv: nn.Module) -> bool:
    """Whether :func:`conv3x3_winograd` computes this module: a 2-D 3x3 convolution, stride 1, padding 1, no
    dilation or groups, zero padding, channel counts multiples of 16 up to WINOGRAD_MAX_CHANNELS."""
    return (
        _plain_3x3(conv)
        and conv.in_channels % 16 == 0
        and conv.out_channels % 16 == 0
        and max(conv.in_channels, conv.out_channels) <= WINOGRAD_MAX_CHANNELS
    )


# Nearest 2x upsampling then a 3-tap convolution (padding 1): output position 2i + a of each dimension reads
# upsampled positions 2i + a - 1, 2i + a, 2i + a + 1, which are input positions (a = 0) i - 1, i, i or (a = 1)
# i, i, i + 1. So per phase a the three taps fall on two input positions: _PHASE_TAPS[a][k] is the one tap k
# lands on (0: the lower, 1: the upper), and the taps landing together are summed.
_PHASE_TAPS = ((0, 1, 1), (0, 0, 1))


def upsample_phase_weights(weight: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The 2^dims phase kernels of conv(nearest-2x-upsample(x)) for a (Cout, Cin, 3, ...) weight: [(phase,
    (Cout, Cin, 2, ...) float64 kernel)], each a convolution of x itself (2 taps per dimension instead of 3
    per upsampled position: 4 instead of 9 multiply-adds per output in 2-D, 8 instead of 27 in 3-D)."""
    dims = weight.dim() - 2
    phases = []
    for offsets in itertools.product((0, 1), repeat=dims):
        kernel = torch.zeros((*weight.shape[:2], *(2,) * dims), dtype=torch.float64, device=weight.device)
        for taps in itertools.product(range(3), repeat=dims):
            lands = tuple(_PHASE_TAPS[a][k] for a, k in zip(offsets, taps))
            kernel[(slice(None), slice(None), *lands)] += weight[(slice(None), slice(None), *taps)].double()
        phases.append((offsets, kernel))
    return phases


# ----- Seeded dropout for training on a CPU -------------------------------------------------------
# ``seeded_dropout`` keeps element i when a SplitMix64 number of (seed, i) says so, which is cheaper on a CPU than
# torch's per-element Bernoulli draws; its backward pass is the same op on the gradient. Each call draws its seed
# from torch's global generator, so a resumed run continues the same curve.


_DROPOUT_OP = "diffusion_kernels::seeded_dropout"
_SEED_BOUND = 2**62  # seeds are drawn in [0, 2^62): any int64 works; this keeps randint's range exact


def seeded_dropout_available() -> bool:
    """Whether the built extension has seeded dropout (a trainer without it keeps nn.Dropout)."""
    return built_has_op("seeded_dropout")


def _register_dropout() -> None:
    """The op's autograd formula (the same op on the gradient) and its fake kernel (for torch.compile), registered
    as the extension loads, with the other ops' fake kernels."""
    if not hasattr(torch.ops.diffusion_kernels, "seeded_dropout"):  # a build older than the op
        return

    def setup_context(ctx, inputs, output):
        _, ctx.seed, ctx.p = inputs

    def backward(ctx, grad):
        # y = x * keep / (1 - p), so dL/dx = dL/dy * keep / (1 - p): the same op with the same seed.
        return torch.ops.diffusion_kernels.seeded_dropout(grad, ctx.seed, ctx.p), None, None

    torch.library.register_autograd(_DROPOUT_OP, backward, setup_context=setup_context)

    @torch.library.register_fake(_DROPOUT_OP)
    def _fake(x, seed, p):
        return torch.empty_like(x, memory_format=torch.contiguous_format)


class SeededDropout(nn.Module):
    """``nn.Dropout(p)`` with the extension's mask on a CPU (torch's own dropout elsewhere)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        seed = int(torch.randint(_SEED_BOUND, ()).item())  # from the global generator (a CPU tensor: no sync)
        if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            # Channels-last activations (a CPU training in fp32): the mask in (B, H, W, C) order, the memory's, so
            # that the output keeps their layout instead of making the next layers copy it back.
            nhwc = x.permute(0, 2, 3, 1)  # contiguous: a view of x's memory
            return torch.ops.diffusion_kernels.seeded_dropout(nhwc, seed, self.p).permute(0, 3, 1, 2)
        return torch.ops.diffusion_kernels.seeded_dropout(x, seed, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def replace_modules(
    model: nn.Module,
    applies: Callable[[nn.Module], bool],
    make: Callable[[nn.Module], nn.Module],
    *,
    available: Callable[[], bool] = lambda: True,
) -> int:
    """Replace each submodule of ``model`` (at any depth) for which ``applies(module)`` by ``make(module)``, when
    there is one and ``available()`` (asked only then); returns how many were replaced."""
    targets = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children() if applies(child)
    ]
    if not targets or not available():
        return 0
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)


def use_seeded_dropout(model: nn.Module) -> int:
    """Replace every ``nn.Dropout`` of ``model`` by a :class:`SeededDropout` of the same rate, when the extension
    has the op; returns how many were replaced. Dropout holds no weights, so the state dict is unchanged."""
    return replace_modules(
        model,
        lambda child: type(child) is nn.Dropout,
        lambda child: SeededDropout(child.p),
        available=seeded_dropout_available,
    )


def use_fused_norms(model: nn.Module, *, float32_softmax: bool = False) -> int:
    """Route every block's norms (their ``norm_act``, basic_diffusion) through :func:`fused_norm_act` when the built
    extension has the backward op; returns how many blocks. ``float32_softmax``: the attention blocks' bf16 path
    (torch's CPU flash attention is slow to differentiate in bf16). The state dict is unchanged."""
    blocks = [module for module in model.modules() if hasattr(module, "norm_act")]
    if not blocks or not norm_training_available():
        return 0
    for module in blocks:
        module.norm_act = fused_norm_act
    for module in model.modules():
        if float32_softmax and hasattr(module, "float32_softmax"):
            module.float32_softmax = True
    return len(blocks)
