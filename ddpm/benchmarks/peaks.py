"""The machine's peak for MFU, measured in the benchmark's own run, and the CPU's name and vector extensions.

    rates = measure_peaks(model, shape=(64, 1, 16, 16), device=cpu, precisions=("fp32",))
    # {"fp32": {"matmul 2048^3 (MKL)": tflops, "conv 128->128 3x3 at 64x16x16, NHWC (oneDNN)": tflops, ...}}
    mfu = row_tflops / peak(rates["fp32"])

The peak of a precision is the fastest of a large square matmul and of the U-Net's own largest convolution in
both layouts, each timed through the library the rows use (MKL or cuBLAS, oneDNN or cuDNN), since one library
alone is not the machine's peak. A row that does fewer multiply-adds (Winograd) reports its direct-equivalent rate.
Each measurement is bounded in time (MEASURE_BUDGET_S, MATMUL_CALL_S).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# The extensions a reader of a CPU benchmark wants named, in /proc/cpuinfo's spelling, oldest first.
VECTOR_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_description(cpuinfo: str) -> str:
    """'MODEL (ext, ext, ...)' from /proc/cpuinfo's text: the first processor's model name and its vector
    extensions among :data:`VECTOR_FLAGS`; '' when the text names neither."""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    extensions = [f for f in VECTOR_FLAGS if f in flags]
    if not model and not extensions:
        return ""
    return f"{model or 'unknown CPU'} ({', '.join(extensions) or 'no vector extensions listed'})"


def this_cpu() -> str:
    """This machine's :func:`cpu_description` ('' off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_description(f.read())
    except OSError:
        return ""


# Each measurement stops repeating once it has run this long (after at least one warm-up and one timed call), and
# a CPU's matmul is sized so that one call stays under MATMUL_CALL_S, since a signal is only handled between calls
# and emulated bf16 is slow.
MEASURE_BUDGET_S = 1.5
MATMUL_CALL_S = 0.25
MATMUL_PROBE_N = 256
CPU_MATMUL_N, GPU_MATMUL_N = 2048, 8192


def median_seconds(
    fn: Callable[[], object],
    *,
    device: torch.device,
    warmup: int = 3,
    repeats: int = 10,
    deadline: float | None = None,
) -> float:
    """The median time of ``fn`` after ``warmup`` untimed calls (CUDA events on a GPU). With ``deadline`` (a
    ``time.perf_counter()`` value) the calls stop once it has passed, after at least one warm-up and one timed
    call."""

    def over() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    for i in range(warmup):
        if i and over():
            break
        fn()
    times: list[float] = []
    for _ in range(repeats):
        if times and over():
            break
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()  # sync: read the call's time
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_size(probe_seconds: float, *, probe_n: int = MATMUL_PROBE_N, max_n: int = CPU_MATMUL_N) -> int:
    """The largest power-of-two size up to ``max_n`` (at least ``probe_n``) whose matmul should take at most
    MATMUL_CALL_S, from one ``probe_n``-sized call's time (the work grows as n^3)."""
    n = probe_n
    while n * 2 <= max_n and probe_seconds * ((n * 2) / probe_n) ** 3 <= MATMUL_CALL_S:
        n *= 2
    return n


def cpu_matmul_size(dtype: torch.dtype, *, max_n: int = CPU_MATMUL_N) -> int:
    """:func:`matmul_size` for ``dtype`` on this CPU: one warm-up and one timed call at MATMUL_PROBE_N."""
    a = torch.randn(MATMUL_PROBE_N, MATMUL_PROBE_N, dtype=dtype)
    a @ a  # the first call builds the library's kernels
    t0 = time.perf_counter()
    a @ a
    return matmul_size(time.perf_counter() - t0, max_n=max_n)


def matmul_tflops(
    dtype: torch.dtype,
    *,
    device: torch.device,
    n: int | None = None,
    repeats: int = 10,
    deadline: float | None = None,
) -> float:
    """A square matmul's achieved TFLOP/s (MKL on a CPU, cuBLAS on a GPU); n: 8192 on a GPU, on a CPU the
    largest up to 2048 whose call stays short (:func:`cpu_matmul_size`)."""
    n = n or (GPU_MATMUL_N if device.type == "cuda" else cpu_matmul_size(dtype))
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / median_seconds(lambda: a @ b, device=device, repeats=repeats, deadline=deadline) / 1e12


