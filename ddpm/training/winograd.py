"""3x3 convolutions trained in Winograd's domain on a CPU: F(4x4, 3x3) on maps of 4x4 and up, F(2x2, 3x3) on
smaller ones; the sampling runner's kernel for the forward pass, the extension's ``conv3x3_winograd_backward`` for
all three gradients in one call. Beside them, on CPUs where oneDNN's are slower (AVX2), 1x1 convolutions as one GEMM
over the channels-last pixels, and each residual block's first norm and 1x1 skip as one function of the block's input
and the up path's skip connection side by side (no concatenation either way), and the U-Net's first and last 3x3
convolutions (a few image or latent channels against the model's width) by the extension's direct kernels.

For y = conv2d(x, g, b, padding=1) with U = G g G^T (the kernel in Winograd's domain):
- forward: ``conv3x3_winograd(x, U, b)``;
- dL/dx: the same convolution of dL/dy with the kernel rotated 180 degrees and its channels swapped;
- dL/dg = G^T (dL/dU) G, where dL/dU sums each tile's transformed input against its transformed output gradient;
- dL/db: dL/dy summed over the batch and the positions.
Activations stay channels-last (NHWC), the kernels' layout, so the layers between convolutions run on the same
memory without reorders.

    from ddpm.training.winograd import use_winograd_convs
    use_winograd_convs(model)   # -> the number of nn.Conv2d modules now trained in Winograd's domain
    # or, what the trainer calls: Winograd's from maps of ``side`` and, where this CPU gains, 1x1 GEMMs
    use_cpu_convs(model, side=1)   # -> the run's line on them ("" where nothing was swapped)

The trainer swaps them in for fp32 channels-last CPU runs wherever :func:`faster_from` says this CPU trains them faster,
and the 3x3 ones for bf16 runs where :func:`mixed_is_fast` (bf16 activations in and out, float32 between).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from basic_diffusion import norm_and_skip
from ddpm.kernels import ops
from ddpm.util.precision import bf16_forced, cpu_has_amx, cpu_has_native_bf16

# The smallest feature map whose convolutions train faster in Winograd's domain than in oneDNN's, by the CPU's kernels:
# every map on AVX2 and on AVX-512 (BENCHMARKS.md, "The training step against its peers").
_MIN_SIDE = {"AVX2": 1, "AVX512": 1}
# The capabilities whose oneDNN trains 1x1 convolutions slower than a GEMM does, and the largest map side where it
# does: every map with AVX2's kernels, 8x8 and smaller with AVX-512's
# (BENCHMARKS.md, "The training step against its peers").
_GEMM_1X1 = {"AVX2": None, "AVX512": 8}


def faster_from() -> int | None:
    """The side of the smallest feature map whose fp32 3x3 convolutions this CPU trains faster in Winograd's domain
    (by the capability ATen runs, as the sampling runner's choice reads it); None where oneDNN's are faster
    everywhere (other CPUs) or the extension lacks the ops."""
    side = _MIN_SIDE.get(torch.backends.cpu.get_cpu_capability())
    return side if side is not None and weight_grad_available() else None


def mixed_is_fast() -> bool:
    """Whether this CPU trains a bf16 step's 3x3 convolutions faster in fp32 Winograd on the bf16 activations (the
    extension's mixed path: bf16 read and written, float32 between) than oneDNN's bf16 convolutions: AVX-512 with
    AVX512-BF16's dot products but no AMX tiles, where oneDNN's bf16 has no tiles to run on (BENCHMARKS.md, "The
    training step against its peers"); and the built extension has the path."""
    return (
        faster_from() is not None
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
        and cpu_has_native_bf16()
        and not bf16_forced()
        and not cpu_has_amx()
        and ops.winograd_mixed_available()
    )


def trained_from(*, precision: str, enabled: bool, largest: int) -> int | None:
    """The side from which a channels-last CPU run trains its 3x3 convolutions in Winograd's domain: this CPU's
    :func:`faster_from` for fp32 runs (and bf16 runs where :func:`mixed_is_fast`) with ``enabled``
    (TrainConfig.winograd_convs) whose U-Net has maps that large (``largest``: its first level's side); None for the
    others."""
    taken = precision == "fp32" or precision == "bf16" and mixed_is_fast()
    side = faster_from() if enabled and taken else None
    return side if side is not None and largest >= side else None


def describe(
    side: int, *, gemm_1x1: bool = False, gemm_up_to: int | None = None, thin: bool = False, mixed: bool = False
) -> str:
    """The run's line on where its convolutions run in Winograd's domain (in fp32 on bf16 activations where
    ``mixed``; and whether its 1x1 ones are GEMMs, on maps up to ``gemm_up_to`` on a side where not on all, and its
    thin first and last ones direct)."""
    return (
        "Winograd 3x3 convolutions"
        + (" in fp32 on bf16 activations" if mixed else "")
        + (f" on maps from {side}x{side}" if side > 1 else "")
        + (", 1x1 convolutions as GEMMs" if gemm_1x1 else "")
        + (f" on maps up to {gemm_up_to}x{gemm_up_to}" if gemm_1x1 and gemm_up_to is not None else "")
        + (", the first and last convolutions direct" if thin else "")
    )


def gemm_1x1() -> bool:
    """Whether this CPU trains fp32 1x1 convolutions faster as GEMMs (:class:`GemmConv1x1`) than oneDNN does, on
    some maps (:func:`gemm_1x1_up_to`)."""
    return torch.backends.cpu.get_cpu_capability() in _GEMM_1X1


def gemm_1x1_up_to() -> int | None:
    """The largest map side whose 1x1 convolutions this CPU trains faster as GEMMs; None for every map (or where
    :func:`gemm_1x1` is False)."""
    return _GEMM_1X1.get(torch.backends.cpu.get_cpu_capability())


def use_cpu_convs(model: nn.Module, *, side: int, precision: str = "fp32") -> str:
    """Swap in this CPU's faster convolutions (Winograd's from maps of ``side``; in an fp32 run also 1x1 GEMMs where
    :func:`gemm_1x1`, fused with the blocks' first norms where those are the extension's, and the thin first and last
    ones direct where ddpm.kernels.ops.thin_is_fast); returns the run's line on them, "" where nothing was swapped."""
    if not use_winograd_convs(model, side=side):
        return ""
    if precision == "bf16":  # the mixed path: the 3x3 convolutions only (the others' kernels are float32's)
        return describe(side, mixed=True)
    up_to = gemm_1x1_up_to()
    swapped = gemm_1x1() and use_gemm_1x1_convs(model, max_side=up_to) > 0
    if swapped:
        use_fused_skips(model)
    thin = use_thin_convs(model) > 0
    return describe(side, gemm_1x1=swapped, gemm_up_to=up_to, thin=thin)


def weight_grad_available() -> bool:
    """Whether the built extension has the ops (no JIT compile here: a trainer without them keeps oneDNN's)."""
    try:
        ops.load_extension(allow_jit=False)
    except ops.ExtensionUnavailableError:
        return False
    return ops.has_op("conv3x3_winograd_backward")  # False for a build older than the op


def _computes(x: torch.Tensor) -> bool:
    """Whether the extension's kernels take this input: float32 on a CPU, outside autocast (whose convolutions stay
    ``nn.Conv2d``'s)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def _mixed(x: torch.Tensor) -> bool:
    """Whether the extension's mixed path takes this input to a 3x3 convolution: a bf16 step's activations on a CPU
    (bfloat16, read and written so, the convolution computed in float32 on the float32 weights)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


class _WinogradConv3x3(torch.autograd.Function):
    """conv2d(x, weight, bias, padding=1) for a 3x3 kernel, forward and backward in Winograd's domain."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
        x, weight = _channels_last(x), weight.contiguous()  # the ops' layouts (the trainer's kernels already are)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.tile = bias is not None, tile
        return ops.conv3x3_winograd(x, ops.winograd_kernel(weight, tile=tile), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        # One op: the input's gradient (the convolution of grad with g rotated 180 degrees, in and out swapped), the
        # kernel's (G^T dL/dU G) and the bias's.
        return *ops.conv3x3_winograd_backward(_channels_last(grad), x, weight, tile=ctx.tile, wanted=wanted), None


def conv3x3(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, tile: int | None = None
) -> torch.Tensor:
    """conv2d(x, weight, bias, padding=1), differentiable, for float32 CPU tensors of channel counts that are
    multiples of 16 (ddpm.kernels.ops.winograd_applies), in F(tile x tile, 3x3) (by default ops.winograd_tile of x's
    maps); channels-last out."""
    return _WinogradConv3x3.apply(x, weight, bias, tile or ops.winograd_tile(min(x.shape[-2:])))


class WinogradConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (3x3, stride 1, padding 1) computed by :func:`conv3x3` for float32 CPU inputs of maps at
    least ``min_side`` on a side, and for bfloat16 ones (the mixed path: a bf16 step's, output in bfloat16), by
    ``nn.Conv2d`` otherwise; the same parameters and state-dict keys."""

    min_side: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (_computes(x) or _mixed(x)) or min(x.shape[-2:]) < self.min_side:
            return super().forward(x)
        return conv3x3(x, self.weight, self.bias)


class _ThinConv3x3(torch.autograd.Function):
    """conv2d(x, weight, bias, padding=1) for a 3x3 kernel with few channels on one side, forward and backward by the
    extension's direct kernels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x, weight = _channels_last(x), weight.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return ops.conv3x3_thin(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        return ops.conv3x3_thin_backward(_channels_last(grad), x, weight, wanted=wanted)


class ThinConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (3x3, stride 1, padding 1, few channels on one side: ddpm.kernels.ops.thin_applies) computed
    by the extension's direct kernels for float32 CPU inputs, by ``nn.Conv2d`` otherwise; the same parameters and
    state-dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ThinConv3x3.apply(x, self.weight, self.bias) if _computes(x) else super().forward(x)


class GemmConv1x1(nn.Conv2d):
    """An ``nn.Conv2d`` of a 1x1 kernel (stride 1, no padding, one group) computed as ``F.linear`` over the pixels
    of a float32 CPU input of maps at most ``max_side`` on a side (a GEMM on channels-last memory, no reorder), by
    ``nn.Conv2d`` otherwise; the same parameters and state-dict keys."""

    max_side: int | None = None  # None: every map

    def computes(self, x: torch.Tensor) -> bool:
        """Whether this input goes through the GEMM (the fused norm and skip ask it too)."""
        return _computes(x) and (self.max_side is None or min(x.shape[-2:]) <= self.max_side)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.computes(x):
            return super().forward(x)
        weight = self.weight.view(self.out_channels, self.in_channels)
        return F.linear(x.permute(0, 2, 3, 1), weight, self.bias).permute(0, 3, 1, 2)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A channels-last (B, C, H, W) tensor as its (B * H * W, C) rows, a view of the same memory."""
    return t.permute(0, 2, 3, 1).view(-1, t.shape[1])


# Row chunks of a 1x1 weight gradient's product: MKL runs 8 batched products over chunks of the pixels and their sum
# faster than one product whose inner dimension is every pixel of the batch.
_TN_CHUNKS, _TN_MIN_ROWS = 8, 16384


def _tn(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g^T x for rows g (N, a) and x (N, b) (a 1x1 convolution's weight gradient over a batch's pixels): (a, b)."""
    n = g.shape[0]
    if n % _TN_CHUNKS or n < _TN_MIN_ROWS:
        return g.t() @ x
    chunks = (_TN_CHUNKS, n // _TN_CHUNKS)
    return torch.bmm(g.view(*chunks, -1).transpose(1, 2), x.view(*chunks, -1)).sum(0)


class _NormActSkip(torch.autograd.Function):
    """A residual block's first GroupNorm + SiLU and its 1x1 skip, both of x, or of x and x2's channels side by
    side without their concatenation (the U-Net's up path); the skip's input gradient is added into the norm's by
    the GEMM itself rather than summed by autograd afterwards."""

    @staticmethod
    def forward(ctx, x, x2, norm_weight, norm_bias, weight, bias, groups: int, eps: float):
        # x (B, C1, H, W), x2 (B, C2, H, W) or None: channels-last float32; weight (out, C1 + C2, 1, 1).
        h = torch.ops.diffusion_kernels.group_norm_act(
            x, x2, norm_weight, norm_bias, None, None, None, groups=groups, eps=eps, silu=True
        )
        w, c1 = weight.view(weight.shape[0], -1), x.shape[1]
        skipped = _rows(x) @ w[:, :c1].t() if bias is None else torch.addmm(bias, _rows(x), w[:, :c1].t())
        if x2 is not None:
            skipped.addmm_(_rows(x2), w[:, c1:].t())
        ctx.save_for_backward(x, x2, norm_weight, norm_bias, w)
        ctx.options, ctx.has_bias = dict(groups=groups, eps=eps, silu=True), bias is not None
        B, _, H, W = x.shape
        return h, skipped.view(B, H, W, -1).permute(0, 3, 1, 2)  # (B, out, H, W), channels-last

    @staticmethod
    def backward(ctx, grad_h, grad_skipped):
        x, x2, norm_weight, norm_bias, w = ctx.saved_tensors
        dx, dx2, dnorm_weight, dnorm_bias, _, _ = torch.ops.diffusion_kernels.group_norm_act_backward(
            _channels_last(grad_h), x, x2, norm_weight, norm_bias, None, None, **ctx.options
        )
        g, c1 = _rows(_channels_last(grad_skipped)), x.shape[1]  # (B * H * W, out)
        _rows(dx).addmm_(g, w[:, :c1])
        dweight = g.t() @ _rows(x)  # (out, C1)
        if x2 is not None:
            _rows(dx2).addmm_(g, w[:, c1:])
            dweight = torch.cat([dweight, g.t() @ _rows(x2)], dim=1)
        dbias = g.sum(0) if ctx.has_bias else None
        dx2 = dx2 if x2 is not None else None
        return dx, dx2, dnorm_weight, dnorm_bias, dweight.view(*w.shape, 1, 1), dbias, None, None


def fused_norm_and_skip(block: nn.Module, x: torch.Tensor, x2: torch.Tensor | None = None):
    """:func:`basic_diffusion.norm_and_skip` by :class:`_NormActSkip` for float32 CPU inputs whose skip is a
    :class:`GemmConv1x1` GEMM at their size and whose norms are the extension's; by norm_and_skip otherwise."""
    skip = block.skip
    if not isinstance(skip, GemmConv1x1) or block.norm_act is not ops.fused_norm_act or not skip.computes(x):
        return norm_and_skip(block, x, x2)
    norm = block.norm1
    return _NormActSkip.apply(
        _channels_last(x),
        None if x2 is None else _channels_last(x2),
        norm.weight,
        norm.bias,
        skip.weight,
        skip.bias,
        norm.num_groups,
        norm.eps,
    )


def use_fused_skips(model: nn.Module) -> int:
    """Route the first norm and the 1x1 skip of each residual block whose skip is a :class:`GemmConv1x1` and whose
    norms are the extension's (ddpm.kernels.ops.use_fused_norms) through :func:`fused_norm_and_skip`; returns how
    many blocks. The state dict is unchanged."""
    blocks = [
        module
        for module in model.modules()
        if hasattr(module, "norm_and_skip")
        and isinstance(module.skip, GemmConv1x1)
        and module.norm_act is ops.fused_norm_act
    ]
    for block in blocks:
        block.norm_and_skip = fused_norm_and_skip
    return len(blocks)


def is_plain_1x1(conv: nn.Module) -> bool:
    """Whether ``conv`` is an ``nn.Conv2d`` that :class:`GemmConv1x1` computes: a 1x1 kernel, stride 1, no padding."""
    return (
        type(conv) is nn.Conv2d
        and conv.kernel_size == (1, 1)
        and conv.stride == (1, 1)
        and conv.padding in ((0, 0), "valid")
        and conv.dilation == (1, 1)
        and conv.groups == 1
    )


def use_gemm_1x1_convs(model: nn.Module, *, max_side: int | None = None) -> int:
    """Replace each plain 1x1 ``nn.Conv2d`` of ``model`` (:func:`is_plain_1x1`) by a :class:`GemmConv1x1` holding its
    parameters, a GEMM on maps up to ``max_side`` on a side (None: every map); returns how many. The state dict is
    unchanged."""

    def gemm(conv: nn.Conv2d) -> GemmConv1x1:
        new = _holding(conv, GemmConv1x1, 1)
        new.max_side = max_side
        return new

    return ops.replace_modules(model, is_plain_1x1, gemm)


def _holding(conv: nn.Conv2d, cls: type[nn.Conv2d], kernel_size: int, **kwargs) -> nn.Conv2d:
    """A ``cls`` convolution holding ``conv``'s own parameters (the optimizer and the EMA keep pointing at them)."""
    with torch.device("meta"):
        new = cls(conv.in_channels, conv.out_channels, kernel_size, bias=conv.bias is not None, **kwargs)
    new.weight, new.bias = conv.weight, conv.bias
    new.train(conv.training)
    return new


def _as_winograd(conv: nn.Conv2d, *, side: int) -> WinogradConv2d:
    """A WinogradConv2d holding ``conv``'s own parameters, its kernel NCHW-contiguous (the Parameter kept, its memory
    re-laid): each step reads it as (Cout * Cin, 9) taps and its gradient comes out so, where a channels-last kernel
    costs a copy each way."""
    conv.weight.data = conv.weight.data.contiguous()
    new = _holding(conv, WinogradConv2d, 3, padding=1)
    new.min_side = side
    return new


def use_thin_convs(model: nn.Module) -> int:
    """Replace each 3x3 convolution of ``model`` with few channels on one side (ddpm.kernels.ops.thin_applies: the
    U-Net's first and last) by a :class:`ThinConv2d` holding its parameters, on a CPU where
    ddpm.kernels.ops.thin_is_fast (with an extension that has the ops); returns how many. The state dict is
    unchanged."""

    def thin(conv: nn.Conv2d) -> ThinConv2d:
        conv.weight.data = conv.weight.data.contiguous()  # the kernels' layout, as for Winograd's
        return _holding(conv, ThinConv2d, 3, padding=1)

    return ops.replace_modules(
        model,
        lambda child: type(child) is nn.Conv2d and ops.thin_applies(child),
        thin,
        available=lambda: weight_grad_available() and ops.thin_is_fast(),
    )


def use_winograd_convs(model: nn.Module, *, side: int = 1) -> int:
    """Replace each 3x3 convolution of ``model`` that the kernels compute (ddpm.kernels.ops.winograd_applies)
    by a :class:`WinogradConv2d` holding its parameters, in Winograd's domain on maps of at least ``side`` on a side,
    when the extension has the ops; returns how many. The state dict is unchanged."""
    return ops.replace_modules(
        model,
        lambda child: type(child) is nn.Conv2d and ops.winograd_applies(child),
        lambda conv: _as_winograd(conv, side=side),
        available=weight_grad_available,
    )
