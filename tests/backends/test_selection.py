"""What draws (backends/selection.py): --implementation auto, the precision, and the cuda implementation's two forms.

Specification: what draws is selected once, after the file is read, by a pure function of the device's kind,
the request and the file. Auto is a pure function of the device's kind, the precision and the model: the fused runner
(`cuda`) on a CPU in fp32 and on a GPU in bf16/fp16 for 2-D U-Nets, the step kernels on a GPU elsewhere (fp32,
3-D, TorchScript), never torch.compile (its build time is longer than a whole sampling run), and the original
when nothing faster is verified or the extension is not built; the line it prints names the implementation and
the precision; an explicit --implementation always wins. `cuda` draws the original's images to float
tolerance (rtol = atol = 1e-4 in fp32; at most one uint8 level), `cuda_steps` bit for bit. Opening a file for drawing
(sample and evaluate alike): --dataset may not contradict the training data the file records (one check:
check_recorded_dataset); without --sampler the draw is SDE-DPM-Solver++ in 20 steps, a student's with its own
sampler, said in one line (sampling_line).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import (
    ROOT,
    TINY_SCHEDULE,
    TRAJECTORY_TOL,
    assert_user_error,
    perturbed_unet,
    run_here,
    tiny_student,
    tiny_teacher,
    tiny_unet_config,
)

from basic_diffusion import UNet
from ddpm.backends import registry
from ddpm.backends.selection import VERIFIED, check_request, choose, select
from ddpm.util import precision
from noise_schedule import NoiseSchedule
from optimized_diffusion import DeviceKind, runner_verified

CPU = DeviceKind("cpu", extension=True, capability="AVX512")
AVX2_CPU = DeviceKind("cpu", extension=True, capability="AVX2")
BF16_CPU = DeviceKind("cpu", extension=True, capability="AVX512", native_bf16=True)  # Zen 4, Sapphire Rapids
GPU = DeviceKind("cuda", extension=True)


def opened_file(config=None, *, kind: str = "checkpoint", model=None):
    """What select reads of an opened file (backends/artifacts.Artifact): its kind, U-Net and autoencoder."""
    config = config or tiny_unet_config()
    return SimpleNamespace(kind=kind, model=model or UNet(config), model_config=config, first_stage=None)


def sample_request(*flags: str):
    from ddpm.cli import resolve

    return resolve.parse(["--mode", "sample", "--device", "cpu", *flags])[1]


@pytest.fixture
def native_bf16(monkeypatch):
    """Set whether this CPU computes bf16 natively: set(True) or set(False), whatever it is."""

    def set_native(native: bool) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)

    return set_native


def test_auto_is_the_fused_runner_on_a_cpu_in_fp32():
    choice = choose(CPU, precision="fp32", kind="checkpoint", dims=2)
    assert choice.implementation == "cuda" and "fused U-Net runner, Winograd convolutions" in choice.line
    assert runner_verified(device_type="cpu", precision="fp32", dims=2)
    assert choice.line.startswith("implementation: cuda in fp32 (")
    avx2 = choose(AVX2_CPU, precision="fp32", kind="checkpoint", dims=2)
    assert avx2.implementation == "cuda" and "Winograd convolutions blocked for AVX2's 16 registers" in avx2.why
    unmeasured = choose(DeviceKind("cpu", extension=True, capability="DEFAULT"), precision="fp32")
    assert unmeasured.implementation == "original" and "nothing faster is verified" in unmeasured.why


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_auto_on_a_gpu_is_the_fused_runner_in_half_precision_for_2d_unets(precision):
    choice = choose(GPU, precision=precision, kind="checkpoint", dims=2)
    assert choice.implementation == "cuda" and "fused U-Net runner" in choice.why
    assert choice.line.startswith(f"implementation: cuda in {precision} (")
    assert runner_verified(device_type="cuda", precision=precision, dims=2)  # so cuda there runs the runner


@pytest.mark.parametrize(
    ("precision", "kind", "dims"),
    [("fp32", "checkpoint", 2), ("bf16", "checkpoint", 3), ("bf16", "torchscript", 2)],
)
def test_auto_on_a_gpu_is_the_step_kernels_where_the_runner_is_not_verified(precision, kind, dims):
    choice = choose(GPU, precision=precision, kind=kind, dims=dims)
    assert choice.implementation == "cuda" and "fused step kernels" in choice.why
    if kind == "checkpoint":  # a traced U-Net never runs through the runner, which rebuilds a PyTorch U-Net
        assert not runner_verified(device_type="cuda", precision=precision, dims=dims)


def test_auto_on_a_cpu_with_native_bf16_is_the_runner_in_bf16_and_elsewhere_bf16_is_not_the_runner():
    choice = choose(BF16_CPU, precision="bf16", kind="checkpoint", dims=2)
    assert choice.line.startswith("implementation: cuda in bf16 (fused U-Net runner in bf16, Winograd")
    assert choice.faster_than_fp32
    assert runner_verified(device_type="cpu", precision="bf16", dims=2, native_bf16=True)
    for device in (CPU, AVX2_CPU):  # emulated bf16: the step kernels under autocast, slower than fp32
        emulated = choose(device, precision="bf16", kind="checkpoint", dims=2)
        assert "under autocast" in emulated.why and not emulated.faster_than_fp32
        assert not runner_verified(device_type="cpu", precision="bf16", dims=2, native_bf16=False)
    volumes = choose(BF16_CPU, precision="bf16", kind="checkpoint", dims=3)  # the runner is verified for 2-D only
    assert "under autocast" in volumes.why and not volumes.faster_than_fp32


@pytest.mark.parametrize("native", [True, False])
def test_precision_auto_samples_in_bf16_only_on_a_cpu_that_computes_it_and_only_through_the_runner(native_bf16, native):
    from ddpm.cli import resolve

    native_bf16(native)
    cpu = torch.device("cpu")
    device, unet, volume = DeviceKind.of(cpu), opened_file(), opened_file(tiny_unet_config(dims=3))
    expected_28 = "bf16" if native else "fp32"
    assert precision.resolve("auto", purpose="sampling", device=cpu) == ("bf16" if native else "fp32")
    assert precision.resolve("auto", purpose="training", device=cpu, pixels=8 * 8) == "fp32"  # 1.31x: under the bar
    assert precision.resolve("auto", purpose="training", device=cpu, pixels=28 * 28) == expected_28  # 1.58x
    assert precision.resolve("auto", purpose="training", device=cpu) == "fp32"  # a latent or 3-D model
    for dataset, train_expected in (("mnist_5k", "fp32"), ("digits", "fp32"), ("spheres", "fp32")):
        _, request = resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", dataset])
        assert request.precision == train_expected, dataset  # mnist_5k: the digits recipe's latent model
    _, pixels = resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", "mnist_5k", "--model_channels", "32"])
    assert pixels.first_stage is None and pixels.precision == expected_28
    assert precision.resolve("auto", purpose="distillation", device=cpu) == "fp32"  # a student's: not measured
    assert precision.resolve("auto", purpose="export", device=cpu) == "fp32"
    auto = sample_request()
    expected = "bf16" if native else "fp32"
    chosen = select(device, unet, auto)
    assert chosen.line.startswith(f"implementation: cuda in {expected} (fused U-Net runner") and chosen.fused
    assert select(device, volume, auto).precision == "fp32"  # no faster bf16 path for a 3-D U-Net: fp32
    named = sample_request("--precision", "bf16")
    assert select(device, volume, named).line.startswith("implementation: cuda in bf16")  # asked for: as asked
    for name in ("original", "cuda", "onnxruntime"):  # auto's precision is auto's implementation's
        assert select(device, unet, sample_request("--implementation", name)).precision == "fp32"


def test_ddpm_native_bf16_overrides_what_the_cpu_says(monkeypatch):
    for value, native in (("1", True), ("0", False)):
        monkeypatch.setenv("DDPM_NATIVE_BF16", value)
        assert precision.cpu_has_native_bf16() is native


def test_sample_on_a_cpu_with_native_bf16_draws_in_bf16_by_default_what_fp32_draws(tmp_path, monkeypatch):
    """The user's view: on such a CPU `sample` says it runs the runner in bf16 and draws the fp32 images to bf16's
    rounding (on any CPU: without AVX512-BF16 the Winograd GEMMs' plain C++ twin computes the same); --precision
    fp32 keeps the fp32 path."""
    import numpy as np
    from helpers import TINY_TRAIN, run_here

    assert run_here(*TINY_TRAIN, "--model_path", "m.pt", cwd=tmp_path).returncode == 0
    draw = ["--mode", "sample", "--model_path", "m.pt", "--sampler", "ddim", "--sampling_steps", "4"]
    draw += ["--n_samples", "4", "--no_grid"]
    monkeypatch.setenv("DDPM_NATIVE_BF16", "1")
    bf16 = run_here(*draw, "--save_npz", "bf16.npz", cwd=tmp_path)
    fp32 = run_here(*draw, "--save_npz", "fp32.npz", "--precision", "fp32", cwd=tmp_path)
    assert bf16.returncode == 0 and fp32.returncode == 0, bf16.stderr + fp32.stderr
    assert "implementation: cuda in bf16 (fused U-Net runner in bf16, Winograd convolutions" in bf16.stdout
    assert "implementation: cuda in fp32 (fused U-Net runner" in fp32.stdout
    low, high = (np.load(tmp_path / f"{name}.npz")["images"].astype(np.float64) for name in ("bf16", "fp32"))
    assert low.shape == high.shape and np.abs(low - high).max() <= 8  # uint8 levels (which path: the lines above)


def test_auto_never_compiles():
    assert all(not entry.implementation.startswith(("compile", "cuda_compile")) for entry in VERIFIED)


def test_auto_falls_back_to_the_original_where_nothing_faster_is_verified():
    volumes = choose(CPU, precision="fp32", dims=3)
    assert volumes.implementation == "original" and "nothing faster is verified for fp32 3-D" in volumes.why
    unbuilt = choose(DeviceKind("cpu", extension=False), precision="fp32")
    assert unbuilt.implementation == "original" and "extension is not built" in unbuilt.why
    assert choose(CPU, precision="fp32", kind="torchscript").implementation == "original"  # the runner needs a U-Net
    assert choose(CPU, precision="int8").implementation == "onnxruntime"  # the only one that runs int8
    assert choose(CPU, precision="bf16").implementation == "cuda"  # the original runs fp32 only


def test_every_verified_entry_cites_its_benchmark_section_and_names_a_registered_implementation():
    sections, heading = {}, None  # BENCHMARKS.md's headings -> the text under each
    for line in (ROOT / "BENCHMARKS.md").read_text().splitlines():
        if line[:1] == "#":
            heading = line.lstrip("#").strip()
            sections[heading] = ""
        elif heading is not None:
            sections[heading] += line + "\n"
    for entry in VERIFIED:
        assert entry.evidence.startswith("BENCHMARKS.md: '") and entry.implementation in registry.REGISTRY
        heading = entry.evidence.split("'")[1]
        assert heading in sections, entry.evidence  # a section that exists
        assert not re.search(r"\d(\.\d+)?\s*(x|ms|s|%)(\W|$)", entry.why)  # the measurements live in BENCHMARKS.md


def test_an_explicit_implementation_wins_over_auto(native_bf16):
    native_bf16(False)
    device = DeviceKind.of(torch.device("cpu"))
    auto = sample_request()
    assert auto.implementation == "auto"  # chosen once, when the mode has read the file
    chosen = select(device, opened_file(), auto)
    assert chosen.auto and chosen.line.startswith("implementation: cuda in fp32 (")
    for name in ("original", "cuda_steps", "onnxruntime"):
        explicit = sample_request("--implementation", name)
        assert explicit.implementation == name
        named = select(device, opened_file(), explicit)
        assert (named.implementation, named.precision, named.auto, named.fused) == (name, "fp32", False, False)


def test_select_takes_conditional_and_latent_models_and_compiled_cuda_never_runs_the_runner():
    device = DeviceKind("cpu", extension=True, capability="AVX2")
    conditional = opened_file(tiny_unet_config(num_classes=3))
    for name in registry.SAMPLE_IMPLEMENTATIONS:  # every sample-mode implementation runs class-conditional models
        assert select(device, conditional, sample_request("--implementation", name)).implementation == name
    latent = opened_file()
    latent.first_stage = object()  # a latent model: auto picks an implementation with a decoder
    runs = [name for name in registry.SAMPLE_IMPLEMENTATIONS if registry.get(name).decoder is not None]
    assert select(device, latent, sample_request()).implementation in runs
    compiled = select(device, opened_file(), sample_request("--implementation", "cuda", "--compile"))
    assert compiled.compile and not compiled.fused and compiled.name == "cuda_compile"  # compiled, never the runner


def test_auto_refuses_before_reading_a_file_what_no_implementation_runs():
    asked = dict(implementation="auto", precision_auto=False, compile=False)
    check_request(kind="onnx", precision="fp32", **asked)
    with pytest.raises(ValueError, match="no implementation here runs TorchScript files in --precision int8"):
        check_request(kind="torchscript", precision="int8", **asked)
    with pytest.raises(ValueError, match="the cuda implementation cannot run ONNX files"):
        check_request(kind="onnx", precision="bf16", **{**asked, "implementation": "cuda"})
    with pytest.raises(ValueError, match="--compile applies to training and to sampling with --implementation cuda"):
        check_request(kind="checkpoint", precision="fp32", **{**asked, "compile": True})
    with pytest.raises(ValueError, match="--compile compiles a checkpoint's U-Net, not a TorchScript file's"):
        check_request(kind="torchscript", precision="fp32", **{**asked, "implementation": "cuda", "compile": True})


def _draw(name: str, model, plan, *, seed: int = 3) -> torch.Tensor:
    draw = registry.make_drawer(name, model, plan, options=registry.SamplerOptions())
    return draw((2, 1, 16, 16), torch.Generator().manual_seed(seed), False)


def selected_options(model, *flags: str) -> registry.SamplerOptions:
    """The options select gives ``model``'s checkpoint on this CPU for ``flags`` (what sample mode builds with)."""
    chosen = select(DeviceKind.of(torch.device("cpu")), opened_file(model.config, model=model), sample_request(*flags))
    return registry.SamplerOptions(precision=chosen.precision, fused_unet=chosen.fused, compile=chosen.compile)


@pytest.mark.parametrize("sampler", ["ddim", "dpm_solver_sde"])
def test_cuda_draws_the_originals_images_to_float_tolerance_and_cuda_steps_bit_for_bit(sampler):
    model = perturbed_unet(tiny_unet_config())
    plan = NoiseSchedule(TINY_SCHEDULE).make_plan(sampler, sampling_steps=6)
    original, steps = _draw("original", model, plan), _draw("cuda_steps", model, plan)
    options = selected_options(model, "--implementation", "cuda", "--precision", "fp32")
    fused = registry.make_drawer("cuda", model, plan, options=options)
    runner = registry.get("cuda").build(model, plan, shape=(2, 1, 16, 16), options=options)
    assert runner.unet_runner is not None  # cuda on a CPU in fp32 is the runner
    cuda = fused((2, 1, 16, 16), torch.Generator().manual_seed(3), False)
    assert torch.equal(steps, original)
    torch.testing.assert_close(cuda, original, rtol=TRAJECTORY_TOL, atol=TRAJECTORY_TOL)
    assert not torch.equal(cuda, original)  # a different computation, not the same one twice


@pytest.mark.parametrize("native", [True, False])
def test_cuda_is_the_step_kernels_where_the_runner_is_not_verified(native_bf16, native):
    native_bf16(native)
    model = perturbed_unet(tiny_unet_config())
    plan = NoiseSchedule(TINY_SCHEDULE).make_plan("ddim", sampling_steps=2)
    options = selected_options(model, "--implementation", "cuda", "--precision", "bf16")
    bf16 = registry.get("cuda").build(model, plan, shape=(2, 1, 16, 16), options=options)
    assert (bf16.unet_runner is not None) == native  # bf16 through the runner only where the CPU computes it
    steps = registry.get("cuda_steps").build(model, plan, shape=(2, 1, 16, 16), options=registry.SamplerOptions())
    assert steps.unet_runner is None


@pytest.mark.parametrize("capability,winograd", [("AVX512", True), ("AVX2", True), ("DEFAULT", False)])
def test_the_runner_uses_winograd_convolutions_only_on_cpus_where_they_are_faster(monkeypatch, capability, winograd):
    import optimized_diffusion as od

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert od.winograd_is_fast() == winograd
    runner = od.FusedUNet(perturbed_unet(tiny_unet_config()))
    assert bool(runner.winograd) == winograd and bool(runner.winograd_upsample) == winograd


@pytest.mark.parametrize("hardware", [True, False])
def test_bf16_forced_on_a_cpu_that_emulates_it_is_said_so_not_claimed_as_its_dot_products(monkeypatch, hardware):
    from ddpm.util.precision import FORCED_BF16

    monkeypatch.setenv("DDPM_NATIVE_BF16", "1")
    monkeypatch.setattr(precision, "_hardware_bf16", lambda: hardware)
    device = DeviceKind.of(torch.device("cpu"))
    assert device.native_bf16 and device.bf16_forced is not hardware
    line = choose(replace(device, extension=True), precision="bf16", kind="checkpoint", dims=2).line
    assert line.startswith("implementation: cuda in bf16 (fused U-Net runner in bf16, Winograd convolutions")
    if hardware:
        assert "the CPU's bf16 dot products" in line and FORCED_BF16 not in line
    else:
        assert FORCED_BF16 in line and "dot products" not in line


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    return tiny_teacher(tmp_path_factory.mktemp("drawing"), "digits.pt")


@pytest.mark.parametrize("mode", ["sample", "evaluate"])
def test_a_dataset_that_contradicts_the_model_file_is_refused_before_drawing(digits_model, tmp_path, mode):
    result = run_here(
        "--device", "cpu", "--mode", mode, "--model_path", str(digits_model), "--dataset", "mnist",
        "--n_samples", "2", cwd=tmp_path,
    )  # fmt: skip
    assert_user_error(result, f"--dataset mnist contradicts {digits_model}, which was trained on digits")
    assert list(tmp_path.iterdir()) == []  # no grid, no report


def test_the_dataset_the_model_records_is_accepted_by_sample(digits_model, tmp_path):
    result = run_here(
        "--device", "cpu", "--mode", "sample", "--model_path", str(digits_model), "--dataset", "digits",
        "--n_samples", "2", "--sampler", "ddim", "--sampling_steps", "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "samples.png").is_file()


# ----- issue 59: few calls by default -----------------------------------------------------------------------------
def draw(model, folder, name: str, *flags: str):
    """``--mode sample`` of ``model`` (seed 0, 2 images): its stdout and its images (uint8)."""
    result = run_here(
        "--device", "cpu", "--mode", "sample", "--model_path", str(model), "--n_samples", "2", "--seed", "0",
        "--no_grid", "--save_npz", f"{name}.npz", *flags, cwd=folder,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout, np.load(folder / f"{name}.npz")["images"]


def test_sample_without_a_sampler_draws_sde_dpm_solver_in_20_steps_and_says_so(digits_model, tmp_path):
    out, default = draw(digits_model, tmp_path, "default")
    # The tiny model has T = 50: DDPM would take 50 calls, the default 20.
    assert "sampling: dpm_solver_sde, 20 steps (default; --sampler ddpm for the 50-step DDPM)" in out.splitlines()
    assert "(2 samples, dpm_solver_sde, 20 steps)" in out
    _, named = draw(digits_model, tmp_path, "named", "--sampler", "dpm_solver_sde", "--sampling_steps", "20")
    assert np.array_equal(default, named)  # the same plan and noise: the same bytes
    out, ddpm = draw(digits_model, tmp_path, "ddpm", "--sampler", "ddpm")  # as named: DDPM in all T steps
    assert "sampling: ddpm, 50 steps" in out.splitlines() and "(2 samples, ddpm, 50 steps)" in out
    assert not np.array_equal(default, ddpm)


def test_sampling_steps_without_a_sampler_are_the_default_samplers(digits_model, tmp_path):
    out, stepped = draw(digits_model, tmp_path, "stepped", "--sampling_steps", "5")
    assert "sampling: dpm_solver_sde, 5 steps (the default sampler; --sampler ddpm for DDPM)" in out.splitlines()
    _, named = draw(digits_model, tmp_path, "named", "--sampler", "dpm_solver_sde", "--sampling_steps", "5")
    assert np.array_equal(stepped, named)


def test_evaluate_without_a_sampler_has_one_row_sde_dpm_solver_in_20_steps(digits_model, tmp_path):
    result = run_here(
        "--device", "cpu", "--mode", "evaluate", "--model_path", str(digits_model), "--n_samples", "2",
        "--json", "e.json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "sampling: dpm_solver_sde, 20 steps (default; --sampler ddpm for the 50-step DDPM)" in result.stdout
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [(row["sampler"], row["steps"], row["calls"]) for row in rows] == [("dpm_solver_sde", 20, 20)]


def test_the_requests_leave_the_sampler_to_the_model_and_benchmark_keeps_ddpm():
    from ddpm.cli import resolve
    from ddpm.requests import own_sampling
    from noise_schedule import NoiseSchedule, ScheduleConfig

    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=50))
    _, evaluate = resolve.parse(["--device", "cpu", "--mode", "evaluate", "--sampling_steps", "3,5"])
    assert (evaluate.samplers, evaluate.sampling_steps) == ([None], [3, 5])  # None: the model's own, or the default
    assert own_sampling(schedule.config, sampler=None, sampling_steps=5) == ("dpm_solver_sde", None)
    _, sample = resolve.parse(["--device", "cpu", "--mode", "sample"])
    plan = sample.sampling.plan(schedule, device="cpu")
    assert (sample.sampling.sampler, plan.sampler, plan.num_steps) == (None, "dpm_solver_sde", 20)
    _, run = resolve.parse(["--device", "cpu", "--mode", "benchmark", "--img_size", "16", "--channels", "1"])
    plan = run.sampling.plan(schedule, device="cpu")
    assert (plan.sampler, plan.num_steps) == ("ddpm", 50)  # benchmark times DDPM (its quick plan may respace it)


def test_a_student_without_a_sampler_still_draws_with_its_own(digits_model, tmp_path):
    student = tiny_student(tmp_path, digits_model, "student.pt", "--sampling_steps", "2")
    out, _ = draw(student, tmp_path, "student")
    assert "sampling: consistency, 2 steps (the student's own)" in out.splitlines()
    result = run_here(
        "--device", "cpu", "--mode", "evaluate", "--model_path", str(student), "--n_samples", "2",
        "--json", "e.json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "sampling: consistency, 2 steps (the student's own)" in result.stdout
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [(row["sampler"], row["steps"]) for row in rows] == [("consistency", 2)]
