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
same noise (max abs difference, PSNR over the [-1, 1] range).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import io
import json
import math
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import implementations
from basic_diffusion import UNet, count_parameters
from checkpoints import first_line
from noise_schedule import SamplingPlan
from safe_files import atomic_write

ROWS = tuple(implementations.REGISTRY)  # every implementation, sample-mode or benchmark-only

# A row passes parity when its images match the original's to this PSNR (dB, data range 2).
# fp32 rows differ only by float reassociation; bf16/fp16 rows by the lower precision.
PARITY_PSNR_DB = {"fp32": 40.0, "bf16": 20.0, "fp16": 25.0}


class Unavailable(Exception):
    """A row that cannot run here; the message says why (shown in the table)."""


@dataclass
class Row:
    name: str
    precision: str
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""
    times_s: list[float] = field(default_factory=list)
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    ms_per_step: float | None = None
    images_per_s: float | None = None
    speedup: float | None = None
    peak_memory_mb: float | None = None
    memory_kind: str = ""
    max_abs_diff: float | None = None
    psnr_db: float | None = None
    parity: str = ""  # pass | FAIL | reference | ""
    tflops: float | None = None
    detail: str = ""  # what ran, where the name does not say (onnxruntime's execution provider)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("benchmark")
    g.add_argument(
        "--bench", choices=("sampling", "training"), default="sampling", help="time sampling implementations, or training steps"
    )
    g.add_argument("--train_steps", type=int, default=20, help="timed optimizer steps per training row")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per row (median and min-max reported)")
    g.add_argument("--warmup", type=int, default=1, help="untimed runs per row before timing")
    g.add_argument("--json", default=None, help="write the results as JSON here (benchmark, evaluate)")
    g.add_argument("--csv", default=None, help="write the result rows as CSV here")
    g.add_argument(
        "--chart", default=None, help="write a chart PNG here (benchmark: time per row; evaluate: quality against steps)"
    )
    g.add_argument(
        "--rows",
        default="all",
        help=f"comma-separated rows to run, from {','.join(ROWS)} (default all; original always runs: it is the reference)",
    )


@dataclass(frozen=True)
class BenchmarkRequest:
    """What benchmark mode was asked for (resolved from the flags by main.py)."""

    rows: str = "all"  # comma-separated row names, or "all"
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    train_steps: int = 20  # --bench training: timed optimizer steps per variant
    batch_size: int = 64  # --bench training: the batch of each step
    json: str | None = None
    csv: str | None = None
    chart: str | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {self.repeats} and {self.warmup}")
        if self.train_steps < 1:
            raise ValueError(f"--train_steps must be >= 1, got {self.train_steps}")


# ----- measuring ---------------------------------------------------------------------------------
class PeakRSS:
    """Samples the process's resident set every few ms while a row runs (Linux /proc; else None)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()
        self._page = 4096
        try:
            import os

            self._page = os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass

    def _read(self) -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return None

    def __enter__(self) -> PeakRSS:
        if self._read() is None:
            self.peak = None
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read() or 0)
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.peak is not None:
            self._thread.join()
            self.peak = max(self.peak, self._read() or 0)


def time_runs(fn: Callable[[], torch.Tensor], *, device: torch.device, warmup: int, repeats: int) -> tuple[list[float], torch.Tensor]:
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


def unet_flops(model: torch.nn.Module, *, shape: tuple[int, ...], device: torch.device) -> int:
    """FLOPs of one U-Net forward at this batch (torch.utils.flop_counter: 2 per multiply-add)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.zeros(shape, device=device)
    t = torch.zeros(shape[0], dtype=torch.long, device=device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x, t)
    return counter.get_total_flops()


