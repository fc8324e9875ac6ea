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
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from basic_diffusion import UNet, count_parameters, guided_model_eps
from ddpm.backends import registry
from ddpm.benchmarks.peaks import measure_peaks, median_seconds, mfu, peak
from ddpm.benchmarks.plan import estimate_line
from ddpm.benchmarks.report import (
    PeakRSS,
    Row,
    Unavailable,
    environment,
    format_summary,
    format_table,
    psnr_db,
    write_outputs,
)
from ddpm.benchmarks.rows import ROWS, parse_rows
from ddpm.conditioning import Guidance
from ddpm.latent.autoencoder import FirstStage
from ddpm.requests import BenchmarkRequest
from ddpm.util.memory import allocator_description
from ddpm.util.messages import first_line
from ddpm.util.precision import FORCED_BF16, backend_policy, bf16_forced, cpu_has_native_bf16
from noise_schedule import SamplingPlan
from optimized_diffusion import uses_runner

# A row's detail when its U-Net's 3x3 convolutions run in Winograd's form: its TFLOP/s is direct-equivalent.
WINOGRAD_DETAIL = "fused U-Net runner, Winograd convolutions"

# A row passes parity when its images match the original's to this PSNR (dB, data range 2). fp32 rows differ only
# by float reassociation (60 dB is a quarter of a uint8 level); lower precisions get a lower bar, and int8's only
# catches a broken graph (BENCHMARKS.md, "INT8 Q/DQ U-Nets run by onnxruntime").
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
    """(precision, run(generator), detail, decode) for one row (benchmarks/rows.py: an implementation and its
    parameters); raises Unavailable when the row cannot run here. The fp32-only rows run in fp32 whatever
    ``precision`` asks. For a latent model ``run`` draws latents and ``decode`` is the row's decoder
    (None for a pixel model).

    Building a row may capture graphs, compile or export: the caller builds, times and frees one
    row at a time, so no row carries another's buffers or memory pools.
    """
    row, device = ROWS[name], plan.coefficients.device
    impl = registry.PEERS.get(row.implementation) or registry.get(row.implementation)
    row_precision = row.precision or (precision if precision in impl.precisions else "fp32")
    try:
        impl.check(device=device, conditional=guidance is not None, latent=first_stage is not None)
    except ValueError as exc:
        raise Unavailable(str(exc)) from exc
    fused = row.fused_unet  # None: the runner where sample mode's selection would run it
    fused = uses_runner(model, device_type=device.type, precision=row_precision) if fused is None else fused
    options = registry.SamplerOptions(
        precision=row_precision,
        fused_unet=fused,
        compile=row.compile,
        openvino_precision=row.openvino_precision,
        guidance=guidance,
        winograd=row.winograd,
    )
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
            decode = impl.decoder(stage, options, device=device)
    except (ImportError, ValueError) as exc:  # an optional package or the extension is missing, or the row cannot
        raise Unavailable(first_line(exc)) from exc  # represent this model (diffusers: a volume): say which
    row_precision = getattr(sampler, "precision", row_precision)  # what a runtime chose (OpenVINO: bf16 on some CPUs)
    detail = getattr(network, "provider", "") or getattr(sampler, "detail", "")  # onnxruntime's provider, OpenVINO's
    runner = getattr(sampler, "unet_runner", None)  # the cuda implementation's fused U-Net runner, where it runs
    if runner is not None:
        detail = WINOGRAD_DETAIL if runner.winograd or runner.winograd_upsample else "fused U-Net runner"
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
    ``interleave`` in rounds (every row built first, then each round runs every row once), so a machine whose
    speed drifts slows every row of a round alike; a row's speedup is then the median of the per-round ratios, and
    peak memory is not measured.

    With ``profile`` (--profile DIR), each row runs once more after its timing, traced into
    DIR/benchmark-<row>/ (profiling.py): the trace never lands in a timed run or the memory figure.
    """
    device = plan.coefficients.device
    names = ["original"] + [n for n in rows if n != "original"]
    # 1. The environment, the machine's peaks and the whole run's estimate, said before any row is built.
    env = run_environment(model, plan, shape=shape, seed=seed, guidance=guidance, interleave=interleave)
    forward_s = env.pop("_forward_s")
    runs = max(warmup, 1) + repeats
    env["estimate"] = estimate_line(rows=len(names), runs_per_row=runs, steps=plan.num_steps, forward_s=forward_s)
    progress(f"estimated time: {env['estimate']}")
    timing = _Timing(device=device, seed=seed, warmup=warmup, repeats=repeats, profile=profile, progress=progress)
    context = _RowContext(model, plan, shape, precision, guidance, first_stage, env)
    results: list[Row] = []
    held: dict[str, tuple[Callable, Callable, Callable | None]] = {}  # interleave: row name -> (run, loop, decode)
    # 2. Each row built (and, one after another, timed and freed) in turn: no row carries another's buffers or pools.
    for name in names:
        results.append(_build_and_time(name, context, timing, interleave=interleave, held=held))
    # 3. Interleaved: every held row once per round.
    if interleave:
        _time_in_rounds(results, held, context, timing)
    # 4. Speedups over the original; the peaks measured again, now that the rows are done.
    _speedups(results, interleave=interleave)
    forward = _forward(model, plan, shape=shape, seed=seed, guidance=guidance)
    remeasure_peaks(env, results, _peak_rates(forward, model, device=device))
    return env, results


def run_environment(
    model: UNet,
    plan: SamplingPlan,
    *,
    shape: tuple[int, ...],
    seed: int,
    guidance: Guidance | None,
    interleave: bool,
) -> dict:
    """The run's environment and configuration, the machine's peak rates (peaks.py) and, under ``_forward_s``,
    the seconds of one forward of the original U-Net at this batch (for the estimate)."""
    device = plan.coefficients.device
    env = environment(device)
    if device.type == "cpu":  # before any row: every row runs without the page faults of a trimmed heap
        env["cpu_allocator"] = allocator_description()
        if bf16_forced():  # the bf16 rows and peak are the emulation's, not the CPU's bf16 hardware
            env["bf16"] = f"{FORCED_BF16} (bf16 rows and peak: emulated)"
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
    forward = _forward(model, plan, shape=shape, seed=seed, guidance=guidance)
    env["peak_sources_tflops"] = _peak_rates(forward, model, device=device)
    env["peak_tflops"] = {name: peak(rates) for name, rates in env["peak_sources_tflops"].items()}
    with torch.no_grad(), backend_policy("fp32"):
        env["_forward_s"] = median_seconds(forward, device=device, warmup=1, repeats=3)
    return env


def _forward(model: UNet, plan: SamplingPlan, *, shape: tuple[int, ...], seed: int, guidance: Guidance | None):
    """One U-Net step's work at this batch on random inputs (never time zeros)."""
    device = plan.coefficients.device
    x = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(seed))
    t = torch.full((shape[0],), plan.num_steps // 2, dtype=torch.long, device=device)
    live = guidance.to(device) if guidance is not None else None
    return lambda: guided_model_eps(model, x, t, live)


def _peak_rates(forward: Callable, model: UNet, *, device: torch.device) -> dict[str, dict[str, float]]:
    """peaks.measure_peaks under the fp32 policy every fp32 row runs with (no TF32)."""
    # On a CPU fp32, and bf16 where the CPU computes it (oneDNN's bf16 convolutions and matmuls then run on its dot
    # products: the library path the runner's bf16 rows use); emulated bf16 or fp16 would be no peak: no MFU there.
    dtypes = {"fp32": torch.float32}
    if device.type == "cuda":
        dtypes.update(bf16=torch.bfloat16, fp16=torch.float16)
    elif cpu_has_native_bf16():
        dtypes.update(bf16=torch.bfloat16)
    with torch.no_grad(), backend_policy("fp32"):
        return measure_peaks(forward, model, device=device, dtypes=dtypes)


def remeasure_peaks(env: dict, rows: list[Row], rates: dict[str, dict[str, float]]) -> None:
    """Each source's rate becomes the faster of its two measurements (before and after the rows), and every
    row's MFU is taken against that peak: on a shared machine whose load moves, a peak measured only at a busy
    moment would let a direct-convolution row pass 100%."""
    for name, sources in rates.items():
        kept = env["peak_sources_tflops"].setdefault(name, {})
        for source, rate in sources.items():
            kept[source] = max(kept.get(source, 0.0), rate)
    env["peak_tflops"] = {name: peak(sources) for name, sources in env["peak_sources_tflops"].items()}
    for row in rows:
        if row.tflops is not None:
            row.mfu = mfu(row.tflops, env["peak_sources_tflops"].get(row.precision))


@dataclass(frozen=True)
class _Timing:
    device: torch.device
    seed: int
    warmup: int
    repeats: int
    profile: str | None
    progress: Callable[[str], None]

    def runs(self, run: Callable, count: int, *, bar: tqdm | None = None) -> tuple[list[float], torch.Tensor]:
        """``count`` timed runs of ``run`` from the seed's generator (each advancing ``bar``)."""
        times, out = [], None
        for _ in range(count):
            seconds, out = time_runs(
                lambda: run(torch.Generator(self.device).manual_seed(self.seed)),
                device=self.device,
                warmup=0,
                repeats=1,
            )
            times += seconds
            if bar is not None:
                bar.update(1)
        return times, out


@dataclass(frozen=True)
class _RowContext:
    model: UNet
    plan: SamplingPlan
    shape: tuple[int, int, int, int]
    precision: str
    guidance: Guidance | None
    first_stage: FirstStage | None
    env: dict
    reference: list = field(default_factory=list)  # the original's images: parity's reference
    built: dict = field(default_factory=dict)  # row name -> (build seconds, warm-up run times)


def _row_bar(label: str, total: int) -> tqdm:
    return tqdm(total=total, desc=label, unit="run", leave=False, dynamic_ncols=True)


def _build_and_time(
    name: str, context: _RowContext, timing: _Timing, *, interleave: bool, held: dict[str, tuple]
) -> Row:
    """One row built, warmed up and (one after another) timed, measured and freed; a failure stays in its row."""
    device = timing.device
    row = Row(name=name, precision=context.precision if name != "original" else "fp32")
    # Compiled, graphed and engine rows build lazily in their first run: never time it.
    row_warmup = timing.warmup if name == "original" else max(timing.warmup, 1)
    memory = DeviceMemory(device) if device.type == "cuda" and not interleave else contextlib.nullcontext()
    try:
        with memory, PeakRSS() as rss:
            started = time.perf_counter()
            try:
                row.precision, loop, row.detail, decode = make_row(
                    name,
                    model=context.model,
                    plan=context.plan,
                    shape=context.shape,
                    precision=context.precision,
                    guidance=context.guidance,
                    first_stage=context.first_stage,
                )
            except Unavailable as exc:
                row.status, row.reason = "unavailable", str(exc)
                timing.progress(f"{name}: unavailable ({exc})")
                return row
            row.direct_equivalent = WINOGRAD_DETAIL in row.detail
            run = loop if decode is None else (lambda g, loop=loop, decode=decode: decode(loop(g)))
            build_s = time.perf_counter() - started  # export, compile setup, graph capture
            total = row_warmup + (0 if interleave else timing.repeats)
            with _row_bar(f"{row_label(name, device)} ({row_warmup} warm-up)", total) as bar:
                # The warm-up runs are timed too, never counted: lazy compilation and autotuning happen in the first.
                warmups, _ = timing.runs(run, row_warmup, bar=bar)
                context.built[name] = (build_s, warmups)
                if interleave:
                    held[name] = (run, loop, decode)
                    return row
                row.times_s, images = timing.runs(run, timing.repeats, bar=bar)
            if device.type == "cuda":
                memory.sample()  # everything the row allocated is still held here
        if device.type == "cuda":
            row.peak_memory_mb, row.memory_kind = memory.mb, "cuda_device_growth"
        else:
            row.peak_memory_mb = None if rss.peak is None else rss.peak / 2**20
            row.memory_kind = "process_peak_rss"
        _stages_and_trace(row, loop=loop, decode=decode, run=run, timing=timing)
        del run, loop, decode  # free the row before the next one is built
        _record(row, images, context=context)
    except Exception as exc:  # a row's failure is reported in its row, the others still run
        row.status, row.reason = "failed", f"{type(exc).__name__}: {first_line(exc)}"
        timing.progress(f"{name}: failed ({row.reason})")
    return row


def _time_in_rounds(results: list[Row], held: dict[str, tuple], context: _RowContext, timing: _Timing) -> None:
    """--interleave: each round runs every held row once; then each row's stages, trace and record."""
    by_name = {row.name: row for row in results}
    last_images: dict[str, torch.Tensor] = {}
    with tqdm(total=timing.repeats * len(held), desc="rounds", unit="run", leave=False, dynamic_ncols=True) as bar:
        for round_ in range(timing.repeats):
            for name, (run, _, _) in list(held.items()):
                try:
                    times, last_images[name] = timing.runs(run, 1, bar=bar)
                    by_name[name].times_s += times
                except Exception as exc:  # the row is reported failed and leaves the rounds
                    by_name[name].status, by_name[name].reason = "failed", f"{type(exc).__name__}: {first_line(exc)}"
                    timing.progress(f"{name}: failed ({by_name[name].reason})")
                    del held[name]
            timing.progress(
                f"round {round_ + 1}/{timing.repeats}: " + ", ".join(f"{n} {by_name[n].times_s[-1]:.3f}s" for n in held)
            )
    for name, (run, loop, decode) in held.items():
        row = by_name[name]
        row.memory_kind = "not measured (--interleave holds every row at once)"
        try:
            _stages_and_trace(row, loop=loop, decode=decode, run=run, timing=timing)
            _record(row, last_images.pop(name), context=context)
        except Exception as exc:
            row.status, row.reason = "failed", f"{type(exc).__name__}: {first_line(exc)}"
            timing.progress(f"{name}: failed ({row.reason})")
    held.clear()


def _speedups(results: list[Row], *, interleave: bool) -> None:
    base = results[0]
    for row in results:
        if row.status == "ok" and base.status == "ok":
            if interleave:  # round by round: the drift of the machine between rounds cancels
                row.speedup = statistics.median(b / r for b, r in zip(base.times_s, row.times_s))
            else:
                row.speedup = base.median_s / row.median_s


def _stages_and_trace(row: Row, *, loop: Callable, decode: Callable | None, run: Callable, timing: _Timing) -> None:
    """A latent model's two stages timed alone (the loop, then the decoder on its latents); the --profile trace."""
    device, seed, repeats = timing.device, timing.seed, timing.repeats
    if decode is not None:
        loop_times, latents = time_runs(
            lambda: loop(torch.Generator(device).manual_seed(seed)), device=device, warmup=0, repeats=repeats
        )
        decode_times, _ = time_runs(lambda: decode(latents), device=device, warmup=1, repeats=repeats)
        row.loop_s, row.decode_s = statistics.median(loop_times), statistics.median(decode_times)
    if timing.profile:
        trace_run(
            run, name=f"benchmark-{row.name}", directory=timing.profile, device=device, seed=seed, log=timing.progress
        )


def _record(row: Row, images: torch.Tensor, *, context: _RowContext) -> None:
    """A timed row's statistics, and its parity against the reference (the first recorded row's images, which
    the first call keeps)."""
    times, (build_s, warmups) = row.times_s, context.built[row.name]
    plan, shape, env = context.plan, context.shape, context.env
    row.median_s, row.min_s, row.max_s = statistics.median(times), min(times), max(times)
    row.build_s = build_s + (
        max(0.0, warmups[0] - row.median_s) if warmups else 0.0
    )  # the first run's excess is building
    row.ms_per_step = 1000.0 * row.median_s / plan.num_steps
    row.images_per_s = shape[0] / row.median_s
    row.tflops = env["unet_gflops_per_forward"] * 1e9 * plan.num_steps / row.median_s / 1e12
    row.mfu = mfu(row.tflops, env["peak_sources_tflops"].get(row.precision))  # int8 rows: no int8 peak measured
    images = images.float().cpu()  # sync: parity is computed off the device, which frees the row
    if not context.reference:
        context.reference.append(images)
        row.parity = "reference"
    else:
        row.max_abs_diff = (images - context.reference[0]).abs().max().item()
        row.psnr_db = psnr_db(images, context.reference[0])
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


def benchmark_sampling(
    args: BenchmarkRequest,
    *,
    model: UNet,
    plan: SamplingPlan,
    shape: tuple[int, int, int, int],
    precision: str,
    guidance: Guidance | None = None,
    first_stage: FirstStage | None = None,
    plan_note: str = "",
) -> list[Row]:
    """Run, print (header, table, summary) and write the requested outputs. ``plan_note``: what the CPU quick plan
    (plan.py) chose, said before and after the run."""
    names = parse_rows(
        args.rows, device_type=plan.coefficients.device.type
    )  # the output paths were checked by main.py before any work
    if args.chart:
        import matplotlib  # noqa: F401  (fail now, not after the whole benchmark has run)
    if plan_note:
        print(f"plan: {plan_note}")
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
    if plan_note:
        env["plan"] = plan_note
    print()
    for key in (
        "date",
        "device",
        "driver",
        "compute_capability",
        "torch",
        "cuda",
        "tensorrt",
        "onnxruntime",
        "openvino",
        "python",
        "cpu_allocator",
        "bf16",
        "timing",
        "plan",
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
    for name, rates in env["peak_sources_tflops"].items():
        text = ", ".join(f"{what} {value:.3g}" for what, value in rates.items())
        print(f"{name + ' peak':>18}: {env['peak_tflops'][name]:.3g} TFLOP/s, the fastest of: {text} TFLOP/s")
    print(f"{'MFU':>18}: a row's U-Net TFLOP/s over its precision's peak, both measured in this run")
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
