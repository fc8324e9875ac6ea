"""Benchmark mode: every sampling implementation side by side, on the same model, noise and plan.

    python main.py --mode benchmark --n_samples 64 --img_size 28 --channels 1 --sampler ddpm
    python main.py --mode benchmark --model_path checkpoints/mnist.pt --sampler ddim --json bench.json

Each row runs one implementation (original fp32 eager, cuda, torch.compile of the original
U-Net, and the export-based rows when their packages are there) with the same sampler, steps,
batch, seed and precision. A row that cannot run is listed with its reason, never dropped.

Timing: warm-up runs are excluded; on a GPU each run is bracketed by CUDA events (the device
is synchronized once per run, when the events are read); on a CPU, ``time.perf_counter``.
``--repeats`` runs give the median and the min-max. Memory: the peak of
``torch.cuda.max_memory_allocated`` after a reset (GPU), or the process's peak resident set
sampled while the row runs (CPU). Parity: each row's images against the original's from the
same noise (max abs difference, PSNR over the [-1, 1] range). The table, chart and files are written
by benchmarks/report.py; the training benchmark is benchmarks/training_bench.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from basic_diffusion import UNet, count_parameters
from ddpm.backends import registry
from ddpm.benchmarks.report import (
    BenchmarkRequest,
    PeakRSS,
    Row,
    Unavailable,
    environment,
    format_summary,
    format_table,
    write_outputs,
)
from ddpm.conditioning import Guidance
from ddpm.latent.first_stage import FirstStage
from ddpm.util.cpu_memory import keep_freed_memory
from ddpm.util.messages import first_line
from ddpm.util.precision import backend_policy
from noise_schedule import SamplingPlan

ROWS = tuple(registry.REGISTRY)  # every implementation, sample-mode or benchmark-only

# A row passes parity when its images match the original's to this PSNR (dB, data range 2).
# fp32 rows differ only by float reassociation, well above 60 dB on the CPU and on the H100 (BENCHMARKS.md,
# "CPU" and "GPU: NVIDIA H100 80GB HBM3"); 60 dB is an RMS difference of a quarter of a uint8 level, the same
# images. bf16/fp16 rows differ by the lower precision (bf16's PSNR is in the same H100 table). int8 rows
# (onnxruntime's Q/DQ graph) are held to the bf16 bar: their own PSNR is the quality measurement
# (BENCHMARKS.md, "INT8 Q/DQ U-Nets run by onnxruntime"), the bar only catches a broken graph.
PARITY_PSNR_DB = {"fp32": 60.0, "bf16": 20.0, "fp16": 25.0, "int8": 20.0}


def time_runs(
    fn: Callable[[], torch.Tensor], *, device: torch.device, warmup: int, repeats: int
) -> tuple[list[float], torch.Tensor]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed; returns (seconds, last output)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()  # sync: read the run's time
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
    return times, out


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR of two image batches in [-1, 1] (peak-to-peak 2)."""
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return math.inf if mse == 0 else 10.0 * math.log10(4.0 / mse)


