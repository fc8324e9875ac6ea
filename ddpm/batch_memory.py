"""Will one batch fit in memory? Estimate a U-Net step's peak bytes without allocating, and refuse early.

A request whose single batch cannot fit (``--img_size 1024`` for training, a checkpoint that
declares a huge U-Net, a ``--n_samples`` far too large) is refused before any work, with a line
that says how much it needs, how much there is and the largest batch that fits; an out-of-memory
error that still happens (the estimate is an estimate) is recognized by util/memory.is_out_of_memory
so the CLI can end it in one line on a CPU as on a GPU.

How the estimate is made: the U-Net is built on the ``meta`` device (shapes, no storage) and one
step runs there under a dispatch mode that tracks the bytes of every live tensor storage, so even a
1024x1024 step costs nothing but a few thousand Python calls. Every live total in the step is a fixed
part plus a per-sample part times the batch, so one trace gives the peak at any batch.

    check_batch_fits(config, batch_size=64, device=torch.device("cpu"), training=True)   # ValueError if not
    estimate_peak_bytes(config, batch_size=64, training=True)                          # -> bytes

What memory there is comes from ddpm/util/memory.py.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from basic_diffusion import UNet, UNetConfig
from ddpm.util import memory
from ddpm.util.messages import format_bytes

# The estimate counts the bytes of live tensors, as the allocator hands them out. The process holds
# more: on a CPU, glibc keeps freed blocks under its mmap threshold (up to 32 MiB) in the heap, so the
# peak RSS runs above the estimate (not with MALLOC_MMAP_THRESHOLD_ fixed); CUDA's caching allocator
# rounds and fragments its blocks too. The factor covers what the CPU's RSS exceeded the estimate by.
ALLOCATOR_OVERHEAD = 1.25
# The step is traced at one of these prime batch sizes (free on meta): the first that divides no
# dimension of the model, so a storage's size divides by it exactly when it holds per-sample data.
_TRACE_BATCHES = (1009, 1013, 1019, 1021, 1031)


# ----- the estimate --------------------------------------------------------------------------------
class _StorageTracker(TorchDispatchMode):
    """Live bytes of the storages ops create while the mode is on, split into per-sample and fixed.

    A storage whose byte count divides by the traced batch (a prime that divides no dimension of the
    model) holds per-sample data; any other (gradients, weight-shaped temporaries) is fixed. After each
    op, ``trace`` gets (fixed bytes, per-sample bytes) live: at batch B, that moment holds fixed + B * per-sample.
    """

    def __init__(self, *, batch_size: int, compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.compute_dtype = compute_dtype  # cast floating inputs to this (a whole-model cast), or None
        self.fixed = self.per_sample = 0
        self.trace: list[tuple[int, int]] = []
        self._seen: weakref.WeakSet = weakref.WeakSet()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Never traced by torch.compile; not wrapping __torch_dispatch__ in dynamo.disable spares
        # importing torch._dynamo (seconds, once) and a wrapper call per op.
        return False

    def _release(self, fixed: int, per_sample: int) -> None:
        self.fixed -= fixed
        self.per_sample -= per_sample

    def _cast(self, a):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != self.compute_dtype:
            return a.to(self.compute_dtype)  # not traced: the mode is off inside its own handler
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.compute_dtype is not None:
            args, kwargs = tree_map(self._cast, (args, kwargs))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()  # views share it (and its Python object), so count it once
            if storage in self._seen:
                continue
            self._seen.add(storage)
            nbytes = storage.nbytes()
            fixed, per_sample = (0, nbytes // self.batch_size) if nbytes % self.batch_size == 0 else (nbytes, 0)
            self.fixed += fixed
            self.per_sample += per_sample
            weakref.finalize(storage, self._release, fixed, per_sample)  # when the last tensor on it dies
        self.trace.append((self.fixed, self.per_sample))
        return out


class _GroupNormAllocations(torch.autograd.Function):
    """GroupNorm's allocations without its arithmetic: meta's group norm is a slow Python decomposition.

    Forward: the output and the per-(sample, group) mean and 1/std, saving the input, both stats
    and the weight; backward: the input's, weight's and bias's gradients. As the CPU and CUDA kernels.
    """

    @staticmethod
    def forward(ctx, x, num_groups, weight, bias):
        stats = (x.shape[0], num_groups)
        mean, rstd = x.new_empty(stats), x.new_empty(stats)
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.bias_shape = None if bias is None else bias.shape
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, _, _, weight = ctx.saved_tensors
        grad_weight = None if weight is None else torch.empty_like(weight)
        grad_bias = None if ctx.bias_shape is None else grad.new_empty(ctx.bias_shape)
        return torch.empty_like(x), None, grad_weight, grad_bias


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):  # F.group_norm's signature
    return _GroupNormAllocations.apply(input, num_groups, weight, bias)


class _FastGroupNorm(TorchFunctionMode):
    """F.group_norm as :class:`_GroupNormAllocations` (the same allocations, without meta's slow decomposition).

    Attention needs no stand-in: its q, k and v are transposed views whose last dimension's stride
    is not 1, which rules out SDPA's fused kernels ("All fused kernels require the last dimension of
    the input to have stride 1"), so a CPU run takes the math form and materializes the (HW x HW)
    scores, as meta tensors do (measured). On CUDA in channels-last (training, the cuda sampler) that
    stride is 1 and a fused kernel may run: there the estimate is high, never low.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.group_norm:
            return _group_norm(*args, **kwargs)
        return func(*args, **kwargs)


def _trace_batch(model: UNet) -> int:
    """The first of _TRACE_BATCHES that divides no dimension a fixed-size tensor of the step can have."""
    cfg = model.config
    dims = {d for p in model.parameters() for d in p.shape} | {cfg.image_size, cfg.in_channels, cfg.model_channels // 2}
    for prime in _TRACE_BATCHES:
        if all(d % prime for d in dims if d):
            return prime
    raise ValueError(f"cannot estimate the memory of a U-Net with these dimensions: {sorted(dims)}")


def _trace_step(model: UNet, *, training: bool, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(fixed, per-sample) live bytes after every op of one step on ``meta``: the inputs, the forward,
    and for training the loss and backward (which leaves the gradients)."""
    cfg = model.config
    batch_size = _trace_batch(model)
    shape = cfg.sample_shape(batch_size)
    tracker = _StorageTracker(batch_size=batch_size, compute_dtype=None if dtype == torch.float32 else dtype)
    with _FastGroupNorm(), tracker:
        x = torch.empty(shape, device="meta", dtype=dtype)  # (B, C, H, W[, D]) x_t
        t = torch.empty((batch_size,), device="meta", dtype=torch.long)
        labels = [torch.empty((batch_size,), device="meta", dtype=torch.long)] if cfg.num_classes else []  # y
        if training:
            # As training.Trainer.train_step: the previous step's gradients live through the forward,
            # until zero_grad(set_to_none=True) just before the backward makes new ones.
            for p in model.parameters():
                p.grad = torch.empty_like(p)
            noise = torch.empty(shape, device="meta", dtype=dtype)  # the target, alive through the step
            loss = F.mse_loss(model(x, t, *labels).float(), noise.float())
            model.zero_grad(set_to_none=True)
            loss.backward()
            del loss, noise
        else:
            with torch.no_grad():
                eps = model(x, t, *labels)  # (B, C, H, W)
            del eps
        del x, t, labels
    return tracker.trace


@functools.lru_cache(maxsize=32)
def _peak_lines(
    model_config: UNetConfig, training: bool, dtype: torch.dtype, grad_checkpoint: bool = False
) -> tuple[tuple[int, int], ...]:
    """(per-sample bytes, fixed bytes) of each moment of the step that can be the peak.

    peak(B) = max(fixed + B * per_sample)."""
    with torch.device("meta"):
        model = model_config.build()
    model = model.to(dtype).train(training).requires_grad_(training)
    model.grad_checkpoint = grad_checkpoint  # the residual blocks keep only their inputs for the backward
    # Held through the whole step, outside the trace: the weights; training adds the EMA copy and AdamW's two moments.
    weights = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    state = weights * (4 if training else 1)
    best: dict[int, int] = {}  # per-sample bytes -> the most fixed bytes seen with them
    for fixed, per_sample in _trace_step(model, training=training, dtype=dtype):
        best[per_sample] = max(best.get(per_sample, 0), fixed + state)
    if training:
        # The optimizer step, after the backward: the state, the gradients and, on a CPU, AdamW's
        # per-tensor temporaries (two of the largest weight's size); the batch of images is small beside it.
        largest = max(p.nbytes for p in model.parameters())
        best[0] = max(best.get(0, 0), state + weights + 2 * largest)
    return tuple(sorted(best.items()))


def estimate_peak_bytes(
    model_config: UNetConfig,
    *,
    batch_size: int,
    training: bool,
    dtype: torch.dtype = torch.float32,
    grad_checkpoint: bool = False,
) -> int:
    """Peak bytes of one U-Net step on a batch: weights, inputs and activations; training adds autograd's
    saved tensors, the backward, the gradients, the EMA weights and AdamW's state.

    Sampling is one forward under ``no_grad`` (the sampler's few image-sized tensors are included as
    the input and output). ``dtype`` is the dtype of weights and activations; mixed-precision runs
    keep fp32 weights and some fp32 activations, so float32 is their safe bound. Cached per
    (config, training, dtype): a new config takes a fraction of a second, and the first in a process
    seconds more, while torch's meta kernels import what they use (sympy, torch._dynamo).
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    from torch.utils.checkpoint import CheckpointError

    try:
        lines = _peak_lines(model_config, training, dtype, grad_checkpoint and training)
    except CheckpointError:
        # The trace's stand-in GroupNorm saves other tensors than the recomputation finds: estimate the
        # step without checkpointing, an upper bound (a batch it refuses may still fit with it).
        lines = _peak_lines(model_config, training, dtype, False)
    return max(intercept + batch_size * slope for slope, intercept in lines)


def upper_bound_bytes(
    model_config: UNetConfig, *, batch_size: int, training: bool, dtype: torch.dtype = torch.float32
) -> int:
    """A generous bound on :func:`estimate_peak_bytes`, from the config alone, in microseconds.

    When even this fits, the trace is skipped: its first run in a process costs seconds of imports.
    Per sample: 64 * (2 * num_res_blocks + 2) tensors of the widest feature map at full resolution
    when training (a U-Net level holds 2 * num_res_blocks + 1 blocks of about a dozen saved tensors,
    and each lower level has a quarter of the pixels), 8 * (2 * num_res_blocks + 2) when sampling
    (the skip connections and a few working tensors are live), plus four (HW x HW) score tensors per head for every
    block that may attend at each attention resolution and the middle; fixed: eight copies of the
    weights (weights, EMA, gradients, AdamW's two moments and temporaries). Tested to stay above the
    trace's estimate.
    """
    cfg = model_config
    item = torch.empty((), dtype=dtype).element_size()
    width = cfg.model_channels * max(cfg.channel_mult)
    maps = (64 if training else 8) * (2 * cfg.num_res_blocks + 2) * width * cfg.image_size**cfg.dims
    attended = set(cfg.attention_resolutions) | {cfg.resolutions[-1]}
    scores = sum(4 * (2 * cfg.num_res_blocks + 3) * cfg.num_heads * r ** (2 * cfg.dims) for r in attended)
    with torch.device("meta"):  # counts the weights without allocating them
        weights = sum(p.numel() for p in cfg.build().parameters())
    per_sample = (maps + scores) * item
    return batch_size * per_sample + 8 * weights * 4


# ----- the check -----------------------------------------------------------------------------------
def check_batch_fits(
    model_config: UNetConfig,
    *,
    batch_size: int,
    device: torch.device,
    training: bool,
    flag: str = "--batch_size",
    extra_bytes: int = 0,
    dtype: torch.dtype = torch.float32,
    grad_checkpoint: bool = False,
) -> None:
    """Refuse (ValueError, one line) a batch whose step would need more than 90% of the available memory.

    What a step needs is its estimate times ALLOCATOR_OVERHEAD, plus ``extra_bytes``: what the run
    holds besides the step (a dataset in memory, the output images). The message names ``flag``
    and the largest batch that fits.
    """
    if batch_size < 1:
        raise ValueError(f"{flag} must be at least 1, got {batch_size}")

    def needed(batch: int) -> int:
        estimate = estimate_peak_bytes(
            model_config, batch_size=batch, training=training, dtype=dtype, grad_checkpoint=grad_checkpoint
        )
        return int(estimate * ALLOCATOR_OVERHEAD) + extra_bytes

    available = memory.available_bytes(device)
    budget = memory.SAFETY_FRACTION * available
    bound = upper_bound_bytes(model_config, batch_size=batch_size, training=training, dtype=dtype)
    if int(bound * ALLOCATOR_OVERHEAD) + extra_bytes <= budget or needed(batch_size) <= budget:
        return
    lo, hi = 0, batch_size  # lo fits (0: nothing does), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if needed(mid) <= budget else (lo, mid)
    shape = "x".join(map(str, model_config.sample_shape(1)[1:]))
    advice = (
        f"the largest {flag} that fits is {lo}"
        if lo
        else "not even a batch of 1 fits: use a smaller --img_size or model"
    )
    raise ValueError(
        f"one {'training' if training else 'sampling'} batch of {batch_size} at {shape} needs about "
        f"{format_bytes(needed(batch_size))} of memory and {format_bytes(available)} is available on "
        f"{torch.device(device).type} ({memory.SAFETY_FRACTION:.0%} of it may be used); {advice}"
    )
