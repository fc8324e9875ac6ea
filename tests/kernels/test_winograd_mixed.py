"""The Winograd kernels' mixed path (diffusion_winograd.cpp): a bf16 step's 3x3 convolutions with bfloat16 activations
read and written, the transforms, GEMMs and sums in float32 on the float32 weights. Its forward, weight gradient and
backward give the float32 kernels' bits on the widened inputs (the outputs rounded once to bfloat16), a bf16
convolution's error against float64, opcheck, refusals with the reason, and the trainer taking it for a bf16 step
exactly where training/winograd.mixed_is_fast says so."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import conv3x3_case, make_trainer
from torch import nn

from ddpm.kernels import ops
from ddpm.training import winograd


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    ops.load_extension()
    if not ops.winograd_mixed_available():
        pytest.skip("the built extension predates the mixed path: rebuild it (make install)")


def bf16_case(shape: tuple[int, int, int, int, int]) -> tuple:
    """(x, weight, bias, grad) of conv3x3_case with x and grad rounded to channels-last bfloat16, the rest float32."""
    x, w, b, grad = conv3x3_case(shape)
    cl = torch.channels_last
    return x.bfloat16().contiguous(memory_format=cl), w.float(), b.float(), grad.bfloat16().contiguous(memory_format=cl)


# (B, Cin, Cout, H, W): odd sides (edge tiles of both sizes), a map one row high, more output channels than input.
SHAPES = [(3, 16, 32, 7, 9), (2, 32, 16, 12, 12), (2, 16, 16, 1, 5), (1, 48, 16, 6, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tile", [2, 4])
def test_the_mixed_path_gives_the_float32_kernels_bits_on_the_widened_inputs(shape, tile):
    """What a bf16 step computes is the fp32 step's arithmetic on the same values: the forward's output and the
    input's gradient rounded once to bf16, the weight's and the bias's gradients the same float32 bits."""
    x, w, b, grad = bf16_case(shape)
    x32, grad32 = x.float(), grad.float()
    kernel = ops.winograd_kernel(w, tile=tile)
    mixed = ops.conv3x3_winograd(x, kernel, b)
    assert mixed.dtype == torch.bfloat16 and mixed.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(mixed, ops.conv3x3_winograd(x32, kernel, b).bfloat16())
    dU = ops.conv3x3_winograd_weight_grad(x, grad, tile=tile)
    assert dU.dtype == torch.float32 and torch.equal(dU, ops.conv3x3_winograd_weight_grad(x32, grad32, tile=tile))
    wanted = (True, True, True)
    mine = ops.conv3x3_winograd_backward(grad, x, w, tile=tile, wanted=wanted)
    theirs = ops.conv3x3_winograd_backward(grad32, x32, w, tile=tile, wanted=wanted)
    assert [g.dtype for g in mine] == [torch.bfloat16, torch.float32, torch.float32]
    for name, m, t in zip(("dx", "dw", "db"), mine, theirs):
        assert torch.equal(m, t.to(m.dtype)), name


def test_the_mixed_upsampling_convolution_gives_the_float32_kernels_bits():
    x, w, b, _ = bf16_case((2, 16, 32, 5, 6))
    kernel = ops.winograd_weight(w, upsample=True)
    mixed = ops.conv3x3_winograd(x, kernel, b, upsample=True)
    assert torch.equal(mixed, ops.conv3x3_winograd(x.float(), kernel, b, upsample=True).bfloat16())


@pytest.mark.parametrize("tile", [2, 4])
def test_the_mixed_path_is_a_bf16_convolution_against_float64(tile):
    """Against float64 autograd on the same bf16 values: the output within one bf16 rounding, the kernel's and the
    bias's gradients (float32 sums) within float32's Winograd error."""
    x, w, b, grad = bf16_case((2, 32, 16, 10, 11))
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    reference = F.conv2d(*leaves, padding=1)
    reference.backward(grad.double())
    out = ops.conv3x3_winograd(x, ops.winograd_kernel(w, tile=tile), b)
    dx, dw, db = ops.conv3x3_winograd_backward(grad, x, w, tile=tile, wanted=(True, True, True))
    for mine, exact in ((out, reference.detach()), (dx, leaves[0].grad)):
        torch.testing.assert_close(mine.double(), exact, rtol=2**-8, atol=1e-3 * exact.abs().max().item())
    for mine, exact in ((dw, leaves[1].grad), (db, leaves[2].grad)):
        torch.testing.assert_close(mine.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())


