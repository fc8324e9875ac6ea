"""The OpenVINO rows: compiled first in a child process, so a runtime that crashes while compiling (OpenVINO
2026.4's f32 on an AVX-512 Zen 4, a static batch here) becomes a row saying what happened, and the benchmark
times the other rows."""

import importlib.util
import signal

import pytest
import torch
from helpers import TINY_SCHEDULE, perturbed_unet, tiny_unet_config

from ddpm.backends import openvino_runtime
from noise_schedule import NoiseSchedule

SEGFAULT = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"


def test_a_child_that_crashes_becomes_a_one_line_error_naming_the_signal(tmp_path):
    with pytest.raises(ValueError, match=r"^OpenVINO crashed \(SIGSEGV\) while compiling the U-Net with "):
        openvino_runtime.compile_in_child(tmp_path / "x.onnx", {"INFERENCE_PRECISION_HINT": "f32"}, code=SEGFAULT)


def test_a_child_that_fails_says_why_and_one_that_succeeds_reports_its_precision(tmp_path):
    with pytest.raises(ValueError, match=r"could not compile the U-Net with its defaults \(RuntimeError: no\)"):
        openvino_runtime.compile_in_child(tmp_path / "x.onnx", {}, code="raise RuntimeError('no')")
    assert openvino_runtime.compile_in_child(tmp_path / "x.onnx", {}, code="print(\"<Type: 'bfloat16'>\")") == "bf16"
    assert signal.Signals.SIGSEGV.value == 11  # the name the row shows comes from the exit status


def test_the_benchmark_reports_a_crashing_openvino_row_and_times_the_others(monkeypatch, tiny_onnx_bytes):
    pytest.importorskip("openvino")
    import onnx

    from ddpm.benchmarks import sampling_bench
    from ddpm.formats import exporters

    original = openvino_runtime.compile_in_child
    monkeypatch.setattr(
        openvino_runtime, "compile_in_child", lambda path, config, **kw: original(path, config, code=SEGFAULT)
    )
    # Neither the row's ONNX export nor the machine's peaks are what this checks (seconds each): the session's
    # export of this same U-Net (tests/conftest.py) stands in for the export, and the peaks are not measured.
    monkeypatch.setattr(
        exporters, "export_onnx_model", lambda model, **kw: onnx.load_model_from_string(tiny_onnx_bytes)
    )
    monkeypatch.setattr(sampling_bench, "measure_peaks", lambda *a, **k: {"fp32": {"fake": 1.0}})
    model = perturbed_unet(tiny_unet_config())
    plan = NoiseSchedule(TINY_SCHEDULE).make_plan("ddim", sampling_steps=2)
    _, rows = sampling_bench.time_rows(
        model,
        plan,
        shape=(2, 1, 16, 16),
        seed=0,
        precision="fp32",
        rows=["openvino", "cuda"],
        warmup=0,
        repeats=1,
        progress=lambda _: None,
    )
    by_name = {row.name: row for row in rows}
    assert by_name["openvino"].status == "unavailable"
    assert by_name["openvino"].reason == "OpenVINO crashed (SIGSEGV) while compiling the U-Net with its defaults"
    assert by_name["cuda"].status == "ok" and by_name["cuda"].parity == "pass"


@pytest.mark.slow  # 17 s: an OpenVINO compile; its child-process handling stays in the default run
@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")
def test_openvino_runs_the_onnx_export_in_the_original_loop_to_fp32_tolerance():
    from ddpm.backends import registry

    model = perturbed_unet(tiny_unet_config())
    plan = NoiseSchedule(TINY_SCHEDULE).make_plan("ddim", sampling_steps=3)
    options = registry.SamplerOptions(openvino_precision="f32")  # the openvino_f32 row's
    sampler = registry.PEERS["openvino"].build(model, plan, shape=(2, 1, 16, 16), options=options)
    reference = registry.get("original").build(model, plan, shape=(2, 1, 16, 16), options=options)
    images = sampler(generator=torch.Generator().manual_seed(1))
    assert sampler.precision == "fp32" and sampler.detail.startswith("OpenVINO ")
    torch.testing.assert_close(images, reference(generator=torch.Generator().manual_seed(1)), rtol=1e-3, atol=1e-3)
