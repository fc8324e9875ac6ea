"""Benchmark mode: a tiny CPU run through the CLI, its JSON rows, parity, and the reporting helpers."""

import json
import math
import mmap
import os
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch
from helpers import ROOT, TINY_SCHEDULE, perturbed_unet, run, run_here, tiny_unet_config

from basic_diffusion import UNet, UNetConfig
from ddpm.benchmarks.report import PeakRSS, psnr_db
from ddpm.benchmarks.sampling_bench import Row, format_summary, format_table, unet_flops
from ddpm.training.winograd import weight_grad_available
from noise_schedule import NoiseSchedule
from optimized_diffusion import winograd_is_fast


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        str(ROOT / "main.py"),
        "--mode",
        "benchmark",
        "--device",
        "cpu",
        "--img_size",
        "16",
        "--channels",
        "1",
        "--model_channels",
        "16",
        "--num_res_blocks",
        "1",
        "--timesteps",
        "50",
        "--n_samples",
        "4",
        "--sampler",
        "ddim",
        "--sampling_steps",
        "5",
        "--repeats",
        "2",
        "--rows",
        "original,cuda,cuda_steps,tensorrt,diffusers",
        "--json",
        "b.json",
        "--csv",
        "b.csv",
        "--chart",
        "b.png",
    ]
    started = time.perf_counter()
    # A process of its own: the benchmark sets the whole process's malloc to keep freed memory (cpu_memory.py), which
    # would hide test_peak_rss_sees_an_allocation's allocation in memory already resident.
    result = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started  # the process's whole life: an outer bound on anything it timed
    assert result.returncode == 0, result.stderr
    return work, result.stdout, json.loads((work / "b.json").read_text()), wall


def test_benchmark_json_has_one_row_per_implementation(bench):
    _, _, data, wall = bench
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ["original", "cuda", "cuda_steps", "tensorrt", "diffusers"]
    assert 0 < sum(sum(rows[name]["times_s"]) for name in ("original", "cuda")) < wall  # measured inside the run
    for name in ("original", "cuda"):
        r = rows[name]
        assert r["status"] == "ok" and len(r["times_s"]) == 2
        assert (r["min_s"], r["median_s"], r["max_s"]) == (
            min(r["times_s"]),
            statistics.median(r["times_s"]),
            max(r["times_s"]),
        )
        assert r["images_per_s"] == pytest.approx(4 / r["median_s"])
        assert r["ms_per_step"] == pytest.approx(1000 * r["median_s"] / 5)
    assert rows["original"]["speedup"] == 1.0 and rows["original"]["detail"] == ""
    # A row that cannot run is listed with its reason, never dropped.
    assert rows["tensorrt"]["status"] == "unavailable" and "tensorrt" in rows["tensorrt"]["reason"].lower()
    # diffusers' UNet2DModel holds this model (16 channels in groups of 4): its own loop, timed like the others.
    assert rows["diffusers"]["status"] == "ok" and len(rows["diffusers"]["times_s"]) == 2, rows["diffusers"]
    env = data["environment"]
    for name in ("original", "cuda"):  # MFU against the fastest fp32 rate measured in the same run; build seconds
        assert rows[name]["mfu"] == pytest.approx(rows[name]["tflops"] / env["peak_tflops"]["fp32"])
        assert rows[name]["build_s"] >= 0
    assert env["peak_tflops"]["fp32"] == max(env["peak_sources_tflops"]["fp32"].values())
    winograd = winograd_is_fast()  # the runner's Winograd convolutions: AVX-512 CPUs only
    assert not rows["original"]["direct_equivalent"] and rows["cuda"]["direct_equivalent"] == winograd
    assert env["steps"] == 5 and env["shape"] == [4, 1, 16, 16] and env["unet_gflops_per_forward"] > 0


def test_benchmark_rows_draw_the_same_images(bench):
    _, _, data, _ = bench
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["cuda_steps"]["parity"] == "pass" and rows["cuda_steps"]["max_abs_diff"] == 0.0  # bit-exact kernels
    assert rows["cuda"]["parity"] == "pass" and rows["cuda"]["max_abs_diff"] < 1e-3  # the runner: float rounding
    runner = "fused U-Net runner" + (", Winograd convolutions" if winograd_is_fast() else "")
    assert rows["cuda"]["detail"] == runner