def matmul_peak_tflops(dtype: torch.dtype, *, device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """A large square matmul's achieved TFLOP/s: the practical peak the U-Net is compared with."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times, _ = time_runs(lambda: a @ b, device=device, warmup=3, repeats=repeats)
    return 2 * n**3 / statistics.median(times) / 1e12


# ----- rows ----------------------------------------------------------------------------------------
def make_row(
    name: str, *, model: torch.nn.Module, plan: SamplingPlan, shape: tuple[int, int, int, int], precision: str
) -> tuple[str, Callable[[torch.Generator], torch.Tensor], str]:
    """(precision, run(generator), detail) for one row, built through the implementation registry;
    raises Unavailable when the row cannot run here. The fp32-only rows run in fp32 whatever
    ``precision`` asks.

    Building a row may capture graphs, compile or export: the caller builds, times and frees one
    row at a time, so no row carries another's buffers or memory pools.
    """
    impl = implementations.get(name)
    row_precision = precision if precision in impl.precisions else "fp32"
    try:
        impl.check(device=plan.coefficients.device)
    except ValueError as exc:
        raise Unavailable(str(exc)) from exc
    options = implementations.SamplerOptions(precision=row_precision)
    # Every row but the reference gets a copy, so a row can never change the model the others run.
    network = model if name == "original" else copy.deepcopy(model)
    try:
        network = impl.prepare(network, options)
        sampler = impl.build(network, plan, shape=shape, options=options)
    except ImportError as exc:  # an optional package or the extension is missing: say which
        raise Unavailable(first_line(exc)) from exc
    detail = getattr(network, "provider", "")  # onnxruntime's execution provider
    return row_precision, lambda g: sampler(generator=g), detail


def row_label(name: str, device: torch.device) -> str:
    """What a row's name includes, where the name alone does not say (shown in the table)."""
    if device.type == "cuda":
        return {"compile": "compile (max-autotune: Inductor kernels + CUDA graphs)",
                "cuda_compile": "cuda_compile (fused step + CUDA graph, U-Net through torch.compile)"}.get(name, name)  # fmt: skip
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


# ----- reporting ---------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["driver"] = _driver_version()
        info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    try:
        import tensorrt

        info["tensorrt"] = tensorrt.__version__
    except ImportError:
        info["tensorrt"] = "not installed"
    return info


def _driver_version() -> str:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def format_table(rows: list[Row]) -> str:
    head = ("implementation", "precision", "median s", "min-max s", "ms/step", "img/s", "speedup", "peak MB", "max|diff|", "PSNR dB", "parity")
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append((r.name, r.precision, f"{r.status}: {r.reason}"))
            continue
        lines.append((
            f"{r.name} ({r.detail})" if r.detail else r.name, r.precision, f"{r.median_s:.3f}", f"{r.min_s:.3f}-{r.max_s:.3f}", f"{r.ms_per_step:.2f}",
            f"{r.images_per_s:.1f}", _times(r.speedup), "n/a" if r.peak_memory_mb is None else f"{r.peak_memory_mb:.0f}",
            "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}", "-" if r.psnr_db is None else f"{r.psnr_db:.1f}", r.parity,
        ))  # fmt: skip
    widths = [max([len(h), *(len(line[i]) for line in lines if len(line) > 3)]) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for line in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)) if len(line) > 3 else "  ".join(line))
    return "\n".join(out)


def _times(speedup: float | None) -> str:
    return "-" if speedup is None else f"{speedup:.2f}x"


SUMMARY_NAMES = {"original": "Original PyTorch implementation", "cuda": "CUDA-optimized implementation",
                 "tensorrt": "TensorRT implementation", "compile": "torch.compile implementation",
                 "onnxruntime": "onnxruntime implementation", "torchscript": "TorchScript implementation"}  # fmt: skip


def format_summary(rows: list[Row]) -> str:
    lines = ["===== BENCHMARK RESULTS ====="]
    by_name = {r.name: r for r in rows}
    for r in rows:
        label = SUMMARY_NAMES.get(r.name, r.name)
        if r.status != "ok":
            lines.append(f"{label}: {r.status} ({r.reason})")
        elif r.name == "original":
            lines.append(f"{label}: {r.median_s:.2f}s")
        else:
            lines.append(f"{label}: {r.median_s:.2f}s (Speedup: {_times(r.speedup)})")
    trt, cuda = by_name.get("tensorrt"), by_name.get("cuda")
    if trt and cuda and trt.status == cuda.status == "ok":
        lines.append(f"TensorRT vs CUDA-optimized speedup: {cuda.median_s / trt.median_s:.2f}x")
    return "\n".join(lines)


def write_chart(rows: list[Row], path: str | Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.status == "ok"]
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    bars = ax.bar([f"{r.name}\n{r.precision}" for r in ok], [r.median_s for r in ok], color="#4c72b0")
    for bar, r in zip(bars, ok):
        ax.annotate(_times(r.speedup), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("median seconds per sampling run")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buf.getvalue()))


