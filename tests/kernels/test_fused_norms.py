"""Training through the extension's norm (kernels/ops.fused_norm_act): group_norm_act's gradients, by its backward
op, against float64 autograd of PyTorch's GroupNorm, scale-shift and SiLU; the backward op under opcheck and with
wrong arguments; the blocks' norms swapped keeping the state dict and the function; and the CPU trainer taking the
same steps with them as with PyTorch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_trainer, tiny_unet_config

import basic_diffusion
from basic_diffusion import UNet
from ddpm.kernels import ops
from ddpm.kernels.ops import SeededDropout, fused_norm_act, norm_training_available, use_fused_norms


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    ops.load_extension()
    if not norm_training_available():
        pytest.skip("the built extension predates group_norm_act_backward: rebuild it (make install)")


def reference(x, weight, bias, scale, shift, *, groups, silu):
    h = F.group_norm(x, groups, weight, bias, 1e-5)
    if scale is not None:
        h = h * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
    return F.silu(h) if silu else h


def relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    return ((value.double() - expected).norm() / expected.norm()).item()


# (batch, channels, height, width, groups): the U-Net's widths, odd sizes, one channel a group, one position.
SHAPES = [(3, 32, 7, 7, 8), (2, 64, 4, 4, 8), (4, 16, 5, 3, 16), (2, 24, 1, 1, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("modulate", "silu"), [(True, True), (False, True), (False, False)])
def test_gradients_match_float64_autograd(shape, dtype, modulate, silu):
    torch.manual_seed(0)
    B, C, H, W, groups = shape
    x = (torch.randn(B, C, H, W) * 2 + 0.5).to(dtype).contiguous(memory_format=torch.channels_last)
    weight, bias, table = torch.randn(C), torch.randn(C), torch.randn(B, 2 * C)
    scale, shift = (table[:, :C], table[:, C:]) if modulate else (None, None)
    grad = torch.randn(B, C, H, W).to(dtype).contiguous(memory_format=torch.channels_last)
    inputs = [x, weight, bias] + ([table] if modulate else [])
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    s, h = (leaves[3][:, :C], leaves[3][:, C:]) if modulate else (None, None)
    out = ops.group_norm_act_trainable(leaves[0], leaves[1], leaves[2], groups=groups, scale=s, shift=h, silu=silu)
    got = torch.autograd.grad(out, leaves, grad)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    s, h = (wide[3][:, :C], wide[3][:, C:]) if modulate else (None, None)
    expected = torch.autograd.grad(
        reference(wide[0], wide[1], wide[2], s, h, groups=groups, silu=silu), wide, grad.double()
    )
    assert got[0].dtype == dtype and got[0].is_contiguous(memory_format=torch.channels_last)
    # float32: a float32 computation's rounding; bf16: x's gradient is rounded to bf16 once, the parameters'
    # gradients (float32, summed in float32 from bf16 inputs) as in float32.
    tolerances = [2e-6 if dtype == torch.float32 else 4e-3] + [2e-6] * (len(inputs) - 1)
    for name, value, want, tolerance in zip(("x", "weight", "bias", "scale-shift"), got, expected, tolerances):
        assert relative_error(value, want) < tolerance, name


@pytest.mark.parametrize("offset", [0.0, 30.0, -300.0])
def test_gradients_stay_close_to_float64_when_a_group_sits_far_from_zero(offset):
    # The backward op recomputes each group's statistics in one pass: its shifted sums keep a large mean from eating
    # the variance's digits, as a plain sum of squares would (PyTorch's own float32 backward is 1e-2 off at -300).
    torch.manual_seed(1)
    x = (torch.randn(2, 32, 6, 6) + offset).contiguous(memory_format=torch.channels_last)
    weight, bias, grad = torch.randn(32), torch.randn(32), torch.randn(2, 32, 6, 6)
    grad = grad.contiguous(memory_format=torch.channels_last)

    def gradients(norm, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (x.clone(), weight.clone(), bias.clone())]
        return torch.autograd.grad(norm(*leaves), leaves, grad.to(dtype))

    ours = gradients(lambda *a: ops.group_norm_act_trainable(*a, groups=8), torch.float32)
    exact = gradients(lambda *a: reference(*a, None, None, groups=8, silu=True), torch.float64)
    for name, mine, want in zip(("x", "weight", "bias"), ours, exact):
        assert relative_error(mine, want) < 5e-5, name  # x's own float32 rounding: about 1e-7 of the offset


def test_backward_op_passes_opcheck():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 5).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(2, 16, 3, 5).contiguous(memory_format=torch.channels_last)
    table = torch.randn(2, 32)
    halves = tuple(part.contiguous(memory_format=torch.channels_last) for part in (x[:, :4], x[:, 4:]))
    for scale, shift in ((table[:, :16], table[:, 16:]), (None, None)):
        for x1, x2 in ((x, None), halves):
            torch.library.opcheck(
                torch.ops.diffusion_kernels.group_norm_act_backward,
                (grad, x1, x2, torch.randn(16), torch.randn(16), scale, shift),
                dict(groups=4, eps=1e-5, silu=True),
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("modulate", [True, False])
def test_backward_of_two_inputs_is_the_backward_of_their_concatenation_bit_for_bit(dtype, modulate):
    """The U-Net's up path hands the norm its input and the skip connection apart (x, x2): the gradients must be
    those of torch.cat([x, x2]), split at x's channels."""
    torch.manual_seed(2)
    cl = torch.channels_last
    x = (torch.randn(3, 48, 5, 7) + 0.3).to(dtype).contiguous(memory_format=cl)
    grad = torch.randn(3, 48, 5, 7).to(dtype).contiguous(memory_format=cl)
    weight, bias, table = torch.randn(48), torch.randn(48), torch.randn(3, 96)
    scale, shift = (table[:, :48], table[:, 48:]) if modulate else (None, None)
    options = dict(groups=8, eps=1e-5, silu=True)
    whole = torch.ops.diffusion_kernels.group_norm_act_backward(grad, x, None, weight, bias, scale, shift, **options)
    x1, x2 = (part.contiguous(memory_format=cl) for part in (x[:, :32], x[:, 32:]))  # a group across the seam
    split = torch.ops.diffusion_kernels.group_norm_act_backward(grad, x1, x2, weight, bias, scale, shift, **options)
    assert split[0].is_contiguous(memory_format=cl) and split[1].is_contiguous(memory_format=cl)
    assert torch.equal(split[0], whole[0][:, :32]) and torch.equal(split[1], whole[0][:, 32:])
    assert whole[1].numel() == 0  # no x2, no dx2
    for mine, theirs in zip(split[2:], whole[2:]):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    ("x", "grad", "message"),
    [
        (torch.randn(2, 8, 3, 3), None, "x must be a channels-last float32 or bfloat16"),
        (torch.randn(2, 8, 3, 3, dtype=torch.float64), None, "x must be a channels-last float32 or bfloat16"),
        (None, torch.randn(2, 8, 3, 3), "grad must be a channels-last"),
    ],
    ids=["NCHW x", "float64 x", "NCHW grad"],
)
def test_backward_op_refuses_what_it_cannot_compute(x, grad, message):
    cl = torch.channels_last
    x = x if x is not None else torch.randn(2, 8, 3, 3).contiguous(memory_format=cl)
    grad = grad if grad is not None else torch.randn(2, 8, 3, 3).contiguous(memory_format=cl)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.diffusion_kernels.group_norm_act_backward(
            grad, x, None, torch.ones(8), torch.zeros(8), None, None, groups=2, eps=1e-5, silu=True
        )