@dataclass(frozen=True)
class ConvShape:
    """One convolution as the U-Net runs it: its module and its input's shape."""

    conv: torch.nn.Module
    input_shape: tuple[int, ...]

    @property
    def flops(self) -> int:
        """2 per multiply-add of the direct convolution (stride 1 or not: the output's positions count)."""
        per_output = self.conv.in_channels // self.conv.groups * math.prod(self.conv.kernel_size)
        return 2 * math.prod(self.output_shape) * per_output

    @property
    def output_shape(self) -> tuple[int, ...]:
        x = torch.empty(self.input_shape, device="meta")
        weight = torch.empty(self.conv.weight.shape, device="meta")
        return tuple(self._call(x, weight).shape)

    def _call(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        fn = torch.nn.functional.conv2d if x.dim() == 4 else torch.nn.functional.conv3d
        c = self.conv
        return fn(x, weight, None, c.stride, c.padding, c.dilation, c.groups)

    def label(self, layout: str, library: str) -> str:
        k = "x".join(map(str, self.conv.kernel_size))
        size = "x".join(map(str, self.input_shape[2:]))
        n = self.input_shape[0]
        return f"conv {self.conv.in_channels}->{self.conv.out_channels} {k} at {n}x{size}, {layout} ({library})"


def largest_convolution(forward: Callable[[], object], model: torch.nn.Module) -> ConvShape | None:
    """The convolution of ``model`` with the most FLOPs in one call of ``forward`` (hooks record the inputs)."""
    seen: list[ConvShape] = []

    def hook(module, args):
        seen.append(ConvShape(module, tuple(args[0].shape)))

    handles = [
        m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))
    ]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return max(seen, key=lambda s: s.flops, default=None)


def conv_tflops(
    shape: ConvShape, dtype: torch.dtype, *, device: torch.device, channels_last: bool, deadline: float | None = None
) -> float:
    """The convolution's achieved TFLOP/s (oneDNN on a CPU, cuDNN on a GPU) in one layout, on random data."""
    x = torch.randn(shape.input_shape, device=device, dtype=dtype)
    weight = shape.conv.weight.detach().to(device, dtype)
    if channels_last:
        layout = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        x, weight = x.contiguous(memory_format=layout), weight.contiguous(memory_format=layout)
    with torch.no_grad():
        seconds = median_seconds(lambda: shape._call(x, weight), device=device, deadline=deadline)
    return shape.flops / seconds / 1e12


def measure_peaks(
    forward: Callable[[], object], model: torch.nn.Module, *, device: torch.device, dtypes: dict[str, torch.dtype]
) -> dict[str, dict[str, float]]:
    """precision -> {what was timed: TFLOP/s}: a square matmul and the U-Net's largest convolution (found by
    running ``forward`` once) in NCHW and NHWC, through the libraries the rows use, each for about
    MEASURE_BUDGET_S (a CPU's matmul as large as stays within MATMUL_CALL_S a call). Call under the fp32 backend
    policy (no TF32), as the fp32 rows run."""
    biggest = largest_convolution(forward, model)
    matmul_lib, conv_lib = ("cuBLAS", "cuDNN") if device.type == "cuda" else ("MKL", "oneDNN")
    peaks: dict[str, dict[str, float]] = {}
    for name, dtype in dtypes.items():
        n = GPU_MATMUL_N if device.type == "cuda" else cpu_matmul_size(dtype)
        deadline = time.perf_counter() + MEASURE_BUDGET_S
        rates = {f"matmul {n}^3 ({matmul_lib})": matmul_tflops(dtype, device=device, n=n, deadline=deadline)}
        if biggest is not None:
            for layout, channels_last in (("NCHW", False), ("NHWC", True)):
                deadline = time.perf_counter() + MEASURE_BUDGET_S
                rates[biggest.label(layout, conv_lib)] = conv_tflops(
                    biggest, dtype, device=device, channels_last=channels_last, deadline=deadline
                )
        peaks[name] = rates
    return peaks


def peak(rates: dict[str, float]) -> float | None:
    """The machine's peak among the measured rates: the fastest (None if nothing was measured)."""
    return max(rates.values(), default=None)


def mfu(tflops: float, rates: dict[str, float] | None) -> float | None:
    """A row's TFLOP/s over the peak of its precision (None without a measured peak)."""
    best = peak(rates or {})
    return tflops / best if best else None