# ----- the benchmark -----------------------------------------------------------------------------
def run_benchmark(
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
) -> tuple[dict, list[Row]]:
    """Time every requested row; returns (environment and config, rows)."""
    device = plan.coefficients.device
    env = environment(device)
    flops = unet_flops(model, shape=shape, device=device)
    env.update(
        parameters=count_parameters(model),
        shape=list(shape),
        sampler=plan.sampler,
        steps=plan.num_steps,
        seed=seed,
        unet_gflops_per_forward=flops / 1e9,
    )
    if device.type == "cuda":
        env["matmul_peak_tflops"] = {"bf16": matmul_peak_tflops(torch.bfloat16, device=device),
                                     "fp32": matmul_peak_tflops(torch.float32, device=device)}  # fmt: skip
    names = ["original"] + [n for n in rows if n != "original"]
    results: list[Row] = []
    reference = None
    for name in names:
        # Build, time and free one row at a time: no row carries another's buffers or pools.
        row = Row(name=name, precision=precision if name != "original" else "fp32")
        results.append(row)
        # Compiled, graphed and engine rows build lazily in their first run: never time it.
        row_warmup = warmup if name == "original" else max(warmup, 1)
        memory = DeviceMemory(device) if device.type == "cuda" else contextlib.nullcontext()
        try:
            with memory, PeakRSS() as rss:
                try:
                    row.precision, run, row.detail = make_row(
                        name, model=model, plan=plan, shape=shape, precision=precision
                    )
                except Unavailable as exc:
                    row.status, row.reason = "unavailable", str(exc)
                    progress(f"{name}: unavailable ({exc})")
                    continue
                progress(f"{row_label(name, device)}: {row_warmup} warm-up + {repeats} timed runs ...")
                times, images = time_runs(
                    lambda: run(torch.Generator(device).manual_seed(seed)), device=device, warmup=row_warmup, repeats=repeats
                )
                if device.type == "cuda":
                    memory.sample()  # everything the row allocated is still held here
                del run
        except Exception as exc:  # a row's failure is reported in its row, the others still run
            row.status, row.reason = "failed", f"{type(exc).__name__}: {first_line(exc)}"
            progress(f"{name}: failed ({row.reason})")
            continue
        row.times_s = times
        row.median_s, row.min_s, row.max_s = statistics.median(times), min(times), max(times)
        row.ms_per_step = 1000.0 * row.median_s / plan.num_steps
        row.images_per_s = shape[0] / row.median_s
        row.tflops = flops * plan.num_steps / row.median_s / 1e12
        if device.type == "cuda":
            row.peak_memory_mb, row.memory_kind = memory.mb, "cuda_device_growth"
        else:
            row.peak_memory_mb = None if rss.peak is None else rss.peak / 2**20
            row.memory_kind = "process_peak_rss"
        images = images.float().cpu()  # sync: parity is computed off the device, which frees the row
        if reference is None:
            reference = images
            row.parity = "reference"
        else:
            row.max_abs_diff = (images - reference).abs().max().item()
            row.psnr_db = psnr_db(images, reference)
            row.parity = "pass" if row.psnr_db >= PARITY_PSNR_DB[row.precision] else "FAIL"
        del images
    base = results[0].median_s if results[0].status == "ok" else None
    for row in results:
        if row.status == "ok" and base:
            row.speedup = base / row.median_s
    return env, results


def write_outputs(env: dict, rows: list[Row], *, json_path: str | None, csv_path: str | None, chart_path: str | None) -> None:
    if json_path:
        payload = json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=2, default=str)
        atomic_write(json_path, lambda f: f.write(payload.encode()))
    if csv_path:
        buf = io.StringIO()
        fields = [k for k in asdict(rows[0]) if k != "times_s"]
        writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
        atomic_write(csv_path, lambda f: f.write(buf.getvalue().encode()))
    if chart_path:
        title = f"{env['device']} · {env['sampler']} {env['steps']} steps · batch {env['shape'][0]} · {'x'.join(map(str, env['shape'][1:]))}"
        write_chart(rows, chart_path, title=title)


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
        return [n for n in ROWS if device_type in implementations.REGISTRY[n].default_row_on]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown benchmark rows {unknown or text!r}; choose from {', '.join(ROWS)}")
    return names


def main(
    args: BenchmarkRequest, *, model: UNet, plan: SamplingPlan, shape: tuple[int, int, int, int], precision: str
) -> list[Row]:
    """Run, print (header, table, summary) and write the requested outputs."""
    names = parse_rows(args.rows, device_type=plan.coefficients.device.type)  # the output paths were checked by main.py before any work
    if args.chart:
        import matplotlib  # noqa: F401  (fail now, not after the whole benchmark has run)
    env, rows = run_benchmark(
        model, plan, shape=shape, seed=args.seed, precision=precision, rows=names, warmup=args.warmup, repeats=args.repeats
    )
    print()
    for key in ("date", "device", "driver", "compute_capability", "torch", "cuda", "tensorrt", "python"):
        if key in env:
            print(f"{key:>18}: {env[key]}")
    print(
        f"{'model':>18}: {env['parameters'] / 1e6:.2f}M parameters, {env['unet_gflops_per_forward']:.2f} GFLOP per forward "
        f"at batch {shape[0]}; {plan.sampler}, {plan.num_steps} steps; {args.warmup} warm-up + {args.repeats} timed runs"
    )
    if "matmul_peak_tflops" in env:
        peaks = env["matmul_peak_tflops"]
        print(f"{'matmul peak':>18}: bf16 {peaks['bf16']:.0f} TFLOP/s, fp32 {peaks['fp32']:.0f} TFLOP/s (measured now)")
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