def unet_flops(
    model: torch.nn.Module, *, shape: tuple[int, ...], device: torch.device, guidance: Guidance | None = None
) -> int:
    """FLOPs of the U-Net work of one sampling step at this batch (torch.utils.flop_counter: 2 per
    multiply-add): one forward, or for guided sampling the forward of the doubled batch."""
    from torch.utils.flop_counter import FlopCounterMode

    from basic_diffusion import guided_model_eps

    x = torch.zeros(shape, device=device)
    t = torch.zeros(shape[0], dtype=torch.long, device=device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        guided_model_eps(model, x, t, guidance.to(device) if guidance is not None else None)
    return counter.get_total_flops()


def matmul_peak_tflops(dtype: torch.dtype, *, device: torch.device, n: int | None = None, repeats: int = 10) -> float:
    """A large square matmul's achieved TFLOP/s: the practical peak the U-Net is compared with (MFU).
    n: 8192 on a GPU, 2048 on a CPU (a second or less there)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times, _ = time_runs(lambda: a @ b, device=device, warmup=3, repeats=repeats)
    return 2 * n**3 / statistics.median(times) / 1e12


# ----- rows ----------------------------------------------------------------------------------------
def make_row(
    name: str,
    *,
    model: torch.nn.Module,
    plan: SamplingPlan,
    shape: tuple[int, int, int, int],
    precision: str,
    guidance: Guidance | None = None,
    first_stage: FirstStage | None = None,
) -> tuple[str, Callable[[torch.Generator], torch.Tensor], str, Callable[[torch.Tensor], torch.Tensor] | None]:
    """(precision, run(generator), detail, decode) for one row, built through the implementation registry;
    raises Unavailable when the row cannot run here. The fp32-only rows run in fp32 whatever
    ``precision`` asks. For a latent model ``run`` draws latents and ``decode`` is the row's decoder
    (None for a pixel model).

    Building a row may capture graphs, compile or export: the caller builds, times and frees one
    row at a time, so no row carries another's buffers or memory pools.
    """
    impl = registry.get(name)
    row_precision = impl.row_precision or (precision if precision in impl.precisions else "fp32")
    try:
        impl.check(device=plan.coefficients.device, conditional=guidance is not None, latent=first_stage is not None)
    except ValueError as exc:
        raise Unavailable(str(exc)) from exc
    options = registry.SamplerOptions(precision=row_precision, guidance=guidance)
    # Every row but the reference gets a copy, so a row can never change the model the others run.
    network = model if name == "original" else copy.deepcopy(model)
    try:
        network = impl.prepare(network, options)
        sampler = impl.build(network, plan, shape=shape, options=options)
        decode = None
        if first_stage is not None:
            stage = (
                first_stage if name == "original" else replace(first_stage, decoder=copy.deepcopy(first_stage.decoder))
            )
            decode = impl.decoder(stage, options, device=plan.coefficients.device)
    except (ImportError, ValueError) as exc:  # an optional package or the extension is missing, or the row cannot
        raise Unavailable(first_line(exc)) from exc  # represent this model (diffusers: a volume): say which
    detail = getattr(network, "provider", "")  # onnxruntime's execution provider
    return row_precision, lambda g: sampler(generator=g, guidance=guidance), detail, decode


def row_label(name: str, device: torch.device) -> str:
    """What a row's name includes, where the name alone does not say (shown in the table)."""
    if device.type == "cuda":
        return {
            "compile": "compile (max-autotune: Inductor kernels + CUDA graphs)",
            "cuda_compile": "cuda_compile (fused step + CUDA graph, U-Net through torch.compile)",
        }.get(name, name)
    return name


class DeviceMemory:
    """A row's device memory: growth of the CUDA caching allocator's reserved bytes (graph
    pools included) and of the device's used memory (cudaMemGetInfo: what TensorRT, cuDNN and
    onnxruntime allocate themselves), from before the row is built to its peak; the larger of
    the two, in MiB. Measured with every earlier row freed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> DeviceMemory:
        import gc

        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.reserved0 = torch.cuda.memory_reserved(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        self.used0, self.peak_used = total - free, total - free
        return self

    def sample(self) -> None:
        """Read the device's used memory now (call at the points where it peaks)."""
        free, total = torch.cuda.mem_get_info(self.device)
        self.peak_used = max(self.peak_used, total - free)

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.sample()
        reserved = torch.cuda.max_memory_reserved(self.device) - self.reserved0
        self.mb = max(reserved, self.peak_used - self.used0) / 2**20


# ----- the benchmark -----------------------------------------------------------------------------
def time_rows(
    model: UNet,
    plan: SamplingPlan,
    *,
    shape: tuple[int, int, int, int],
    seed: int,
    precision: str,
    rows: list[str],
    warmup: int,
    repeats: int,
    progress: Callable[[str], None] = print,
    profile: str | None = None,
    guidance: Guidance | None = None,
    first_stage: FirstStage | None = None,
    interleave: bool = False,
) -> tuple[dict, list[Row]]:
    """Time every requested row; returns (environment and config, rows). A class-conditional model is
    timed guided (``guidance``: its labels and scale; the U-Net runs on twice the batch). A latent model
    (``first_stage``) is timed whole (the sampling loop, then the row's decoder), and each stage alone.

    Rows run one after another (each built, timed ``repeats`` times and freed before the next), or with
    ``interleave`` in rounds: every row built and warmed up first, then each round runs every row once in
    turn, and a row's speedup is the median of the original's time over its own, round by round. A machine
    whose speed drifts over minutes (a shared VM, a throttling laptop) then slows every row of a round alike;
    the rows are held together, so their peak memory is not measured.

    With ``profile`` (--profile DIR), each row runs once more after its timing, traced into
    DIR/benchmark-<row>/ (profiling.py): the trace never lands in a timed run or the memory figure.
    """
    device = plan.coefficients.device
    env = environment(device)
    if device.type == "cpu":  # before any row: every row runs without the page faults of a trimmed heap
        env["cpu_allocator"] = "glibc malloc keeps freed memory (cpu_memory.py)" if keep_freed_memory() else "default"
    flops = unet_flops(model, shape=shape, device=device, guidance=guidance)
    env.update(
        parameters=count_parameters(model),
        shape=list(shape),
        sampler=plan.sampler,
        steps=plan.num_steps,
        seed=seed,
        unet_gflops_per_forward=flops / 1e9,
        guidance_scale=None if guidance is None else guidance.scale,
        timing="interleaved rounds" if interleave else "one row after another",
    )
    peak_dtypes = (
        {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        if device.type == "cuda"
        else {"fp32": torch.float32}
    )
    with backend_policy("fp32"):  # the peak under the fp32 policy every fp32 row runs with (no TF32)
        env["matmul_peak_tflops"] = {
            name: matmul_peak_tflops(dtype, device=device) for name, dtype in peak_dtypes.items()
        }
    names = ["original"] + [n for n in rows if n != "original"]
    results: list[Row] = []
    held: dict[str, tuple[Callable, Callable, Callable | None]] = {}  # interleave: row name -> (run, loop, decode)
    built: dict[str, tuple[float, list[float]]] = {}  # row name -> (build seconds, warm-up run times)
    reference: list[torch.Tensor] = []  # the first timed row's (the original's) images: parity's reference

    def one_run(run: Callable[[torch.Generator], torch.Tensor]) -> tuple[list[float], torch.Tensor]:
        return time_runs(lambda: run(torch.Generator(device).manual_seed(seed)), device=device, warmup=0, repeats=1)

    for name in names:
        # Build (and, one after another, time and free) one row at a time: no row carries another's buffers or pools.
        row = Row(name=name, precision=precision if name != "original" else "fp32")
        results.append(row)
        # Compiled, graphed and engine rows build lazily in their first run: never time it.
        row_warmup = warmup if name == "original" else max(warmup, 1)
        memory = DeviceMemory(device) if device.type == "cuda" and not interleave else contextlib.nullcontext()
        try:
            with memory, PeakRSS() as rss:
                started = time.perf_counter()
                try:
                    row.precision, loop, row.detail, decode = make_row(
                        name,
                        model=model,
                        plan=plan,
                        shape=shape,
                        precision=precision,
                        guidance=guidance,
                        first_stage=first_stage,
                    )
                except Unavailable as exc:
                    row.status, row.reason = "unavailable", str(exc)
                    progress(f"{name}: unavailable ({exc})")
                    continue
                run = loop if decode is None else (lambda g, loop=loop, decode=decode: decode(loop(g)))
                progress(
                    f"{row_label(name, device)}: {row_warmup} warm-up"
                    + ("" if interleave else f" + {repeats} timed runs")
                    + " ..."
                )
                build_s = time.perf_counter() - started  # export, compile setup, graph capture
                # The warm-up runs are timed too, never counted: lazy compilation and autotuning happen in the first.
                warmups, _ = time_runs(
                    lambda: run(torch.Generator(device).manual_seed(seed)), device=device, warmup=0, repeats=row_warmup
                )
                built[name] = (build_s, warmups)
                if interleave:
                    held[name] = (run, loop, decode)
                    continue
                row.times_s, images = time_runs(
                    lambda: run(torch.Generator(device).manual_seed(seed)), device=device, warmup=0, repeats=repeats
                )
                if device.type == "cuda":
                    memory.sample()  # everything the row allocated is still held here
            if device.type == "cuda":
                row.peak_memory_mb, row.memory_kind = memory.mb, "cuda_device_growth"
            else:
                row.peak_memory_mb = None if rss.peak is None else rss.peak / 2**20
                row.memory_kind = "process_peak_rss"
            _stages_and_trace(
                row,
                loop=loop,
                decode=decode,
                run=run,
                device=device,
                seed=seed,
                repeats=repeats,
                profile=profile,
                progress=progress,
            )
            del run, loop, decode  # free the row before the next one is built
            _record(row, images, reference=reference, built=built[name], flops=flops, plan=plan, shape=shape, env=env)
        except Exception as exc:  # a row's failure is reported in its row, the others still run
            row.status, row.reason = "failed", f"{type(exc).__name__}: {first_line(exc)}"
            progress(f"{name}: failed ({row.reason})")
    if interleave:
        by_name = {row.name: row for row in results}
        last_images: dict[str, torch.Tensor] = {}
        for round_ in range(repeats):
            for name, (run, _, _) in list(held.items()):
                try:
                    times, last_images[name] = one_run(run)
                    by_name[name].times_s.append(times[0])
                except Exception as exc:  # the row is reported failed and leaves the rounds
                    by_name[name].status, by_name[name].reason = "failed", f"{type(exc).__name__}: {first_line(exc)}"
                    progress(f"{name}: failed ({by_name[name].reason})")
                    del held[name]
            progress(f"round {round_ + 1}/{repeats}: " + ", ".join(f"{n} {by_name[n].times_s[-1]:.3f}s" for n in held))
        for name, (run, loop, decode) in held.items():
            row = by_name[name]
            row.memory_kind = "not measured (--interleave holds every row at once)"
            try:
                _stages_and_trace(
                    row,
                    loop=loop,
                    decode=decode,
                    run=run,
                    device=device,
                    seed=seed,
                    repeats=repeats,
                    profile=profile,
                    progress=progress,
                )
                _record(
                    row,
                    last_images.pop(name),
                    reference=reference,
                    built=built[name],
                    flops=flops,
                    plan=plan,
                    shape=shape,
                    env=env,
                )
            except Exception as exc:
                row.status, row.reason = "failed", f"{type(exc).__name__}: {first_line(exc)}"
                progress(f"{name}: failed ({row.reason})")
        held.clear()
    base = results[0]
    for row in results:
        if row.status == "ok" and base.status == "ok":
            if interleave:  # round by round: the drift of the machine between rounds cancels
                row.speedup = statistics.median(b / r for b, r in zip(base.times_s, row.times_s))
            else:
                row.speedup = base.median_s / row.median_s
    return env, results


def _stages_and_trace(
    row: Row,
    *,
    loop: Callable,
    decode: Callable | None,
    run: Callable,
    device: torch.device,
    seed: int,
    repeats: int,
    profile: str | None,
    progress: Callable[[str], None],
) -> None:
    """A latent model's two stages timed alone (the loop, then the decoder on its latents); the --profile trace."""
    if decode is not None:
        loop_times, latents = time_runs(
            lambda: loop(torch.Generator(device).manual_seed(seed)), device=device, warmup=0, repeats=repeats
        )
        decode_times, _ = time_runs(lambda: decode(latents), device=device, warmup=1, repeats=repeats)
        row.loop_s, row.decode_s = statistics.median(loop_times), statistics.median(decode_times)
    if profile:
        trace_run(run, name=f"benchmark-{row.name}", directory=profile, device=device, seed=seed, log=progress)


def _record(
    row: Row,
    images: torch.Tensor,
    *,
    reference: list[torch.Tensor],
    built: tuple[float, list[float]],
    flops: float,
    plan: SamplingPlan,
    shape: tuple[int, ...],
    env: dict,
) -> None:
    """A timed row's statistics, and its parity against ``reference`` (the first recorded row's images, which the
    first call appends)."""
    times, (build_s, warmups) = row.times_s, built
    row.median_s, row.min_s, row.max_s = statistics.median(times), min(times), max(times)
    row.build_s = build_s + (
        max(0.0, warmups[0] - row.median_s) if warmups else 0.0
    )  # the first run's excess is building
    row.ms_per_step = 1000.0 * row.median_s / plan.num_steps
    row.images_per_s = shape[0] / row.median_s
    row.tflops = flops * plan.num_steps / row.median_s / 1e12
    peak = env["matmul_peak_tflops"].get(row.precision)
    row.mfu = row.tflops / peak if peak else None  # int8 rows: no int8 peak measured
    images = images.float().cpu()  # sync: parity is computed off the device, which frees the row
    if not reference:
        reference.append(images)
        row.parity = "reference"
    else:
        row.max_abs_diff = (images - reference[0]).abs().max().item()
        row.psnr_db = psnr_db(images, reference[0])
        row.parity = "pass" if row.psnr_db >= PARITY_PSNR_DB[row.precision] else "FAIL"


def trace_run(
    run: Callable[[torch.Generator], torch.Tensor],
    *,
    name: str,
    directory: str,
    device: torch.device,
    seed: int,
    log: Callable[[str], None],
) -> None:
    """One untimed run under torch.profiler (one profiler step), written to ``directory/name``."""
    from ddpm.util.profiling import ProfileConfig, make_profiler

    with make_profiler(ProfileConfig(directory, run_name=name, total_steps=1), device=device, log=log) as profiler:
        run(torch.Generator(device).manual_seed(seed))
        profiler.step()


# ----- the command line --------------------------------------------------------------------------
def perturb_zero_init(model: torch.nn.Module, *, seed: int, std: float = 0.05) -> None:
    """Give a freshly initialized U-Net's zero-initialized layers small random weights.

    A new U-Net's output convolution starts at zero, so it would predict eps = 0 everywhere and
    every implementation would "agree" on a trivial computation; timing and parity need real values.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def parse_rows(text: str, *, device_type: str = "cuda") -> list[str]:
    """The --rows list; "all" is every row whose registry entry is a default row on this device
    (cuda_compile is not on a CPU: a second compile of the same U-Net through the same CPU kernels)."""
    if text == "all":
        return [n for n in ROWS if device_type in registry.REGISTRY[n].default_row_on]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown benchmark rows {unknown or text!r}; choose from {', '.join(ROWS)}")
    return names


def benchmark_sampling(
    args: BenchmarkRequest,
    *,
    model: UNet,
    plan: SamplingPlan,
    shape: tuple[int, int, int, int],
    precision: str,
    guidance: Guidance | None = None,
    first_stage: FirstStage | None = None,
) -> list[Row]:
    """Run, print (header, table, summary) and write the requested outputs."""
    names = parse_rows(
        args.rows, device_type=plan.coefficients.device.type
    )  # the output paths were checked by main.py before any work
    if args.chart:
        import matplotlib  # noqa: F401  (fail now, not after the whole benchmark has run)
    env, rows = time_rows(
        model,
        plan,
        shape=shape,
        seed=args.seed,
        precision=precision,
        rows=names,
        warmup=args.warmup,
        repeats=args.repeats,
        profile=args.profile,
        guidance=guidance,
        first_stage=first_stage,
        interleave=args.interleave,
    )
    print()
    for key in (
        "date",
        "device",
        "driver",
        "compute_capability",
        "torch",
        "cuda",
        "tensorrt",
        "python",
        "cpu_allocator",
        "timing",
    ):
        if key in env:
            print(f"{key:>18}: {env[key]}")
    print(
        f"{'model':>18}: {env['parameters'] / 1e6:.2f}M parameters, {env['unet_gflops_per_forward']:.2f} GFLOP per "
        "forward "
        f"at batch {shape[0]}; {plan.sampler}, {plan.num_steps} steps; {args.warmup} warm-up + {args.repeats} timed "
        "runs"
        + (
            " (rounds; speedup: the median of the original's time over the row's, round by round)"
            if args.interleave
            else ""
        )
    )
    if first_stage is not None:
        latents, images = ("x".join(map(str, shape)) for shape in (first_stage.latent_shape, first_stage.image_shape))
        print(
            f"{'latent model':>18}: {latents} latents decoded to {images} images; loop s and decoder s: each stage "
            "alone"
        )
    if guidance is not None:
        print(
            f"{'guidance':>18}: class-conditional, scale {guidance.scale:g}: the U-Net runs on twice the batch each "
            "step"
        )
    if "matmul_peak_tflops" in env:
        peaks = env["matmul_peak_tflops"]
        text = ", ".join(f"{name} {value:.3g} TFLOP/s" for name, value in peaks.items())
        print(f"{'matmul peak':>18}: {text} (measured now; MFU = a row's U-Net TFLOP/s over its precision's peak)")
    print()
    print(format_table(rows))
    print()
    print(format_summary(rows))
    failed = [r.name for r in rows if r.parity == "FAIL"]
    if failed:
        print(f"PARITY FAILED for: {', '.join(failed)} (PSNR below {PARITY_PSNR_DB})")
    write_outputs(env, rows, json_path=args.json, csv_path=args.csv, chart_path=args.chart)
    for path in filter(None, (args.json, args.csv, args.chart)):
        print(f"wrote {path}")
    return rows