def test_benchmark_says_its_estimate_before_timing_and_names_the_peak_it_used(bench):
    _, stdout, _, _ = bench
    assert stdout.index("estimated time: about ") < stdout.index("===== BENCHMARK RESULTS")
    assert "fp32 peak: " in stdout and re.search(r"the fastest of: matmul \d+\^3 \(MKL\)", stdout)


def test_benchmark_prints_the_summary_and_writes_csv_and_chart(bench):
    work, stdout, _, _ = bench
    assert "Original PyTorch implementation:" in stdout and "CUDA-optimized implementation:" in stdout
    assert "Speedup:" in stdout
    assert (work / "b.csv").read_text().splitlines()[0].startswith("name,precision,status")
    assert (work / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_psnr_of_known_error():
    a = torch.zeros(2, 1, 4, 4)
    assert psnr_db(a, a) == math.inf
    assert psnr_db(a, a + 0.02) == pytest.approx(10 * math.log10(4 / 0.0004))


def test_flop_count_of_the_unet_matches_its_convolutions():
    # A U-Net with one level and no attention: count the 3x3 and 1x1 convolutions and linears by hand.
    config = UNetConfig(
        image_size=8,
        in_channels=1,
        model_channels=8,
        channel_mult=(1,),
        num_res_blocks=1,
        attention_resolutions=(),
        num_heads=1,
        dropout=0.0,
        norm_groups=8,
    )
    model = UNet(config).eval()
    hw, expected = 64, 0
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            expected += 2 * hw * m.in_channels * m.out_channels * m.kernel_size[0] * m.kernel_size[1]
        elif isinstance(m, torch.nn.Linear):
            expected += 2 * m.in_features * m.out_features
    # The mid-block attention (8 channels, 64 positions): QK^T and AV.
    expected += 2 * 2 * 64 * 64 * 8
    assert unet_flops(model, shape=(1, 1, 8, 8), device=torch.device("cpu")) == expected


def test_table_and_summary_show_unavailable_rows():
    rows = [
        Row(
            name="original",
            precision="fp32",
            median_s=2.0,
            min_s=1.9,
            max_s=2.1,
            ms_per_step=2.0,
            images_per_s=4.0,
            speedup=1.0,
            parity="reference",
        ),
        Row(name="tensorrt", precision="fp32", status="unavailable", reason="TensorRT not installed"),
    ]
    assert "unavailable: TensorRT not installed" in format_table(rows)
    assert "TensorRT implementation: unavailable (TensorRT not installed)" in format_summary(rows)


def test_peak_rss_sees_an_allocation():
    with PeakRSS() as baseline:
        pass
    with PeakRSS() as rss:
        # 64 MiB of fresh pages, every one written: mapped here, since malloc may hand back memory that an earlier
        # test freed and the process kept (keep_freed_memory), already resident.
        big = mmap.mmap(-1, 64 * 2**20)
        big.write(b"\1" * len(big))
        time_to_see = big[len(big) - 1]
    assert time_to_see > 0
    if baseline.peak is not None:
        assert rss.peak >= baseline.peak + 48 * 2**20
    if os.access("/proc/self/clear_refs", os.W_OK):  # Linux's own peak, reset per block: no sampling thread
        assert rss._thread is None


# Where this CPU trains fp32's 3x3 convolutions in Winograd's domain and its 1x1 ones as GEMMs: with AVX2's and
# AVX-512's kernels with the thin first and last convolutions direct, nowhere on other CPUs.
WINOGRAD = (
    "+Winograd+1x1 GEMMs+thin convs direct" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else ""
)
WINOGRAD = WINOGRAD if weight_grad_available() else ""  # the extension built with the ops
TRAINING_ROWS = [
    "fp32 eager",
    f"default: fp32+channels-last+fused norms{WINOGRAD} eager",  # the suite keeps --precision auto at fp32 on a CPU
    "diffusers UNet2DModel fp32 eager",
    "fp32 compile",
    "fp32 eager+channels-last+fused norms",
    "bf16+channels-last+fused norms eager",
    "bf16 compile",
    "fp32 eager, grad checkpoint",
    "bf16+channels-last+fused norms eager, grad checkpoint",
    "fp32 eager, t: importance",
    "fp32 eager, t: topk",
    "fp32 eager, t: speed",
]


def test_the_benchmark_help_names_every_training_row(tmp_path):
    from ddpm.benchmarks.training_bench import variant_keys

    help_text = " ".join(run_here("--mode", "benchmark", "--help", cwd=tmp_path).stdout.split())
    listed = help_text.split("with --bench training, from", 1)[1].split("(")[0]  # argparse wraps mid-word
    named = re.sub(r"\s+", "", listed).split(",")
    keys = {key if not key.startswith("t_") else "t_<sampler>" for key in variant_keys()}
    assert set(named) == keys


@pytest.mark.parametrize(
    "rows",
    [
        "amp,fp32_checkpoint,t_importance,t_topk,t_speed",  # each kind of row, none compiled
        pytest.param("all", marks=pytest.mark.slow),  # two torch.compile builds: minutes on 2 cores
    ],
)
def test_training_benchmark_reports_every_variant(tmp_path, rows):
    cmd = [
        "--mode",
        "benchmark",
        "--bench",
        "training",
        "--device",
        "cpu",
        "--img_size",
        "16",
        "--channels",
        "1",
        "--model_channels",
        "16",
        "--num_res_blocks",
        "1",
        "--batch_size",
        "8",
        "--train_steps",
        "2",
        "--rows",
        rows,
        "--json",
        "t.json",
    ]
    started = time.perf_counter()
    # In this process, but the torch.compile builds of "all" in their own (dynamo's caches stay there).
    result = (run if rows == "all" else run_here)(*cmd, cwd=tmp_path)
    wall = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    expected = TRAINING_ROWS if rows == "all" else [TRAINING_ROWS[i] for i in (0, 5, 7, 9, 10, 11)]
    payload = json.loads((tmp_path / "t.json").read_text())
    reported = payload["training_rows"]
    assert [r["name"] for r in reported] == expected
    if sys.platform.startswith("linux"):  # the rows ran with the trainer's kept memory, and the JSON says so
        assert payload["environment"]["cpu_allocator"].startswith("glibc malloc keeps freed memory")
    for r in reported:
        assert r["status"] == "ok", r["reason"]
        assert r["images_per_s"] == pytest.approx(8 * 1000 / r["ms_per_step"])
    assert 0 < sum(2 * r["ms_per_step"] / 1000 for r in reported) < wall  # 2 timed steps a row, inside the run
    assert reported[0]["speedup"] == 1.0


def test_interleaved_training_rows_run_in_rounds_and_their_speedups_cancel_the_machines_drift(monkeypatch):
    """--interleave for training: every row held, then INTERLEAVED_ROUNDS rounds of each row's steps; a machine
    that slows down round by round slows every row alike, so the speedup stays the true ratio."""
    from ddpm.benchmarks import training_bench

    clock, calls = [0.0], [0]
    monkeypatch.setattr(training_bench.time, "perf_counter", lambda: clock[0])

    class Step:  # a trainer whose step costs `cost` seconds, times the machine's slowdown in this round
        def __init__(self, cost: float) -> None:
            self.cost = cost

        def train_step(self) -> None:
            round_index = calls[0] // (2 * 3)  # 3 steps of each of 2 rows a round
            calls[0] += 1
            clock[0] += self.cost * (1 + round_index)

    rows = [{"key": "fp32", "name": "fp32 eager"}, {"key": "default", "name": "default"}]
    held = {"fp32": Step(0.2), "default": Step(0.1)}
    training_bench.time_in_rounds(rows, held, steps=3, batch_size=8, device=torch.device("cpu"), progress=print)
    assert [len(r["round_images_per_s"]) for r in rows] == [training_bench.INTERLEAVED_ROUNDS] * 2
    assert rows[0]["round_images_per_s"][0] == pytest.approx(2 * rows[0]["round_images_per_s"][1])  # the drift
    assert rows[1]["speedup"] == pytest.approx(2.0) and rows[0]["speedup"] == pytest.approx(1.0)
    # images/s: all the row's images over all its time (rounds of 0.6, 1.2 and 1.8 s for 24 images each)
    assert rows[0]["images_per_s"] == pytest.approx(72 / 3.6)
    assert rows[0]["peak_memory_mb"] is None  # the rows were held together


def test_interleaved_training_benchmark_reports_its_rounds(tmp_path):
    cmd = ["--mode", "benchmark", "--bench", "training", "--device", "cpu", "--img_size", "16", "--channels", "1"]
    cmd += ["--model_channels", "16", "--num_res_blocks", "1", "--batch_size", "8", "--train_steps", "1"]
    result = run_here(*cmd, "--rows", "t_importance", "--interleave", "--json", "t.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    payload = json.loads((tmp_path / "t.json").read_text())
    assert payload["environment"]["timing"].startswith("interleaved rounds")
    reported = payload["training_rows"]
    assert [r["key"] for r in reported] == ["fp32", "t_importance"]
    assert all(r["status"] == "ok" and len(r["round_images_per_s"]) == 3 for r in reported)
    assert reported[0]["speedup"] == 1.0


def test_training_rows_are_chosen_by_key_with_the_fp32_baseline_first():
    from ddpm.benchmarks.training_bench import select_variants

    cpu = torch.device("cpu")
    assert [key for key, _, _ in select_variants("amp_checkpoint,fp32_checkpoint", cpu)] == [
        "fp32",
        "fp32_checkpoint",
        "amp_checkpoint",
    ]
    assert [fields.get("grad_checkpoint", False) for _, _, fields in select_variants("fp32_checkpoint", cpu)] == [
        False,
        True,
    ]
    assert len(select_variants("all", cpu)) == len(select_variants(None, cpu)) == 12
    with pytest.raises(ValueError, match="not a training row"):
        select_variants("fp32,onnxruntime", cpu)


def test_rows_are_built_timed_and_freed_one_at_a_time(monkeypatch):
    """No row is built before the previous one is timed and released, so no row carries another's
    buffers, graph pools or engines (its memory is measured alone)."""
    import gc
    import weakref

    from ddpm.benchmarks import sampling_bench
    from noise_schedule import NoiseSchedule, ScheduleConfig

    events, alive = [], []

    class Runner:
        def __init__(self, name):
            self.name = name

        def __call__(self, g):
            events.append(f"run {self.name}")
            return torch.randn((2, 1, 8, 8), generator=g) + errors[self.name] * torch.randn((2, 1, 8, 8))

    # cuda: float rounding (pass); torchscript: an RMS error of 0.01, about 1.3 uint8 levels (46 dB: FAIL).
    errors = {"original": 0.0, "cuda": 1e-6, "torchscript": 1e-2}

    def fake_make_row(name, *, model, plan, shape, precision, guidance=None, first_stage=None):
        gc.collect()
        events.append(f"build {name} (earlier rows alive: {sum(r() is not None for r in alive)})")
        runner = Runner(name)
        alive.append(weakref.ref(runner))
        return "fp32", runner, "", None  # a pixel model: no decoder

    monkeypatch.setattr(sampling_bench, "make_row", fake_make_row)
    # The machine's peaks (a large matmul, before and after the rows: seconds) are not what this checks.
    monkeypatch.setattr(sampling_bench, "measure_peaks", lambda *a, **k: {"fp32": {"fake": 1.0}})
    config = UNetConfig(
        image_size=8,
        in_channels=1,
        model_channels=8,
        channel_mult=(1,),
        num_res_blocks=1,
        attention_resolutions=(),
        num_heads=1,
        dropout=0.0,
        norm_groups=8,
    )
    plan = NoiseSchedule(ScheduleConfig(num_timesteps=10)).make_plan("ddim", sampling_steps=2)
    _, rows = sampling_bench.time_rows(
        UNet(config).eval(),
        plan,
        shape=(2, 1, 8, 8),
        seed=0,
        precision="fp32",
        rows=["cuda", "torchscript"],
        warmup=0,
        repeats=2,
        progress=lambda _: None,
    )
    assert events == [
        "build original (earlier rows alive: 0)",
        "run original",
        "run original",
        # rows other than the reference get at least one warm-up run, even with --warmup 0
        "build cuda (earlier rows alive: 0)",
        "run cuda",
        "run cuda",
        "run cuda",
        "build torchscript (earlier rows alive: 0)",
        "run torchscript",
        "run torchscript",
        "run torchscript",
    ]
    assert [r.parity for r in rows] == ["reference", "pass", "FAIL"]  # judged on the images, not the seed
    assert 30 < rows[2].psnr_db < 60 and 0 < rows[1].max_abs_diff < 1e-5 < 1e-2 < rows[2].max_abs_diff
    assert all(r.memory_kind == "process_peak_rss" for r in rows)


def test_interleaved_rows_run_in_rounds_and_their_speedups_cancel_the_machines_drift(monkeypatch):
    """--interleave: every row built and warmed up first, then one run of each row per round, and the speedup is the
    median of the per-round ratios. On a machine whose speed moves between and within rounds (a fake clock here:
    each run's slowdown is drawn from a list) a row twice as fast stays 2x, where the ratio of the two medians
    would say 1x."""
    from ddpm.benchmarks import sampling_bench
    from noise_schedule import NoiseSchedule, ScheduleConfig

    clock, events, work = [0.0], [], {"original": 2.0, "cuda": 1.0}
    slowdown = iter([1, 1] + [1, 1] + [4, 4] + [2, 6])  # the two warm-ups, then rounds (original, cuda)

    def fake_make_row(name, *, model, plan, shape, precision, guidance=None, first_stage=None):
        events.append(f"build {name}")

        def run(g):
            events.append(f"run {name}")
            clock[0] += work[name] * next(slowdown)
            return torch.zeros(2, 1, 8, 8)

        return "fp32", run, "", None

    monkeypatch.setattr(sampling_bench, "make_row", fake_make_row)
    monkeypatch.setattr(sampling_bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(sampling_bench, "measure_peaks", lambda *a, **k: {"fp32": {"fake": 1.0}})  # real clock
    config = UNetConfig(
        image_size=8,
        in_channels=1,
        model_channels=8,
        channel_mult=(1,),
        num_res_blocks=1,
        attention_resolutions=(),
        num_heads=1,
        dropout=0.0,
        norm_groups=8,
    )
    plan = NoiseSchedule(ScheduleConfig(num_timesteps=10)).make_plan("ddim", sampling_steps=2)
    env, rows = sampling_bench.time_rows(
        UNet(config).eval(),
        plan,
        shape=(2, 1, 8, 8),
        seed=0,
        precision="fp32",
        rows=["cuda"],
        warmup=1,
        repeats=3,
        progress=lambda _: None,
        interleave=True,
    )
    assert events == ["build original", "run original", "build cuda", "run cuda"] + ["run original", "run cuda"] * 3
    assert rows[0].times_s == [2.0, 8.0, 4.0] and rows[1].times_s == [1.0, 4.0, 6.0]  # medians 4 and 4
    assert rows[1].speedup == 2.0 and rows[0].speedup == 1.0 and env["timing"] == "interleaved rounds"
    assert [r.parity for r in rows] == ["reference", "pass"]
    assert all(r.peak_memory_mb is None and "not measured" in r.memory_kind for r in rows)


def test_all_rows_leave_out_the_compiled_cuda_row_on_a_cpu():
    from ddpm.benchmarks.rows import parse_rows

    assert "cuda_compile" not in parse_rows("all", device_type="cpu")
    assert "cuda_compile" in parse_rows("all", device_type="cuda")
    with pytest.raises(ValueError, match="unknown benchmark rows"):
        parse_rows("original,warp_drive")


def test_the_rows_keep_their_names_and_a_variant_is_a_sample_implementation_with_parameters():
    """--rows' names and the JSON's row names are those the registry's entries had; a variant builds the registry's
    implementation with its precision, runner or torch.compile fixed (the registry holds what --implementation
    offers)."""
    from ddpm.backends import registry
    from ddpm.benchmarks import sampling_bench
    from ddpm.benchmarks.rows import ROWS, parse_rows

    assert list(ROWS) == [
        *("original", "cuda", "cuda_steps", "cuda_fused_unet", "cuda_onednn", "cuda_compile"),
        "cuda_compile_max_autotune",
        *("cuda_fp32", "diffusers", "compile", "onnxruntime", "onnxruntime_int8", "openvino", "openvino_f32"),
        *("torchscript", "tensorrt"),
    ]
    assert parse_rows("all", device_type="cpu") == [
        *("original", "cuda", "diffusers", "compile", "onnxruntime", "openvino", "openvino_f32", "torchscript"),
        "tensorrt",
    ]
    assert registry.SAMPLE_IMPLEMENTATIONS == tuple(registry.REGISTRY) == ("original", "cuda", "cuda_steps",
                                                                           "onnxruntime", "tensorrt")  # fmt: skip
    assert set(registry.PEERS) == {"diffusers", "compile", "openvino", "torchscript"}  # timed, never offered
    assert {row.implementation for row in ROWS.values()} == set(registry.REGISTRY) | set(registry.PEERS)
    assert (ROWS["cuda_compile"].implementation, ROWS["cuda_compile"].compile) == ("cuda", True)
    assert ROWS["cuda_compile_max_autotune"].compile == "max-autotune-no-cudagraphs"
    assert (ROWS["cuda_fp32"].implementation, ROWS["cuda_fp32"].precision) == ("cuda_steps", "fp32")
    assert (ROWS["onnxruntime_int8"].implementation, ROWS["onnxruntime_int8"].precision) == ("onnxruntime", "int8")
    assert (ROWS["openvino_f32"].implementation, ROWS["openvino_f32"].openvino_precision) == ("openvino", "f32")
    model = perturbed_unet(tiny_unet_config())
    plan = NoiseSchedule(TINY_SCHEDULE).make_plan("ddim", sampling_steps=2)
    built = {
        name: sampling_bench.make_row(name, model=model, plan=plan, shape=(2, 1, 16, 16), precision="bf16")
        for name in ("cuda", "cuda_steps", "cuda_fused_unet", "cuda_fp32")
    }
    assert built["cuda_fp32"][0] == "fp32" and built["cuda_steps"][0] == "bf16"  # fixed, or the run's
    runner = {name: "fused U-Net runner" in detail for name, (_, _, detail, _) in built.items()}
    assert runner == {"cuda": False, "cuda_steps": False, "cuda_fused_unet": True, "cuda_fp32": False}
    fp32 = sampling_bench.make_row("cuda", model=model, plan=plan, shape=(2, 1, 16, 16), precision="fp32")
    assert "fused U-Net runner" in fp32[2]  # cuda's row runs the runner where sample mode's selection would
    # cuda_onednn: the same runner with oneDNN's convolutions where cuda runs Winograd's (on a CPU where it is faster)
    onednn = sampling_bench.make_row("cuda_onednn", model=model, plan=plan, shape=(2, 1, 16, 16), precision="fp32")
    expected = sampling_bench.WINOGRAD_DETAIL if winograd_is_fast() else "fused U-Net runner"
    assert (fp32[2], onednn[2]) == (expected, "fused U-Net runner")


def test_the_gpu_profile_stage_splits_a_forward_by_kernel_category(tmp_path):
    """scripts/gpu_profile.py (gpu_check.sh's profile stage) on the CPU: per-category time of the fused runner and
    the eager U-Net, per-convolution TFLOP/s from the profiler's FLOP counts, group_norm_act's GB/s."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "scripts" / "gpu_profile.py")
    gpu_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_profile)
    assert [
        gpu_profile.category(n)
        for n in (
            "sm90_xmma_fprop_implicit_gemm_bf16",
            "ampere_bf16_s16816gemm",
            "void diffusion_kernels::group_norm_act_kernel<float>",
            "pytorch_flash::flash_fwd_kernel",
            "diffusion_kernels::fused_step_kernel",
            "nchwToNhwcKernel",
            "vectorized_elementwise_kernel",
        )
    ] == ["convolution", "gemm", "group_norm_act", "attention", "fused_step", "copy/cast/layout", "other"]
    assert (
        gpu_profile.main(
            [
                "--out",
                str(tmp_path),
                "--device",
                "cpu",
                "--img_size",
                "8",
                "--batch",
                "2",
                "--precision",
                "fp32",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "profile.json").read_text())
    fused, eager = result["runs"]["fused_unet"], result["runs"]["eager_autocast"]
    assert fused["ms_per_forward"]["convolution"] > 0 and fused["ms_per_forward"]["group_norm_act"] > 0
    assert "group_norm_act" not in eager["ms_per_forward"]
    assert fused["convolutions"] and all(c["tflops"] > 0 for c in fused["convolutions"])
    assert fused["group_norm_act"] and all(n["gbs"] > 0 for n in fused["group_norm_act"])
    assert (tmp_path / "profile.txt").read_text().count("ms per forward") == 2