# ----- training throughput -------------------------------------------------------------------------
def training_variants(device: torch.device) -> list[tuple[str, dict]]:
    """(name, TrainConfig fields): fp32 eager vs mixed precision + fused AdamW + channels-last, +/- compile."""
    amp = "bf16" if device.type != "cuda" or torch.cuda.is_bf16_supported() else "fp16"
    fast = "+fused AdamW+channels-last" if device.type == "cuda" else ""
    return [
        ("fp32 eager", dict(precision="fp32", compile=False, cuda_fast_path=False)),
        ("fp32 compile", dict(precision="fp32", compile=True, cuda_fast_path=False)),
        (f"{amp}{fast} eager", dict(precision=amp, compile=False, cuda_fast_path=True)),
        (f"{amp}{fast} compile", dict(precision=amp, compile=True, cuda_fast_path=True)),
    ]


def run_training_benchmark(
    model_config, schedule_config, *, device: torch.device, batch_size: int, steps: int, warmup: int, seed: int,
    progress: Callable[[str], None] = print,
) -> list[dict]:
    """Images/s and peak memory of ``steps`` optimizer steps (after ``warmup``) for each variant."""
    from data import ImageSet
    from training import TrainConfig, Trainer

    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size * 4, model_config.in_channels, model_config.image_size, model_config.image_size)
    images = ImageSet("random", torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
    results = []
    for name, fields in training_variants(device):
        progress(f"training {name}: {warmup} warm-up + {steps} timed steps ...")
        row = {"name": name, **fields, "status": "ok", "reason": ""}
        results.append(row)
        try:
            config = TrainConfig(dataset="random", total_steps=warmup + steps + 1, batch_size=batch_size, seed=seed,
                                 warmup_steps=0, save_every=0, sample_every=0, **fields)  # fmt: skip
            trainer = Trainer(config, model_config, schedule_config, images=images, device=device)
            for _ in range(warmup):
                trainer.train_step()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()  # reads the loss each step (a sync), so the clock sees the GPU work
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
        except Exception as exc:  # e.g. torch.compile without a working compiler: report, go on
            row.update(status="failed", reason=f"{type(exc).__name__}: {first_line(exc)}")
            progress(f"training {name}: failed ({row['reason']})")
            continue
        row["images_per_s"] = steps * batch_size / elapsed
        row["ms_per_step"] = 1000.0 * elapsed / steps
        progress(f"training {name}: {row['images_per_s']:.1f} img/s")  # each variant's result as soon as it is known
        if device.type == "cuda":
            row["peak_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            row["peak_memory_mb"] = None if rss.peak is None else rss.peak / 2**20
    base = results[0].get("images_per_s")
    for row in results:
        if base and row.get("images_per_s"):
            row["speedup"] = row["images_per_s"] / base
    return results


def main_training(args: BenchmarkRequest, *, model_config, schedule_config, device: torch.device) -> list[dict]:
    warmup = max(args.warmup, 3)  # compile and cuDNN autotuning happen in the first steps
    rows = run_training_benchmark(
        model_config, schedule_config, device=device, batch_size=args.batch_size, steps=args.train_steps,
        warmup=warmup, seed=args.seed,
    )  # fmt: skip
    env = environment(device)
    print()
    for key in ("date", "device", "torch", "cuda"):
        print(f"{key:>10}: {env[key]}")
    print(f"{'model':>10}: {model_config.model_channels} base channels, {model_config.in_channels}x{model_config.image_size}"
          f"x{model_config.image_size}, batch {args.batch_size}, {warmup} warm-up + {args.train_steps} timed steps")  # fmt: skip
    print()
    print(f"{'variant':<40}{'img/s':>10}{'ms/step':>10}{'speedup':>9}{'peak MB':>9}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['name']:<40}{r['status']}: {r['reason']}")
            continue
        mem = "n/a" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        print(f"{r['name']:<40}{r['images_per_s']:>10.1f}{r['ms_per_step']:>10.1f}{_times(r.get('speedup')):>9}{mem:>9}")
    if args.json:
        payload = json.dumps({"environment": env, "training_rows": rows}, indent=2, default=str)
        atomic_write(args.json, lambda f: f.write(payload.encode()))
        print(f"wrote {args.json}")
    return rows
