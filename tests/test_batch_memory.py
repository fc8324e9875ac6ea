"""batch_memory.py: the meta-device estimate of a U-Net step against torch.profiler's allocator accounting, its
scaling in the batch, the quick upper bound and the refusal message."""

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from basic_diffusion import UNet, UNetConfig, diffusion_loss, unet_preset
from ddpm import batch_memory
from ddpm.batch_memory import check_batch_fits, estimate_peak_bytes, upper_bound_bytes
from ddpm.util import memory
from noise_schedule import NoiseSchedule, ScheduleConfig

GiB = 1 << 30

TINY = UNetConfig(
    image_size=16,
    in_channels=1,
    model_channels=16,
    channel_mult=(1, 2),
    num_res_blocks=1,
    attention_resolutions=(8,),
    num_heads=2,
    dropout=0.1,
)

DEMO = unet_preset("small", image_size=16, in_channels=1, model_channels=32)  # the digits at 16x16


def profiled_peak(fn) -> int:
    """The most bytes the CPU allocator held at once while ``fn`` ran, above what was live before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Allocations are charged to the op that made them (self), frees outside ops are "[memory]" events.
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())


def real_sampling_peak(config: UNetConfig, batch: int) -> int:
    """Weights plus the allocator's peak over one forward under no_grad (inputs made inside)."""
    torch.manual_seed(0)
    model = UNet(config).eval()

    def forward():
        x = torch.randn(batch, config.in_channels, config.image_size, config.image_size)  # (B, C, H, W)
        with torch.no_grad():
            model(x, torch.full((batch,), 10))

    forward()  # warm-up: one-time allocations of the CPU kernels
    return weight_bytes(model) + profiled_peak(forward)


def real_training_peak(config: UNetConfig, batch: int) -> int:
    """Weights, EMA, AdamW state and the allocator's peak over one step as training.Trainer takes it."""
    torch.manual_seed(0)
    model = UNet(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100))
    x_start = torch.rand(batch, config.in_channels, config.image_size, config.image_size) * 2 - 1

    def step():
        loss = diffusion_loss(model, schedule, x_start)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()  # AdamW's moments exist from the first step on; the gradients stay until the next backward
    ema = weight_bytes(model)  # the Trainer's EMA copy, not allocated here
    live = weight_bytes(model) + ema + sum(v.nbytes for s in optimizer.state.values() for v in s.values())
    live += sum(p.grad.nbytes for p in model.parameters()) + x_start.nbytes
    return live + profiled_peak(step)


def test_sampling_estimate_matches_the_allocators_peak():
    for batch in (1, 8):
        estimate = estimate_peak_bytes(TINY, batch_size=batch, training=False)
        real = real_sampling_peak(TINY, batch)
        assert 0.9 < estimate / real < 1.15, (batch, estimate, real)


def test_training_estimate_matches_the_allocators_peak():
    for batch in (1, 8):
        estimate = estimate_peak_bytes(TINY, batch_size=batch, training=True)
        real = real_training_peak(TINY, batch)
        assert 0.85 < estimate / real < 1.2, (batch, estimate, real)


def test_estimate_grows_linearly_with_the_batch_and_not_in_the_weights():
    e1, e2, e8 = (estimate_peak_bytes(DEMO, batch_size=b, training=False) for b in (1, 2, 8))
    per_sample = e2 - e1
    assert per_sample > 0
    assert e8 - e1 == pytest.approx(7 * per_sample, rel=0.02)
    # What a batch of 1 needs beyond one sample's activations is the weights (and a little more).
    weights = weight_bytes(UNet(DEMO))
    assert weights <= e1 - per_sample < 1.2 * weights
    # The per-sample growth is what the CPU allocator really adds per sample.
    real_growth = real_sampling_peak(DEMO, 8) - real_sampling_peak(DEMO, 1)
    assert (e8 - e1) / real_growth == pytest.approx(1.0, abs=0.1)


def test_one_trace_at_a_prime_batch_predicts_a_direct_trace_at_another(monkeypatch):
    # The estimate traces the step once, at a prime batch, and extrapolates; tracing right at the
    # batch asked for (6: it divides the up path's 96 channels, so only the totals are meaningful) agrees.
    predicted = {training: estimate_peak_bytes(DEMO, batch_size=6, training=training) for training in (False, True)}
    batch_memory._peak_lines.cache_clear()
    monkeypatch.setattr(batch_memory, "_trace_batch", lambda model: 6)
    try:
        for training in (False, True):
            assert estimate_peak_bytes(DEMO, batch_size=6, training=training) == predicted[training]
    finally:
        batch_memory._peak_lines.cache_clear()


