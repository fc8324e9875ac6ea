"""Dropout for training on a CPU: the extension's ``seeded_dropout`` op in place of ``nn.Dropout``.

``seeded_dropout`` keeps element i when a SplitMix64 number of (seed, i) says so, which is cheaper on a CPU than
torch's per-element Bernoulli draws (BENCHMARKS.md, "A faster CPU training step"); its backward pass is the same op
on the gradient. Each call draws its seed from torch's global generator, so a resumed run continues the same curve.

    from ddpm.training.dropout import use_seeded_dropout
    use_seeded_dropout(model)   # -> the number of nn.Dropout modules replaced (0 without the extension)

On other devices SeededDropout uses torch's dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_OP = "diffusion_kernels::seeded_dropout"
_SEED_BOUND = 2**62  # seeds are drawn in [0, 2^62): any int64 works; this keeps randint's range exact

_registered = False


def seeded_dropout_available() -> bool:
    """Whether the built extension has the op (no JIT compile here: a trainer without it keeps nn.Dropout)."""
    from ddpm.kernels.ops import ExtensionUnavailableError, load_extension

    try:
        load_extension(allow_jit=False)
    except ExtensionUnavailableError:
        return False
    if not hasattr(torch.ops.diffusion_kernels, "seeded_dropout"):  # a build older than the op
        return False
    _register()
    return True


def _register() -> None:
    """The op's autograd formula (the same op on the gradient) and its fake kernel (for torch.compile), once."""
    global _registered
    if _registered:
        return

    def setup_context(ctx, inputs, output):
        _, ctx.seed, ctx.p = inputs

    def backward(ctx, grad):
        # y = x * keep / (1 - p), so dL/dx = dL/dy * keep / (1 - p): the same op with the same seed.
        return torch.ops.diffusion_kernels.seeded_dropout(grad, ctx.seed, ctx.p), None, None

    torch.library.register_autograd(_OP, backward, setup_context=setup_context)

    @torch.library.register_fake(_OP)
    def _fake(x, seed, p):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    _registered = True


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


def use_seeded_dropout(model: nn.Module) -> int:
    """Replace every ``nn.Dropout`` of ``model`` by a :class:`SeededDropout` of the same rate, when the extension
    has the op; returns how many were replaced. Dropout holds no weights, so the state dict is unchanged."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Dropout
    ]
    if not targets or not seeded_dropout_available():
        return 0
    for parent, name, child in targets:
        setattr(parent, name, SeededDropout(child.p))
    return len(targets)
