"""The benchmark's record of one row and how rows are reported: the table, the summary, the chart,
JSON and CSV, and the environment line every measurement carries (device, driver, versions, date).

sampling_bench.py and training_bench.py measure; this module formats and writes what they measured, and holds
what both share: the peak-memory sampler (PeakRSS). What they are asked for is ddpm/requests.py's BenchmarkRequest.
"""

from __future__ import annotations

import csv
import io
import json
import math
import platform
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ddpm.benchmarks.peaks import this_cpu
from ddpm.util.safe_files import atomic_write


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR of two image batches in [-1, 1] (peak-to-peak 2): a row's parity against the original's images."""
    mse = torch.mean((a.double() - b.double()) ** 2).item()  # sync: one number
    return math.inf if mse == 0 else 10.0 * math.log10(4.0 / mse)


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
    mfu: float | None = None  # tflops / the machine's peak in the row's precision (peaks.py: env["peak_tflops"])
    direct_equivalent: bool = False  # tflops counts a direct convolution's FLOPs; the row does fewer (Winograd)
    build_s: float | None = None  # one-time cost: building the row (export, compile, capture) + its first run's excess
    detail: str = ""  # what ran, where the name does not say (onnxruntime's execution provider)
    loop_s: float | None = None  # a latent model: the sampling loop alone (median s)
    decode_s: float | None = None  # and its decoder alone, on the loop's latents


def environment(device: torch.device) -> dict:
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({this_cpu() or platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["driver"] = _driver_version()
        info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    for package in ("tensorrt", "onnxruntime", "openvino"):
        info[package] = _version(package)
    return info


def _version(package: str) -> str:
    """An optional package's version, or "not installed" (imported: the version some wheels know only then)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(package) is None:
        return "not installed"
    try:
        return str(getattr(importlib.import_module(package), "__version__", "unknown")).split("-")[0]
    except ImportError:
        return "not installed"


def _driver_version() -> str:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def format_table(rows: list[Row]) -> str:
    head = (
        "implementation",
        "precision",
        "median s",
        "min-max s",
        "ms/step",
        "img/s",
        "speedup",
        "MFU",
        "build s",
        "peak MB",
        "max|diff|",
        "PSNR dB",
        "parity",
    )
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append((r.name, r.precision, f"{r.status}: {r.reason}"))
            continue
        lines.append(
            (
                f"{r.name} ({r.detail})" if r.detail else r.name,
                r.precision,
                f"{r.median_s:.3f}",
                f"{r.min_s:.3f}-{r.max_s:.3f}",
                f"{r.ms_per_step:.2f}",
                f"{r.images_per_s:.1f}",
                times_text(r.speedup),
                "-" if r.mfu is None else f"{100 * r.mfu:.1f}%" + ("*" if r.direct_equivalent else ""),
                _seconds(r.build_s, 1),
                "n/a" if r.peak_memory_mb is None else f"{r.peak_memory_mb:.0f}",
                "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}",
                "-" if r.psnr_db is None else f"{r.psnr_db:.1f}",
                r.parity,
            )
        )
    if any(r.decode_s is not None for r in rows):  # a latent model: the two stages' own times
        head = (*head[:3], "loop s", "decoder s", *head[3:])
        lines = [
            (*line[:3], _seconds(r.loop_s), _seconds(r.decode_s), *line[3:]) if len(line) > 3 else line
            for r, line in zip(rows, lines)
        ]
    widths = [max([len(h), *(len(line[i]) for line in lines if len(line) > 3)]) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for line in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths)) if len(line) > 3 else "  ".join(line))
    if any(r.direct_equivalent for r in rows if r.status == "ok"):
        out.append(WINOGRAD_FOOTNOTE)
    return "\n".join(out)


WINOGRAD_FOOTNOTE = (
    "* Winograd convolutions: TFLOP/s and MFU count the direct convolution's FLOPs (a direct-equivalent rate); "
    "the row does fewer multiply-adds, so its MFU may pass 100%"
)


def _seconds(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def times_text(speedup: float | None) -> str:
    return "-" if speedup is None else f"{speedup:.2f}x"


SUMMARY_NAMES = {
    "original": "Original PyTorch implementation",
    "cuda": "CUDA-optimized implementation",
    "tensorrt": "TensorRT implementation",
    "compile": "torch.compile implementation",
    "onnxruntime": "onnxruntime implementation",
    "torchscript": "TorchScript implementation",
}


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
            lines.append(f"{label}: {r.median_s:.2f}s (Speedup: {times_text(r.speedup)})")
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
        ax.annotate(
            times_text(r.speedup), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )
    ax.set_ylabel("median seconds per sampling run")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buf.getvalue()))


def write_outputs(
    env: dict, rows: list[Row], *, json_path: str | None, csv_path: str | None, chart_path: str | None
) -> None:
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
        size = "x".join(map(str, env["shape"][1:]))
        title = f"{env['device']} · {env['sampler']} {env['steps']} steps · batch {env['shape'][0]} · {size}"
        write_chart(rows, chart_path, title=title)


# ----- measuring ---------------------------------------------------------------------------------
class PeakRSS:
    """The process's peak resident set while a block runs, in bytes (``peak``; None off Linux).

    Reads VmHWM from /proc/self/status after resetting it through /proc/self/clear_refs, so nothing runs beside
    the timed work; where the reset is refused, a thread samples the resident set instead.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()
        self._thread: threading.Thread | None = None
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

    @staticmethod
    def _high_water_mark() -> int | None:
        """VmHWM in bytes, or None."""
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024  # kB
        except (OSError, ValueError, IndexError):
            pass
        return None

    def __enter__(self) -> PeakRSS:
        if self._read() is None:
            self.peak = None
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            if self._high_water_mark() is not None:
                return self
        except OSError:
            pass
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read() or 0)
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        if self.peak is None:
            return
        if self._thread is None:
            self.peak = max(self._high_water_mark() or 0, self._read() or 0)
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read() or 0)
