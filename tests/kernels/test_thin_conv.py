"""The thin 3x3 convolutions (diffusion_thin_conv.cpp, ddpm.kernels.ops.conv3x3_thin): the U-Net's first and last
convolutions, a few channels on one side. Output and all three gradients against float64 autograd at least as close
as oneDNN's float32, the weight gradient the same bits on one thread and two, opcheck, refusals with the reason, which
modules they take, and the trainer and the sampling runner taking them where this CPU computes them faster."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import conv3x3_case, make_trainer, outputs_and_grads
from torch import nn

import optimized_diffusion as od
from basic_diffusion import UNet, UNetConfig
from ddpm.kernels import ops
from ddpm.training.winograd import ThinConv2d, use_thin_convs


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    ops.load_extension()
    if not ops.has_op("conv3x3_thin_backward"):
        pytest.skip("the built extension predates conv3x3_thin: rebuild it (make install)")


def channels_last(*shape) -> torch.Tensor:
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


# (batch, Cin, Cout, H, W): one image channel in and out (pixels), four (latents), three (RGB); a wide side of 24 and
# 40 (a last block of 8 channels); rows of 1-3 pixels (no interior block) and of 13 (blocks of 4, then single pixels).
SHAPES = [
    (3, 1, 32, 8, 9),
    (2, 32, 1, 5, 13),
    (2, 4, 32, 8, 8),
    (2, 32, 4, 1, 3),
    (1, 3, 24, 2, 2),
    (2, 40, 3, 7, 13),
    (2, 2, 40, 6, 1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [True, False])
def test_output_and_gradients_match_float64_as_closely_as_onednn(shape, with_bias):
    x, w, b, grad = conv3x3_case(shape, bias=with_bias)

    def conv2d(*a):
        return F.conv2d(*a, padding=1)

    reference = outputs_and_grads(conv2d, torch.float64, (x, w, b), grad)
    onednn = outputs_and_grads(conv2d, torch.float32, (x, w, b), grad)
    x32, g32 = (t.float().contiguous(memory_format=torch.channels_last) for t in (x, grad))
    y = ops.conv3x3_thin(x32, w.float(), None if b is None else b.float())
    assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.float32
    ours = [y, *ops.conv3x3_thin_backward(g32, x32, w.float(), wanted=(True, True, b is not None))]
    for name, mine, theirs, exact in zip(("y", "dx", "dw", "db"), ours, onednn, reference):
        if exact is None:
            assert mine is None, name
            continue
        assert mine.shape == exact.shape, name
        assert relative_error(mine, exact) <= 3 * relative_error(theirs, exact) + 1e-6, name


def test_the_weight_gradient_is_the_same_bits_on_one_thread_and_two():
    """Its rows go in fixed chunks whatever the threads, so a run's checkpoints do not depend on them."""
    x, grad, weight = channels_last(5, 32, 9, 11), channels_last(5, 1, 9, 11), torch.randn(1, 32, 3, 3)
    before, grads = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            grads.append(ops.conv3x3_thin_backward(grad, x, weight, wanted=(True, True, True)))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*grads):
        assert torch.equal(one, two)


def test_the_thin_ops_pass_opcheck():
    x, weight, bias = channels_last(2, 16, 6, 5), torch.randn(2, 16, 3, 3), torch.randn(2)
    for b in (bias, None):
        torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_thin, (x, weight, b))
    grad = channels_last(2, 2, 6, 5)
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_thin_backward, (grad, x, weight, mask))
    wide = torch.randn(16, 2, 3, 3)  # few input channels
    torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_thin, (channels_last(2, 2, 5, 4), wide, None))