@pytest.mark.parametrize(
    ("x2", "grad_channels", "message"),
    [
        (torch.randn(2, 4, 3, 3), 8, "x2 must be a channels-last tensor"),
        (
            torch.randn(2, 4, 3, 3).contiguous(memory_format=torch.channels_last),
            4,
            r"grad must be a channels-last \(2, 8,",
        ),
        (
            torch.randn(2, 4, 3, 3, dtype=torch.float64).contiguous(memory_format=torch.channels_last),
            8,
            "x2 must have x's dtype",
        ),
    ],
    ids=["NCHW x2", "grad of x's channels alone", "float64 x2"],
)
def test_backward_op_refuses_a_second_input_it_cannot_compute(x2, grad_channels, message):
    cl = torch.channels_last
    x, grad = (torch.randn(2, c, 3, 3).contiguous(memory_format=cl) for c in (4, grad_channels))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.diffusion_kernels.group_norm_act_backward(
            grad, x, x2, torch.ones(8), torch.zeros(8), None, None, groups=2, eps=1e-5, silu=True
        )


def test_the_op_itself_stays_without_an_autograd_formula():
    """The sampling runner calls the op bare: a formula registered on it would run Python on every call."""
    for key in ("Autograd", "AutogradCPU"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("diffusion_kernels::group_norm_act", key)


def test_swapped_norms_keep_the_state_dict_and_compute_the_same_function():
    torch.manual_seed(0)
    model = UNet(tiny_unet_config()).to(memory_format=torch.channels_last)
    for parameter in model.parameters():  # no zero-initialized layer: every norm shapes the output
        parameter.data.normal_(0, 0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, t = torch.randn(4, 1, 16, 16).contiguous(memory_format=torch.channels_last), torch.randint(0, 50, (4,))
    expected = model(x, t)
    swapped = use_fused_norms(model)
    assert swapped == sum(hasattr(m, "norm_act") for m in model.modules()) > 0
    assert all(m.norm_act is fused_norm_act for m in model.modules() if hasattr(m, "norm_act"))
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    torch.testing.assert_close(model(x, t), expected, rtol=1e-4, atol=1e-5)
    use_fused_norms(model)  # again: still the same function
    assert basic_diffusion.norm_act is not fused_norm_act


def test_the_cpu_trainer_takes_the_same_steps_through_the_fused_norms(tmp_path, monkeypatch):
    from ddpm.benchmarks.sampling_bench import perturb_zero_init
    from ddpm.training import trainer as trainer_module

    def trained(folder, *, fused: bool):
        if not fused:
            monkeypatch.setattr(trainer_module, "use_fused_norms", lambda model, **_: 0)
        # seeds torch: the same weights and noise; oneDNN's convolutions (test_winograd.py trains Winograd's)
        trainer = make_trainer(tmp_path / folder, total_steps=4, winograd_convs=False)
        monkeypatch.undo()
        assert all((m.norm_act is fused_norm_act) == fused for m in trainer.model.modules() if hasattr(m, "norm_act"))
        assert trainer.step_layout == ("channels-last with fused norms" if fused else "channels-last")  # its line
        assert all(m.norm_act is basic_diffusion.norm_act for m in trainer.ema.modules() if hasattr(m, "norm_act"))
        perturb_zero_init(trainer.model, seed=0, std=0.05)
        for layer in trainer.model.modules():  # no dropout: its mask would follow the step's other draws
            if isinstance(layer, SeededDropout):
                layer.p = 0.0
        grads = []
        for _ in range(4):
            trainer.train_step()
            grads.append({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
        return grads, trainer.model.state_dict()

    (plain_grads, plain), (fused_grads, fused) = trained("a", fused=False), trained("b", fused=True)
    for step, (mine, theirs) in enumerate(zip(fused_grads, plain_grads)):
        for name, grad in mine.items():
            torch.testing.assert_close(grad, theirs[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    for name, mine in fused.items():  # AdamW's division by a gradient's size: see tests/training/test_winograd.py
        torch.testing.assert_close(mine, plain[name], rtol=1e-5, atol=1e-3 if name.endswith("bias") else 1e-4)