def test_the_mixed_ops_pass_opcheck():
    x, w, b, grad = bf16_case((2, 16, 16, 6, 5))
    for tile in (2, 4):
        kernel = ops.winograd_kernel(w, tile=tile)
        torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd, (x, kernel, b))
        torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd_weight_grad, (x, grad), {"tile": tile})
        for mask in ([True, True, True], [True, False, False]):
            torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd_backward, (grad, x, w, tile, mask))


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda x, w: ops.conv3x3_winograd(x, ops.winograd_kernel(w, tile=2).double()),
            "or its float32 (16, Cin=16, Cout) one (the mixed path), got Double",
        ),
        (
            lambda x, w: ops.conv3x3_winograd_weight_grad(x, x.float(), tile=2),
            "grad_out must be a channels-last (B, Cout, H, W) tensor of x's dtype BFloat16",
        ),
        (
            lambda x, w: ops.conv3x3_winograd_backward(x, x.float(), w, tile=2, wanted=(True, True, True)),
            "grad_out must be a channels-last float32 or bfloat16 (B, Cout=16, H, W) tensor of x's dtype Float",
        ),
    ],
    ids=["float64 transform", "weight gradient of mixed dtypes", "backward of mixed dtypes"],
)
def test_the_mixed_path_refuses_what_it_cannot_compute(call, message):
    x, w, _, _ = bf16_case((2, 16, 16, 4, 4))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        call(x, w)


def test_a_winograd_module_trains_bf16_activations_by_the_mixed_path():
    """Under CPU autocast a WinogradConv2d takes the bf16 activations itself: a bf16 output, float32 gradients for
    the float32 parameters, all as the mixed ops give them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1))
    assert winograd.use_winograd_convs(model) == 1 and isinstance(model[0], winograd.WinogradConv2d)
    x = torch.randn(2, 16, 9, 7).bfloat16().contiguous(memory_format=torch.channels_last).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    grad = torch.randn_like(y)
    y.backward(grad)
    tile = ops.winograd_tile(7)
    expected = ops.conv3x3_winograd_backward(
        grad.contiguous(memory_format=torch.channels_last),
        x.detach(),
        model[0].weight.detach(),
        tile=tile,
        wanted=(True, True, True),
    )
    for mine, theirs in zip((x.grad, model[0].weight.grad, model[0].bias.grad), expected):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


@pytest.mark.parametrize(
    "capability, native, forced, amx, expected",
    [
        ("AVX512", True, False, False, True),  # AVX512-BF16 without AMX (AMD Zen 4 and 5)
        ("AVX512", True, False, True, False),  # AMX: oneDNN's bf16 runs on its tiles
        ("AVX512", True, True, False, False),  # bf16 claimed by DDPM_NATIVE_BF16=1 on a CPU that emulates it
        ("AVX2", True, False, False, False),
        ("DEFAULT", True, False, False, False),
    ],
)
def test_a_bf16_step_takes_the_mixed_path_where_this_cpu_gains(
    tmp_path, monkeypatch, capability, native, forced, amx, expected
):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(winograd, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(winograd, "bf16_forced", lambda: forced)
    monkeypatch.setattr(winograd, "cpu_has_amx", lambda: amx)
    assert winograd.mixed_is_fast() == expected
    trainer = make_trainer(tmp_path, precision="bf16")
    kinds = {type(m) for m in trainer.model.modules()}
    assert (winograd.WinogradConv2d in kinds) == expected
    assert not kinds & {winograd.GemmConv1x1, winograd.ThinConv2d}  # float32's kernels: not in a bf16 step
    assert ("Winograd 3x3 convolutions in fp32 on bf16 activations" in trainer.step_layout) == expected
    if expected:
        loss = trainer.train_step()
        assert torch.isfinite(torch.as_tensor(loss))