@pytest.mark.parametrize(
    "x, weight, message",
    [
        (channels_last(2, 16, 4, 4), torch.randn(5, 16, 3, 3), "one channel count must be 1 to 4"),
        (
            channels_last(2, 12, 4, 4),
            torch.randn(1, 12, 3, 3),
            "the other a positive multiple of 8, got Cout=1, Cin=12",
        ),
        (torch.randn(2, 16, 4, 4), torch.randn(1, 16, 3, 3), "x must be a channels-last float32 (B, 16, H, W)"),
        (channels_last(2, 8, 4, 4), torch.randn(1, 16, 3, 3), "x must be a channels-last float32 (B, 16, H, W)"),
        (channels_last(2, 16, 4, 4), torch.randn(1, 16, 1, 1), "weight must be a contiguous float32 (Cout, Cin, 3, 3)"),
    ],
)
def test_the_thin_op_refuses_what_it_cannot_compute(x, weight, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.conv3x3_thin(x, weight)


@pytest.mark.parametrize(
    "conv, applies",
    [
        (nn.Conv2d(1, 32, 3, padding=1), True),
        (nn.Conv2d(64, 4, 3, padding=1), True),
        (nn.Conv2d(8, 64, 3, padding=1), False),  # as fast on oneDNN
        (nn.Conv2d(32, 1, 3, padding=1, stride=2), False),
        (nn.Conv2d(32, 1, 3, padding=1, padding_mode="reflect"), False),
        (nn.Conv2d(12, 1, 3, padding=1), False),
        (nn.Conv2d(32, 1, 1), False),
        (nn.Conv3d(32, 1, 3, padding=1), False),
    ],
)
def test_thin_convolutions_are_the_3x3_ones_with_a_few_channels_on_one_side(conv, applies):
    assert ops.thin_applies(conv) == applies


@pytest.mark.parametrize("capability, direct", [("AVX2", True), ("AVX512", True), ("DEFAULT", False)])
def test_the_trainer_takes_the_first_and_last_convolutions_direct_where_this_cpu_gains(
    tmp_path, monkeypatch, capability, direct
):
    from ddpm.training import winograd

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(winograd, "faster_from", lambda: 1)  # Winograd's 3x3 convolutions on every CPU here
    trainer = make_trainer(tmp_path)
    thin = [m for m in trainer.model.modules() if isinstance(m, ThinConv2d)]
    assert {id(m) for m in thin} == ({id(trainer.model.conv_in), id(trainer.model.conv_out)} if direct else set())
    assert ("the first and last convolutions direct" in trainer.step_layout) == direct  # the run's line
    assert not any(isinstance(m, ThinConv2d) for m in trainer.ema.modules())  # exports and previews: plain


def test_a_swapped_thin_convolution_keeps_its_parameters_and_trains_to_onednns_gradients(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.SiLU(), nn.Conv2d(32, 1, 3, padding=1))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    before = list(model.parameters())
    assert use_thin_convs(model) == 2 and list(model.parameters()) == before  # the optimizer's and the EMA's
    x = torch.randn(3, 1, 10, 7)
    model(x).square().sum().backward()
    w1, b1, w2, b2 = reference
    F.conv2d(F.silu(F.conv2d(x, w1, b1, padding=1)), w2, b2, padding=1).square().sum().backward()
    for mine, theirs in zip(model.parameters(), reference):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's convolutions stay nn.Conv2d's
        assert model(x).dtype == torch.bfloat16


@pytest.mark.parametrize("capability, direct", [("AVX2", True), ("AVX512", True), ("DEFAULT", False)])
def test_the_sampling_runner_takes_the_thin_convolutions_where_training_does(monkeypatch, capability, direct):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    config = UNetConfig(image_size=8, in_channels=4, model_channels=32, channel_mult=(1, 2), num_res_blocks=1)
    torch.manual_seed(0)
    model = UNet(config).eval()
    nn.init.normal_(model.conv_out.weight, std=0.05)  # zero at initialization
    runner = od.FusedUNet(model)
    assert set(runner.thin) == ({model.conv_in, model.conv_out} if direct else set())
    x, t = torch.randn(3, 4, 8, 8), torch.tensor([5, 300, 999])
    with torch.no_grad():
        torch.testing.assert_close(runner(x, t), model(x, t), rtol=1e-4, atol=1e-4)
