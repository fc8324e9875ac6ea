"""The benchmark's honesty and its manners: the peak is the fastest rate measured (so a direct-convolution row
cannot pass 100% MFU), the header names the CPU and its vector extensions, a CPU run left at its defaults is
planned to take minutes and says how to ask for the full run, and the estimate is said before anything runs.
Timings here are fake: nothing is asserted about this machine's speed."""

import time

import pytest
import torch
from helpers import perturbed_unet, tiny_unet_config

from ddpm.benchmarks import peaks
from ddpm.benchmarks.plan import CPU_QUICK_STEPS, QUICK_ROWS, choose_plan, estimate_line, estimate_seconds
from ddpm.benchmarks.report import WINOGRAD_FOOTNOTE, Row, format_table
from ddpm.util.messages import format_seconds

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni xsave
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu
"""


def test_the_header_names_the_cpu_model_and_its_vector_extensions_in_order():
    assert peaks.cpu_description(CPUINFO) == (
        "AMD EPYC 9R14 96-Core Processor (sse4_2, avx, avx2, fma, avx512f, avx512bw, avx512vl, avx512_vnni, "
        "avx512_bf16)"
    )
    assert peaks.cpu_description("") == ""
    assert peaks.cpu_description("model name : X\nflags : fpu\n") == "X (no vector extensions listed)"


def test_the_peak_is_the_fastest_rate_measured_so_a_row_at_most_that_fast_is_at_most_100_percent():
    # MKL's matmul slower than oneDNN's convolution, as on the build machine: the convolution is the peak.
    rates = {"matmul 2048^3 (MKL)": 0.10, "conv NCHW (oneDNN)": 0.17, "conv NHWC (oneDNN)": 0.15}
    assert peaks.peak(rates) == 0.17
    assert peaks.mfu(0.17, rates) == pytest.approx(1.0)
    assert peaks.mfu(0.174 * 0.97, rates) < 1.0  # the original's 0.174 against a matmul "peak" read 166%
    assert peaks.mfu(0.1, {}) is None and peaks.mfu(0.1, None) is None  # no peak measured: no MFU


def test_measure_peaks_times_a_matmul_and_the_unets_largest_convolution_in_both_layouts(monkeypatch):
    model = perturbed_unet(tiny_unet_config())
    x, t = torch.randn(2, 1, 16, 16), torch.zeros(2, dtype=torch.long)
    biggest = peaks.largest_convolution(lambda: model(x, t), model)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert biggest.conv in convs and biggest.input_shape[0] == 2
    assert biggest.flops == 2 * 2 * 16 * 16 * 32 * 32 * 9  # the 32->32 3x3 convolutions at 16x16 (batch 2)
    seconds = iter([1.0, 0.5, 0.25])  # fake timings: matmul, NCHW conv, NHWC conv
    deadlines = []

    def fake_median(fn, *, deadline, **_):
        deadlines.append(deadline - time.perf_counter())
        return next(seconds)

    monkeypatch.setattr(peaks, "median_seconds", fake_median)
    monkeypatch.setattr(peaks, "cpu_matmul_size", lambda dtype, **_: 512)  # what the probe chose
    rates = peaks.measure_peaks(lambda: model(x, t), model, device=torch.device("cpu"), dtypes={"fp32": torch.float32})
    names = list(rates["fp32"])
    assert names[0] == "matmul 512^3 (MKL)" and rates["fp32"][names[0]] == pytest.approx(2 * 512**3 / 1e12)
    assert len(deadlines) == 3 and all(0 < left <= peaks.MEASURE_BUDGET_S for left in deadlines)  # each bounded
    assert "NCHW (oneDNN)" in names[1] and "NHWC (oneDNN)" in names[2]
    assert rates["fp32"][names[2]] == pytest.approx(biggest.flops / 0.25 / 1e12)


def test_a_cpu_matmul_for_the_peak_is_sized_so_that_one_call_stays_short():
    # A 256^3 probe as fast as a native CPU's fp32 gets the full 2048^3; as slow as emulated bf16, no larger than
    # keeps a call under MATMUL_CALL_S (a signal waits for the call in progress).
    assert peaks.matmul_size(1e-4) == peaks.CPU_MATMUL_N
    for probe in (1e-4, 1e-3, 0.0136, 0.1, 10.0):
        n = peaks.matmul_size(probe)
        assert peaks.MATMUL_PROBE_N <= n <= peaks.CPU_MATMUL_N
        assert n == peaks.MATMUL_PROBE_N or probe * (n / peaks.MATMUL_PROBE_N) ** 3 <= peaks.MATMUL_CALL_S
    assert peaks.matmul_size(0.0136) == 512  # emulated bf16 here: 2048^3 would be seconds a call


def test_a_measurement_stops_at_its_deadline_after_one_warm_up_and_one_timed_call():
    calls = []
    cpu = torch.device("cpu")
    peaks.median_seconds(lambda: calls.append(1), device=cpu, warmup=3, repeats=10, deadline=time.perf_counter())
    assert len(calls) == 2
    calls.clear()
    peaks.median_seconds(lambda: calls.append(1), device=cpu, warmup=3, repeats=10, deadline=time.perf_counter() + 60)
    assert len(calls) == 13


def test_a_winograd_row_says_its_rate_is_direct_equivalent():
    common = dict(precision="fp32", median_s=1.0, min_s=1.0, max_s=1.0, ms_per_step=1.0, images_per_s=1.0)
    rows = [Row(name="original", mfu=0.8, **common), Row(name="cuda", mfu=1.4, direct_equivalent=True, **common)]
    table = format_table(rows)
    assert "140.0%*" in table and "80.0% " in table and table.endswith(WINOGRAD_FOOTNOTE)
    assert WINOGRAD_FOOTNOTE not in format_table(rows[:1])


def test_a_cpu_run_left_at_its_defaults_is_planned_for_minutes_and_says_how_to_get_the_full_one():
    quick = choose_plan(device_type="cpu", steps=1000, rows="all", auto_row="cuda")
    assert quick.steps == CPU_QUICK_STEPS and quick.rows == ",".join(QUICK_ROWS["cpu"])
    assert "--sampling_steps 1000 --rows all" in quick.note and quick.note.startswith("quick plan")


def test_a_gpu_run_left_at_its_defaults_times_the_seeds_three_rows_and_autos_at_every_step():
    quick = choose_plan(device_type="cuda", steps=1000, rows="all", auto_row="cuda")
    assert quick.steps == 1000 and quick.rows == "original,cuda,tensorrt"
    assert "add --rows all" in quick.note and "max-autotune" in quick.note and "auto runs cuda" in quick.note
    other = choose_plan(device_type="cuda", steps=1000, rows="all", auto_row="cuda_steps")
    assert other.rows == "original,cuda,cuda_steps,tensorrt"  # auto's row is timed too


@pytest.mark.parametrize(
    "device_type,steps,rows,steps_given,rows_given",
    [
        ("cuda", 1000, "original,cuda_compile", False, True),  # rows the user named
        ("cpu", 1000, "all", True, True),  # the user asked for it all
        ("cpu", 20, "original,cuda", False, True),  # already short
    ],
)
def test_what_the_user_gave_is_never_changed(device_type, steps, rows, steps_given, rows_given):
    plan = choose_plan(
        device_type=device_type, steps=steps, rows=rows, auto_row="cuda", steps_given=steps_given, rows_given=rows_given
    )
    assert (plan.steps, plan.rows, plan.note) == (steps, rows, "")


def test_the_quick_plan_keeps_given_rows_and_shortens_only_default_steps():
    plan = choose_plan(device_type="cpu", steps=1000, rows="original,cuda", rows_given=True)
    assert (plan.steps, plan.rows) == (CPU_QUICK_STEPS, "original,cuda") and "--rows" not in plan.note


def test_the_estimate_is_rows_times_runs_times_steps_times_one_forward():
    assert estimate_seconds(rows=5, runs_per_row=4, steps=50, forward_s=0.25) == 250.0
    assert format_seconds(45) == "45 s" and format_seconds(250) == "4 min 10 s" and format_seconds(3900) == "1 h 05 min"
    line = estimate_line(rows=5, runs_per_row=4, steps=50, forward_s=0.25)
    assert line.startswith("about 4 min 10 s: 5 rows x 4 runs x 50 steps x 250 ms")


def test_the_peaks_are_measured_again_after_the_rows_and_the_faster_of_each_kept():
    from ddpm.benchmarks.sampling_bench import remeasure_peaks

    env = {"peak_sources_tflops": {"fp32": {"matmul": 0.10, "conv": 0.12}}, "peak_tflops": {"fp32": 0.12}}
    rows = [Row(name="onnxruntime", precision="fp32", tflops=0.125), Row(name="tensorrt", precision="fp32")]
    remeasure_peaks(env, rows, {"fp32": {"matmul": 0.09, "conv": 0.17}})  # the machine got quieter
    assert env["peak_sources_tflops"]["fp32"] == {"matmul": 0.10, "conv": 0.17}
    assert env["peak_tflops"]["fp32"] == 0.17 and rows[0].mfu == pytest.approx(0.125 / 0.17) and rows[1].mfu is None
