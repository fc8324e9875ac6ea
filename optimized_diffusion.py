"""The "cuda" sampling implementation: fused custom ops, static buffers and one CUDA graph (:class:`FusedSampler`,
:func:`sample`), and the fused U-Net runner it may run (:class:`FusedUNet`). The ops themselves, and the
extension's loading and build, are in ddpm/kernels/.

Same calling convention as the original loop (:func:`basic_diffusion.sample`) and, in fp32 with the same seed,
the same images:

    from optimized_diffusion import sample
    images = sample(model, plan, shape=(64, 1, 28, 28), generator=g, precision="bf16")

Build the extension first (otherwise it is JIT-compiled on first use): ``pip install -e . --no-build-isolation``.

* ``torch.ops.diffusion_kernels.fused_step_`` does the whole update of :func:`noise_schedule.p_step` in one pass,
  in place, bit for bit as ``p_step``.
* x_t, the noise, DPM-Solver's previous pred_xstart, the timestep input and the step index live in static buffers;
  the ops read the step index on the device, so no step needs the host.
* On CUDA one denoising step (or a short plan whole) is captured as a CUDA graph and replayed; steps of the other
  kind (with or without noise) run the same code eagerly, so the generator is consumed as by the original loop.
  If capture fails the sampler says so in one line and runs eagerly.
* ``precision`` is "fp32", "bf16" or "fp16" (the sampler state stays float32); ``compile_model=True``
  (``--compile``) runs the U-Net through torch.compile inside the graph.

With ``precision="fp32"`` TF32 is off while sampling, so results match an fp32 original run under
:func:`backend_policy` ``("fp32")``; the previous settings are restored afterwards. On the CPU the same code runs
with the CPU kernels and no graph.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ddpm.conditioning import Guidance, unet_batch
from ddpm.kernels import ops
from ddpm.kernels.build import BUILD_COMMAND
from ddpm.util import precision as precision_policy
from ddpm.util.messages import first_line
from ddpm.util.phases import phase
from ddpm.util.precision import LOW_DTYPES, autocast, backend_policy, check_precision
from noise_schedule import NUM_COEFFICIENTS, SamplingPlan, guided_eps, p_step

# ----- The fused U-Net runner ---------------------------------------------------------------------


def winograd_is_fast(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this CPU runs conv3x3_winograd in ``dtype`` faster than oneDNN: float32 needs AVX-512 or AVX2 (whose
    GEMM has its own register blocking), bf16 needs AVX512-BF16 (BENCHMARKS.md, "The default path on an AVX2 CPU")."""
    if dtype == torch.bfloat16:
        return precision_policy.cpu_has_native_bf16()
    return dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")


def _is_same_3_tap(conv: nn.Module) -> bool:
    """A 3-tap, stride-1, padding-1, undilated, ungrouped convolution: what upsample_phase_weights rewrites."""
    d = conv.weight.dim() - 2
    ones = (1,) * d
    return (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.groups) == ((3,) * d, ones, ones, ones, 1)