def test_training_needs_more_than_sampling_and_bf16_about_half_of_fp32():
    for batch in (1, 16):
        sampling = estimate_peak_bytes(DEMO, batch_size=batch, training=False)
        training = estimate_peak_bytes(DEMO, batch_size=batch, training=True)
        assert training > 2 * sampling
    fp32 = estimate_peak_bytes(DEMO, batch_size=64, training=True)
    bf16 = estimate_peak_bytes(DEMO, batch_size=64, training=True, dtype=torch.bfloat16)
    assert 0.45 < bf16 / fp32 < 0.6


def test_estimate_of_a_1024_pixel_step_costs_no_memory_and_is_huge():
    config = unet_preset("small", image_size=1024, in_channels=3)
    # 64 channels at 1024x1024 are 256 MiB per feature map and sample: tens of GiB a sample in training.
    assert estimate_peak_bytes(config, batch_size=1, training=True) > 10 * GiB
    assert estimate_peak_bytes(config, batch_size=1, training=False) > 1 * GiB


def test_check_batch_fits_refuses_with_the_largest_batch_that_fits(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 * GiB)
    config = unet_preset("small", image_size=256, in_channels=3)
    with pytest.raises(ValueError) as info:
        check_batch_fits(config, batch_size=64, device=torch.device("cpu"), training=True)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("one training batch of 64 at 3x256x256 needs about ")
    assert "8.0 GiB is available on cpu" in message
    largest = int(message.rsplit("the largest --batch_size that fits is ", 1)[1])
    budget = memory.SAFETY_FRACTION * 8 * GiB / batch_memory.ALLOCATOR_OVERHEAD
    assert estimate_peak_bytes(config, batch_size=largest, training=True) <= budget
    assert estimate_peak_bytes(config, batch_size=largest + 1, training=True) > budget
    check_batch_fits(config, batch_size=largest, device=torch.device("cpu"), training=True)  # accepted


def test_check_batch_fits_refuses_a_1024_pixel_training_batch_outright(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 * GiB)
    config = unet_preset("small", image_size=1024, in_channels=3)
    with pytest.raises(
        ValueError,
        match=r"^one training batch of 64 at 3x1024x1024 needs about .* TiB .*"
        r"not even a batch of 1 fits: use a smaller --img_size or model$",
    ):
        check_batch_fits(config, batch_size=64, device=torch.device("cpu"), training=True)


def test_check_batch_fits_names_the_flag_and_counts_extra_bytes(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 * GiB)
    check_batch_fits(DEMO, batch_size=64, device=torch.device("cpu"), training=False)
    with pytest.raises(ValueError, match=r"^one sampling batch of 64 .* the largest --n_samples that fits is \d+$"):
        check_batch_fits(
            DEMO,
            batch_size=64,
            device=torch.device("cpu"),
            training=False,
            flag="--n_samples",
            extra_bytes=int(0.89 * GiB),
        )


def test_check_batch_fits_refuses_an_empty_batch_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--n_samples must be at least 1, got 0$"):
        check_batch_fits(DEMO, batch_size=0, device=torch.device("cpu"), training=False, flag="--n_samples")


def test_legitimate_runs_fit_a_24_gib_machine(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 20 * GiB)  # what 24 GiB leaves
    cpu = torch.device("cpu")
    check_batch_fits(DEMO, batch_size=64, device=cpu, training=True)
    demo = unet_preset("small", image_size=8, in_channels=1, model_channels=32, num_res_blocks=1)
    check_batch_fits(demo, batch_size=128, device=cpu, training=True)  # make demo
    check_batch_fits(DEMO, batch_size=64, device=cpu, training=False)
    check_batch_fits(unet_preset("small", image_size=28, in_channels=1), batch_size=64, device=cpu, training=True)
    check_batch_fits(
        unet_preset("ddpm_cifar10", image_size=32, in_channels=3), batch_size=128, device=cpu, training=False
    )


@pytest.mark.parametrize(
    "preset,size,channels,overrides",
    [
        ("small", 16, 1, dict(model_channels=16, num_res_blocks=1)),  # the tests' and the demo's shape
        ("small", 28, 1, {}),
        ("small", 64, 3, dict(num_res_blocks=3)),
        ("ddpm_cifar10", 32, 3, {}),
        ("small", 32, 3, dict(model_channels=32, attention_resolutions=(32, 16, 8))),  # attention at full size
    ],
)
@pytest.mark.parametrize("training", [False, True])
def test_the_quick_upper_bound_stays_above_the_traced_estimate(preset, size, channels, overrides, training):
    overrides = dict(overrides)
    attention = overrides.pop("attention_resolutions", None)
    config = unet_preset(preset, image_size=size, in_channels=channels, **overrides)
    if attention is not None:
        config = dataclasses.replace(config, attention_resolutions=attention)
    for batch in (1, 7):
        estimate = estimate_peak_bytes(config, batch_size=batch, training=training)
        bound = upper_bound_bytes(config, batch_size=batch, training=training)
        print(f"{preset} {size} {training} batch {batch}: bound / estimate = {bound / estimate:.1f}")
        assert estimate <= bound < 40 * estimate  # a bound, yet not so loose that it never skips the trace