class FusedUNet(nn.Module):
    """eps = runner(x_t, t[, y]): a :class:`basic_diffusion.UNet`'s forward with fused GroupNorm (+ embedding
    scale and shift) (+ SiLU) kernels, activations in ``dtype`` and (``channels_last``) NHWC / NDHWC, and the
    weights cast and laid out once. In fp32 it agrees with the U-Net to float rounding; the U-Net is not changed.

    Every block's embedding projection is one segment of a (rows, D) float32 table, ``projections(t, y)``; a
    sampler of an unconditional model computes it once per plan and passes a row (``forward(..., projections=row)``).
    On a CPU where :func:`winograd_is_fast`, 3x3 stride-1 convolutions run in Winograd's F(2x2, 3x3), float32's
    maps from 4x4 in F(4x4, 3x3) (``winograd=False``: oneDNN).
    """

    def __init__(
        self, unet: nn.Module, *, dtype: torch.dtype = torch.float32, channels_last: bool = True, winograd: bool = True
    ) -> None:
        from basic_diffusion import ResBlock

        super().__init__()
        self.unet, self.dtype = unet, dtype
        self.config = unet.config
        self.memory_format = (
            (torch.channels_last if self.config.dims == 2 else torch.channels_last_3d)
            if channels_last
            else torch.contiguous_format
        )
        # Convolutions: 3x3 ones in the activations' layout (cuDNN / oneDNN); 1x1 ones (a block's skip, attention's
        # qkv and proj) as GEMM operands (Cin, Cout) on the channels-last rows. A block's skip bias joins its conv2
        # bias (both end in the same sum), so the skip GEMM accumulates onto conv2's output with no bias of its own.
        self.packed: dict[nn.Module, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.float_biases: dict[nn.Module, torch.Tensor] = {}  # the 3x3 convolutions' (and skips') biases, float32
        skip_bias = {
            b.conv2: b.skip.bias
            for b in unet.modules()
            if isinstance(b, ResBlock) and not isinstance(b.skip, nn.Identity)
        }
        for module in unet.modules():
            if isinstance(module, (nn.Conv2d, nn.Conv3d)):
                bias = None if module.bias is None else module.bias.detach().float()
                if module in skip_bias:
                    bias = bias + skip_bias[module].detach().float()
                if bias is not None and any(k != 1 for k in module.kernel_size):
                    self.float_biases[module] = bias.contiguous()
                bias = None if bias is None else bias.to(dtype)
                if all(k == 1 for k in module.kernel_size):  # (Cout, Cin, 1, 1) -> (Cin, Cout)
                    weight = module.weight.detach().to(dtype).flatten(1).t().contiguous()
                else:
                    weight = module.weight.detach().to(dtype).contiguous(memory_format=self.memory_format)
                self.packed[module] = (weight, bias)
        # The blocks' embedding projections stacked: block i owns columns offsets[i]:offsets[i] + width. For
        # "add" conditioning the block's conv1 bias joins its projection's bias (both are added before norm2).
        blocks = [b for level in unet.down for b in level.blocks] + [unet.mid_block1, unet.mid_block2]
        blocks += [b for level in unet.up for b in level.blocks]
        weights, biases, self.offsets = [], [], {}
        for block in blocks:
            bias = block.emb_proj.bias.detach().float()
            if not block.scale_shift:
                bias = bias + block.conv1.bias.detach().float()
            self.offsets[block] = sum(w.shape[0] for w in weights)
            weights.append(block.emb_proj.weight.detach().float())
            biases.append(bias)
        self.projection_weight = torch.cat(weights).contiguous()  # (D, 4ch)
        self.projection_bias = torch.cat(biases).contiguous()  # (D,)
        self.norms = {  # float32 copies, made once
            m: (m.weight.detach().float().contiguous(), m.bias.detach().float().contiguous())
            for m in unet.modules()
            if isinstance(m, nn.GroupNorm)
        }
        self.conv1_biases = {b: b.conv1.bias.detach().float().contiguous() for b in blocks}

        # Where winograd_is_fast, the 3x3 stride-1 convolutions (and upsampling's, per output phase) in Winograd's
        # domain; elsewhere the packed weights above.
        on_cpu = all(p.device.type == "cpu" for p in unet.parameters())
        # On a GPU the runner adds a convolution's bias itself, with the residual stream, in one pass (bias_add_),
        # since cuDNN adds it in a separate pass; oneDNN fuses it, so the CPU keeps it in the convolution.
        self.separate_bias = not on_cpu and channels_last and ops.has_op("bias_add_")
        use_winograd = (
            winograd
            and on_cpu
            and channels_last
            and self.config.dims == 2
            and winograd_is_fast(dtype)
            and ops.has_op("conv3x3_winograd")
        )
        ups = [up for up in unet.upsample if not isinstance(up, nn.Identity)]
        self.winograd_upsample = {
            up: ops.winograd_weight(up.conv.weight, upsample=True, dtype=dtype)
            for up in ups
            if use_winograd and ops.winograd_applies(up.conv)
        }
        upsampling_convs = {up.conv for up in self.winograd_upsample}  # computed upsampling and all, above
        self.winograd = {
            conv: ops.winograd_weight(conv.weight, dtype=dtype)
            for conv in unet.modules()
            if use_winograd and ops.winograd_applies(conv) and conv not in upsampling_convs
        }
        # float32's maps of 4x4 and up in F(4x4, 3x3) (ops.winograd_tile), so each such kernel in both tiles.
        self.winograd4 = {
            conv: ops.winograd_weight(conv.weight, tile=4)
            for conv in self.winograd
            if dtype == torch.float32 and ops.has_winograd_tile4()
        }
        # The first and last convolutions, a few image or latent channels against the model's width, by the direct
        # kernels where they are faster (ops.thin_is_fast), their weights (Cout, Cin, 3, 3)-contiguous.
        self.thin = {
            conv: conv.weight.detach().float().contiguous()
            for conv in (unet.conv_in, unet.conv_out)
            if use_winograd and dtype == torch.float32 and ops.thin_applies(conv) and ops.thin_is_fast()
        }
        # Any other upsampling's convolution on the CPU as its phase kernels on the low-resolution input
        # (upsample_phase_weights; where the packed weights live; see _upsample_conv).
        self.upsample_phases = {
            up: [
                (phase, k.to(dtype).contiguous(memory_format=self.memory_format))
                for phase, k in ops.upsample_phase_weights(up.conv.weight.detach())
            ]
            for up in ups
            if on_cpu and _is_same_3_tap(up.conv) and up not in self.winograd_upsample
        }

    @torch.no_grad()
    def projections(self, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Every block's embedding projection for timesteps t (rows,) [and labels y]: (rows, D) float32."""
        emb = self.unet.embedding(t, y).float()  # (rows, 4ch)
        return torch.addmm(self.projection_bias, torch.nn.functional.silu(emb), self.projection_weight.t())

    def _conv(
        self,
        conv: nn.Module,
        x: torch.Tensor,
        *,
        with_bias: bool = True,
        residual: torch.Tensor | None = None,
        residual2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """conv(x) (+ its bias) (+ [residual, residual2], the residual stream), a new tensor in the runner's
        layout."""
        weight, bias = self.packed[conv]
        separate = with_bias and self.separate_bias and conv in self.float_biases  # added below, by bias_add_
        bias = bias if with_bias and not separate else None
        if conv in self.winograd:  # its bias in float32 (added to the float32 sums before rounding)
            bias = self.float_biases[conv] if bias is not None else None
            u = self.winograd[conv]
            if conv in self.winograd4 and ops.winograd_tile(min(x.shape[-2:])) == 4:
                u = self.winograd4[conv]
            out = ops.conv3x3_winograd(x.contiguous(memory_format=torch.channels_last), u, bias)
        elif conv in self.thin:
            out = ops.conv3x3_thin(x.contiguous(memory_format=torch.channels_last), self.thin[conv], bias)
        else:
            op = torch.nn.functional.conv2d if self.config.dims == 2 else torch.nn.functional.conv3d
            out = op(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        if separate:
            # One input or output channel makes channels-last ambiguous, and cuDNN may answer in NCHW.
            out = out.contiguous(memory_format=self.memory_format)
            residuals = [
                r if r is None else r.contiguous(memory_format=self.memory_format) for r in (residual, residual2)
            ]
            return ops.bias_add_(out, self.float_biases[conv], residual=residuals[0], residual2=residuals[1])
        if residual is not None:  # [residual, residual2] + out, in place: out is this call's own new tensor
            out[:, : residual.shape[1]].add_(residual)
            if residual2 is not None:
                out[:, residual.shape[1] :].add_(residual2)
        return out

    def _norm(self, norm: nn.GroupNorm, x: torch.Tensor, **kwargs) -> torch.Tensor:
        weight, bias = self.norms[norm]
        return ops.group_norm_act(x, weight, bias, groups=norm.num_groups, eps=norm.eps, **kwargs)

    def _upsample_conv(self, up: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """up.conv(nearest-2x-upsample(x)) without the upsampled tensor: each output phase (position 2i + a per
        dimension) is a convolution of x, zero-padded by one, with its phase kernel; the phases interleave. CPU
        only (BENCHMARKS.md, "Where the runner's time goes")."""
        if up in self.winograd_upsample:
            bias = self.float_biases.get(up.conv)
            return ops.conv3x3_winograd(
                x.contiguous(memory_format=torch.channels_last), self.winograd_upsample[up], bias, upsample=True
            )
        phases = self.upsample_phases.get(up)
        if phases is None:
            return self._conv(up.conv, torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"))
        _, bias = self.packed[up.conv]
        B, C, *spatial = x.shape
        padded = self._empty(B, C, [n + 2 for n in spatial], like=x).zero_()
        padded[(slice(None), slice(None), *(slice(1, n + 1) for n in spatial))] = x
        out = self._empty(B, bias.shape[0], [2 * n for n in spatial], like=x)
        op = torch.nn.functional.conv2d if self.config.dims == 2 else torch.nn.functional.conv3d
        for offsets, kernel in phases:  # offset a reads padded positions a + i, a + i + 1 (input i - 1 + a, i + a)
            window = padded[(slice(None), slice(None), *(slice(a, a + n + 1) for a, n in zip(offsets, spatial)))]
            out[(slice(None), slice(None), *(slice(a, None, 2) for a in offsets))] = op(window, kernel, bias)
        return out

    def _empty(self, batch: int, channels: int, spatial: list[int], *, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized (batch, channels, *spatial) tensor of like's dtype and device in the runner's layout."""
        if self.memory_format == torch.contiguous_format:
            return torch.empty((batch, channels, *spatial), dtype=like.dtype, device=like.device)
        return torch.empty((batch, *spatial, channels), dtype=like.dtype, device=like.device).movedim(-1, 1)

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """(B, C, *spatial) -> (B * positions, C): a view of a channels-last tensor (a copy otherwise)."""
        return x.movedim(1, -1).reshape(-1, x.shape[1])

    def _unrows(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(B * positions, C) -> (B, C, *spatial) of ``like``'s batch and positions, in the runner's layout."""
        B, _, *spatial = like.shape
        return rows.view(B, *spatial, rows.shape[1]).movedim(-1, 1).contiguous(memory_format=self.memory_format)

    def _gemm(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A 1x1 convolution as rows @ (Cin, Cout) + its bias: (B * positions, Cout)."""
        weight, bias = self.packed[conv]
        return torch.mm(self._rows(x), weight) if bias is None else torch.addmm(bias, self._rows(x), weight)

    def _res_block(
        self, block: nn.Module, x: torch.Tensor, projections: torch.Tensor, x2: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The block on [x, x2] (x2: the up path's skip connection; never concatenated but for an identity skip)."""
        h = self._conv(block.conv1, self._norm(block.norm1, x, x2=x2), with_bias=False)  # its bias: folded into norm2
        C, start = h.shape[1], self.offsets[block]
        if block.scale_shift:  # (rows, C) views of the table: no copies
            scale, shift = projections[:, start : start + C], projections[:, start + C : start + 2 * C]
            h = self._norm(block.norm2, h, x_bias=self.conv1_biases[block], scale=scale, shift=shift)
        else:  # "add": the embedding (with conv1's bias) is a per-sample bias before the norm
            e = projections[:, start : start + C]
            h = self._norm(block.norm2, h + e.to(h.dtype).reshape(*e.shape, *(1,) * self.config.dims))
        if isinstance(block.skip, nn.Identity):  # conv2(h) + its bias + [x, x2]; dropout: identity when sampling
            return self._conv(block.conv2, h, residual=x, residual2=x2)
        h = self._conv(block.conv2, h)  # bias: conv2's + the skip's
        # skip([x, x2]) + h: GEMMs accumulating in place onto h's rows (h is this block's own new tensor), x2's
        # part through the weight's other rows: [x, x2] @ W = x @ W[:C1] + x2 @ W[C1:].
        weight, _ = self.packed[block.skip]
        rows, c1 = self._rows(h), x.shape[1]  # a view of h, or (an NCHW runner) a copy: ours to write either way
        rows.addmm_(self._rows(x), weight[:c1])
        if x2 is not None:
            rows.addmm_(self._rows(x2), weight[c1:])
        return self._unrows(rows, h)

    def _attention(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(block, nn.Identity):
            return x
        B, C, *spatial = x.shape
        heads = block.num_heads
        qkv = self._gemm(block.qkv, self._norm(block.norm, x, silu=False))  # (B * positions, 3C): [3][heads][C/heads]
        q, k, v = (
            qkv.view(B, -1, 3, heads, C // heads).permute(2, 0, 3, 1, 4).unbind(0)
        )  # each (B, heads, positions, C/heads)
        if x.device.type == "cpu" and self.dtype == torch.bfloat16:  # PyTorch's bf16 CPU attention is slower
            q, k, v = q.float(), k.float(), v.float()
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v).to(self.dtype)
        h = h.transpose(1, 2).reshape(-1, C)  # (B * positions, C)
        weight, bias = self.packed[block.proj]
        out = torch.addmm(bias, h, weight).add_(self._rows(x))  # proj(h) + x (x may be a skip still to be read)
        return self._unrows(out, x)

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        projections: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from basic_diffusion import depth_to_space, space_to_depth

        unet, config = self.unet, self.config
        if projections is None:
            projections = self.projections(t, y)  # (B, D) float32
        projections = projections.expand(x_t.shape[0], -1)  # a (1, D) row of a per-step table serves the whole batch
        p = config.patch_size
        x = space_to_depth(x_t, p) if p > 1 else x_t
        h = self._conv(unet.conv_in, x.to(self.dtype).contiguous(memory_format=self.memory_format))
        # One input channel makes channels-last ambiguous, and the convolution may answer in NCHW: put it back.
        h = h.contiguous(memory_format=self.memory_format)
        skips = [h]
        for level, down in zip(unet.down, unet.downsample):
            for block, attention in zip(level.blocks, level.attentions):
                h = self._attention(attention, self._res_block(block, h, projections))
                skips.append(h)
            if not isinstance(down, nn.Identity):
                h = self._conv(down.conv, down.padded(h))
                skips.append(h)
        h = self._res_block(unet.mid_block1, h, projections)
        h = self._res_block(unet.mid_block2, self._attention(unet.mid_attention, h), projections)
        for level, up in zip(unet.up, unet.upsample):
            for block, attention in zip(level.blocks, level.attentions):
                h = self._attention(attention, self._res_block(block, h, projections, x2=skips.pop()))
            if not isinstance(up, nn.Identity):
                h = self._upsample_conv(up, h)
        out = self._conv(unet.conv_out, self._norm(unet.norm_out, h))
        out = out.float().contiguous()
        return depth_to_space(out, p) if p > 1 else out  # x_t's shape, float32


# ----- Where cuda runs the runner, and what a device has -------------------------------------------


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
        return precision_policy.cpu_has_native_bf16() if native_bf16 is None else native_bf16
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
        on_cpu = device.type == "cpu"
        capability = torch.backends.cpu.get_cpu_capability() if on_cpu else ""
        native = on_cpu and precision_policy.cpu_has_native_bf16()
        bf16_forced = native and precision_policy.bf16_forced()
        return cls(device.type, _extension_built(device.type), capability, native, bf16_forced)


def _extension_built(device_type: str) -> bool:
    if importlib.util.find_spec("_diffusion_kernels") is None:
        return False
    try:
        ops.load_extension(allow_jit=False)
        return device_type != "cuda" or ops.has_cuda_kernels()
    except ImportError:
        return False


# ----- The sampler --------------------------------------------------------------------------------


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator ``torch.randn(..., generator=None, device=device)`` would use."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _check_arguments(plan: SamplingPlan, *, shape: tuple[int, ...], precision: str, warmup_iters: int) -> None:
    """One-line ValueErrors for a sampler's arguments, before anything is built."""
    check_precision(precision)
    if len(shape) not in (4, 5) or min(shape) < 1:
        raise ValueError(f"shape must be four or five positive sizes (B, C, H, W) or (B, C, D, H, W), got {shape}")
    S = plan.num_steps
    if tuple(plan.coefficients.shape) != (S, NUM_COEFFICIENTS) or tuple(plan.timesteps.shape) != (S,):
        raise ValueError(
            f"inconsistent sampling plan: {S} steps, timesteps {tuple(plan.timesteps.shape)}, "
            f"coefficients {tuple(plan.coefficients.shape)}"
        )
    if warmup_iters < 1:
        raise ValueError(f"warmup_iters must be at least 1, got {warmup_iters}")


# Plans of up to this many steps (students, few-step solvers) are captured whole, so no host work runs between
# steps; longer plans replay one captured step per step to keep capture time and memory small.
WHOLE_PLAN_STEPS = 64


class FusedSampler:
    """Runs one :class:`SamplingPlan` on static buffers with the fused ops; on CUDA, CUDA graphs.

    Construction allocates the buffers and, on CUDA, warms up and captures one denoising step (or, for plans of
    up to :data:`WHOLE_PLAN_STEPS` steps, every step in one graph); each call then draws x_T from the caller's
    generator and runs every step. Reuse one sampler for many calls with the same model, plan and shape.

    ``fused_step=False`` runs :func:`noise_schedule.p_step` (on the step's coefficient row, gathered
    on the device) instead of the fused op, for callers that must work without the extension (the
    tensorrt implementation); everything else is the same.

    The model should be in eval mode, as for the original loop.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: SamplingPlan,
        *,
        shape: tuple[int, int, int, int],
        precision: str = "fp32",
        use_cuda_graph: bool = True,
        compile_model: bool | str = False,  # True: torch.compile's default mode; a string: that mode
        warmup_iters: int = 3,
        log: Callable[[str], None] | None = None,  # where the capture-failure notice goes (default print)
        fused_step: bool = True,
        guidance: Guidance | None = None,  # class-conditional models: null label and scale (labels come per call)
        fused_unet: bool = False,
        whole_plan: bool | None = None,  # one graph for every step (None: for plans of up to WHOLE_PLAN_STEPS)
        winograd: bool = True,  # the runner's 3x3 convolutions in Winograd where winograd_is_fast (False: oneDNN's)
    ) -> None:
        shape = tuple(int(s) for s in shape)
        _check_arguments(plan, shape=shape, precision=precision, warmup_iters=warmup_iters)
        self._fused = fused_step
        if fused_step:
            ops.load_extension()
        self.plan, self.shape, self.precision = plan, shape, precision
        self.device = plan.coefficients.device  # like the original: sample where the plan lives
        if fused_step and self.device.type == "cuda" and not ops.has_cuda_kernels():
            raise ops.ExtensionUnavailableError(
                f"the diffusion_kernels extension was built without CUDA kernels; rebuild it where the CUDA "
                f"toolkit is installed: {BUILD_COMMAND}"
            )
        # 1. The network: the model, or its fused runner; torch.compile as asked.
        self._build_network(
            model, fused_unet=fused_unet, guidance=guidance, compile_model=compile_model, winograd=winograd
        )
        # 2. Static buffers (float32 sampler state, whatever the precision).
        self._allocate_buffers(guidance)
        # 3. On CUDA, one captured step or the whole plan in one graph (or, if capture fails, eager steps).
        self.whole_plan = whole_plan if whole_plan is not None else plan.num_steps <= WHOLE_PLAN_STEPS
        self._prepare_graph(use_cuda_graph=use_cuda_graph, warmup_iters=warmup_iters, log=log)

    def _build_network(
        self,
        model: nn.Module,
        *,
        fused_unet: bool,
        guidance: Guidance | None,
        compile_model: bool | str,
        winograd: bool = True,
    ) -> None:
        precision, plan = self.precision, self.plan
        self._fused_unet = fused_unet
        if fused_unet:  # the runner holds the precision (weights cast once) and its own NHWC layout: no autocast
            from basic_diffusion import UNet

            if not isinstance(model, UNet):
                raise ValueError(
                    "the fused U-Net runner is built from a PyTorch U-Net (a checkpoint), not from this model"
                )
            if not self._fused:
                raise ValueError("the fused U-Net runner needs the diffusion_kernels extension (fused_step=True)")
            dtype = torch.float32 if precision == "fp32" else LOW_DTYPES[precision]
            model = FusedUNet(model, dtype=dtype, winograd=winograd)
        self.unet_runner: FusedUNet | None = model if fused_unet else None  # what the benchmark reports of it
        # An unconditional runner's embedding projections depend on the timestep alone: one (S, D) table for the
        # plan, computed here, whose row the device-side step counter picks (graph-safe, no per-step MLP).
        self._projection_table = (
            model.projections(plan.timesteps.to(self.device, torch.int64)) if fused_unet and guidance is None else None
        )
        mode = compile_model if isinstance(compile_model, str) else None
        self._model = torch.compile(model, dynamic=False, mode=mode) if compile_model else model

    def _allocate_buffers(self, guidance: Guidance | None) -> None:
        plan, shape = self.plan, self.shape
        B = shape[0]
        # Class-conditional: the U-Net's label input; guided, it runs on the batch twice (cond, then null label).
        self._guidance = guidance
        rows = unet_batch(B, guidance)
        self._y = torch.full((rows,), guidance.null_label, dtype=torch.int64, device=self.device) if guidance else None
        self._coefficients = plan.coefficients.to(self.device, torch.float32).contiguous()  # (S, 7)
        self._timesteps = plan.timesteps.to(self.device, torch.int64).contiguous()  # (S,)
        self._step = torch.zeros((), dtype=torch.int64, device=self.device)  # device-side step counter
        self._t = torch.zeros(rows, dtype=torch.int64, device=self.device)  # (B,) or (2B,) U-Net timestep input
        self._x = torch.zeros(shape, device=self.device)  # (B, C, H, W) x_t, updated in place
        # DPM-Solver++'s history: the previous step's pred_xstart (zero before the first step,
        # where c_prev = 0). Other samplers do not store pred_xstart at all.
        self._xstart = torch.zeros(shape, device=self.device) if plan.uses_prev_xstart else None
        self._noise = torch.zeros(shape, device=self.device) if any(plan.noise_steps) else None  # z, NCHW
        # Per-step noise comes from this private generator, loaded with the caller's state at the
        # start of each call and handed back at the end; so one captured graph serves any generator.
        self._rng = torch.Generator(device=self.device)

    def _prepare_graph(self, *, use_cuda_graph: bool, warmup_iters: int, log: Callable[[str], None] | None) -> None:
        on_cuda, S = self.device.type == "cuda", self.plan.num_steps
        # The graph holds the more common kind of step (with noise or without); the others run
        # the same step eagerly, so noise is drawn for exactly the steps the original draws it for.
        noisy = sum(self.plan.noise_steps)
        self._graph_draws_noise = 2 * noisy >= S and noisy > 0
        self._graph: torch.cuda.CUDAGraph | None = None
        # A dedicated stream: the legacy default stream synchronizes with every other stream.
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.capture_error: str | None = None  # why the step runs eagerly, if capture failed
        if on_cuda and use_cuda_graph:
            with torch.no_grad(), torch.cuda.device(self.device), backend_policy(self.precision):
                try:
                    self._graph = self._capture(warmup_iters)
                except RuntimeError as exc:  # e.g. an op that capture refuses: sample eagerly instead
                    torch.cuda.synchronize(self.device)
                    self._graph = None
                    self._rng = torch.Generator(device=self.device)  # the failed graph registered the old one
                    self.capture_error = first_line(exc)
                    (log or print)(f"note: CUDA graph capture failed ({self.capture_error}); sampling eagerly")

    @property
    def captured(self) -> bool:
        """Whether the steps replay a CUDA graph."""
        return self._graph is not None

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._fused_unet:
            return contextlib.nullcontext()  # the runner computes in its dtype (weights cast once)
        # cache_enabled=False: autocast's weight-cast cache must not outlive a graph capture.
        return autocast(self.device.type, self.precision, cache_enabled=False)

    def _denoise_step(self, *, draw_noise: bool) -> None:
        """One reverse step on the static buffers: the step counter picks t and the coefficients."""
        if self._fused:
            ops.gather_timestep_(self._t, timesteps=self._timesteps, step=self._step)  # t[:] = timesteps[step]
        else:
            self._t.copy_(self._timesteps.index_select(0, self._step.view(1)).expand_as(self._t))
        guidance = self._guidance.scale if self._guidance is not None and self._guidance.doubled else None
        # (2B, C, H, W) when guided: with the labels, then with the null label.
        x_in = self._x if guidance is None else torch.cat([self._x, self._x])
        # Predict the noise: eps_theta(x_t, t[, y]), (B or 2B, C, H, W) in the autocast dtype.
        with phase("unet"), self._autocast():
            if self._projection_table is not None:  # (1, D): this step's row of the plan's table
                eps = self._model(x_in, self._t, projections=self._projection_table.index_select(0, self._step.view(1)))
            else:
                eps = self._model(x_in, self._t) if self._y is None else self._model(x_in, self._t, self._y)
        eps = eps.contiguous()  # x's NCHW layout, as the fused op requires (no copy when it already is)
        noise = None
        if draw_noise:
            # z ~ N(0, I) into a float32 NCHW buffer: the same draw as the original's torch.randn.
            with phase("noise"):
                noise = self._noise.normal_(generator=self._rng)
        if self._fused:
            with phase("fused_step"):
                ops.fused_step_(
                    self._x,
                    eps,
                    noise=noise,
                    xstart=self._xstart,
                    coefficients=self._coefficients,
                    step=self._step,
                    clip_denoised=self.plan.clip_denoised,
                    use_prev=self._xstart is not None,
                    guidance=guidance,  # the combine happens inside the fused step
                )
        else:
            # The reference p_step on this step's row of the table, gathered on the device (graph-safe).
            row = replace(self.plan, coefficients=self._coefficients.index_select(0, self._step.view(1)))  # (1, 7)
            eps = guided_eps(eps, guidance) if guidance is not None else eps
            x_prev, pred_xstart = p_step(row, 0, self._x, eps, noise=noise, prev_xstart=self._xstart)
            self._x.copy_(x_prev)
            if self._xstart is not None:
                self._xstart.copy_(pred_xstart)
        self._step.add_(1)  # advance the device-side counter (no sync)

    def _capture(self, warmup_iters: int) -> torch.cuda.CUDAGraph:
        # Warm up on the sampler's own stream (cuDNN autotuning, lazy initialization,
        # torch.compile), as capture requires; the buffers and the private generator are reset
        # per call. thread_local: another thread's CUDA calls cannot invalidate the capture.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        kinds = sorted(set(self.plan.noise_steps)) if self.whole_plan else [self._graph_draws_noise]
        with torch.cuda.stream(self._stream):
            for _ in range(warmup_iters):
                for draw_noise in kinds:  # each kind of step the graph will hold
                    self._step.zero_()  # stay in range for plans shorter than the warm-up
                    self._denoise_step(draw_noise=draw_noise)
            self._step.zero_()
            graph = torch.cuda.CUDAGraph()
            graph.register_generator_state(self._rng)  # replays read and advance its philox offset
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                if self.whole_plan:  # every step in order, each with or without noise as the plan says
                    for draw_noise in self.plan.noise_steps:
                        self._denoise_step(draw_noise=draw_noise)
                else:
                    self._denoise_step(draw_noise=self._graph_draws_noise)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return graph

    @torch.no_grad()
    def __call__(
        self, *, generator: torch.Generator | None = None, progress: bool = False, guidance: Guidance | None = None
    ) -> torch.Tensor:
        """Draw images (B, C, H, W) float32 in [-1, 1]: a new tensor (the buffers are reused). A class-conditional
        sampler takes the batch's labels in ``guidance`` (its scale and null label as at construction)."""
        if generator is not None and generator.device.type != self.device.type:
            raise ValueError(f"the generator is on {generator.device} but the plan samples on {self.device}")
        if (guidance is None) != (self._guidance is None):
            raise ValueError(
                "this sampler was built for a class-conditional model: pass the labels"
                if guidance is None
                else "this sampler was built for an unconditional model: it takes no labels"
            )
        if guidance is not None:
            if (guidance.scale, guidance.null_label) != (self._guidance.scale, self._guidance.null_label):
                raise ValueError("the guidance scale and null label are fixed when the sampler is built")
            self._y.copy_(guidance.model_labels())  # before any replay: the graph reads this buffer
        caller_rng = generator if generator is not None else _default_generator(self.device)
        on_cuda = self.device.type == "cuda"
        device_context = torch.cuda.device(self.device) if on_cuda else contextlib.nullcontext()
        stream_context = torch.cuda.stream(self._stream) if on_cuda else contextlib.nullcontext()
        if on_cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the caller's pending work first
        with device_context, stream_context, backend_policy(self.precision):
            # x_T ~ N(0, I): drawn first, from the caller's generator, exactly as the original does.
            self._x.normal_(generator=caller_rng)
            if self._xstart is not None:
                self._xstart.zero_()
            self._step.zero_()
            # The rest of the caller's random stream continues in the private generator.
            self._rng.set_state(caller_rng.get_state())
            steps = range(self.plan.num_steps)
            if progress:
                from tqdm.auto import tqdm

                steps = tqdm(steps, desc=f"sampling ({self.plan.sampler}, cuda)", leave=False)
            if self._graph is not None and self.whole_plan:
                with phase("graph_replay"):  # every step: U-Nets, noise and fused steps
                    self._graph.replay()
                if progress:
                    steps.update(self.plan.num_steps)
                    steps.close()
            else:
                for i in steps:
                    draws_noise = self.plan.noise_steps[i]  # host tuple: no sync
                    if self._graph is not None and draws_noise == self._graph_draws_noise:
                        with phase("graph_replay"):  # the whole step: U-Net, noise and fused step
                            self._graph.replay()
                    else:
                        self._denoise_step(draw_noise=draws_noise)
            caller_rng.set_state(self._rng.get_state())  # hand the advanced stream back
            images = self._x.clone()
        if on_cuda:
            # The caller's stream sees the finished images (no host sync).
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            images.record_stream(torch.cuda.current_stream(self.device))
        return images


def sample(
    model: nn.Module,
    plan: SamplingPlan,
    *,
    shape: tuple[int, int, int, int],
    generator: torch.Generator | None,
    precision: str = "fp32",
    use_cuda_graph: bool = True,
    compile_model: bool = False,
    progress: bool = False,
    guidance: Guidance | None = None,
    fused_unet: bool = False,
) -> torch.Tensor:
    """Draw images (B, C, H, W) in [-1, 1]: :func:`basic_diffusion.sample`, fused and graphed.

    Same arguments and generator use as the original; in fp32 the same images from the same seed
    (to float tolerance on CUDA, where cuDNN may pick other algorithms). See :class:`FusedSampler`
    for the options; this builds one (capturing the graph) per call.
    """
    sampler = FusedSampler(
        model,
        plan,
        shape=shape,
        precision=precision,
        use_cuda_graph=use_cuda_graph,
        compile_model=compile_model,
        guidance=guidance,
        fused_unet=fused_unet,
    )
    return sampler(generator=generator, progress=progress, guidance=guidance)
