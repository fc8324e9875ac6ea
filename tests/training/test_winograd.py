"""The CPU training step's convolutions. 3x3 convolutions trained in Winograd's domain (ddpm/training/winograd.py):
their output and all three gradients against float64 autograd, the weight-gradient op under opcheck and with wrong
arguments, a U-Net whose convolutions are swapped keeping its parameters and training the same steps as oneDNN's, the
maps each CPU trains in Winograd's domain and the trainer swapping them in for fp32 only; 1x1 convolutions as GEMMs
(AVX2's) against float64 too (the thin first and last convolutions: tests/kernels/test_thin_conv.py). And the trainer's
channels-last activations (bf16's only with the fused norms), with the same gradients as NCHW's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import conv3x3_case, make_trainer, outputs_and_grads, tiny_unet_config
from torch import nn

from basic_diffusion import ResBlock, UNet
from ddpm.kernels import ops
from ddpm.kernels.ops import SeededDropout, use_fused_norms
from ddpm.training import winograd
from ddpm.training.winograd import (
    GemmConv1x1,
    WinogradConv2d,
    conv3x3,
    fused_norm_and_skip,
    use_fused_skips,
    use_gemm_1x1_convs,
    use_thin_convs,
    use_winograd_convs,
    weight_grad_available,
)


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    ops.load_extension()
    if not weight_grad_available():
        pytest.skip("the built extension predates conv3x3_winograd_backward: rebuild it (make install)")


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


# (batch, Cin, Cout, H, W): the U-Net's widths, odd sizes (a last tile half outside), a one-row image.
SHAPES = [(3, 16, 32, 8, 8), (2, 32, 16, 5, 7), (4, 64, 64, 2, 2), (2, 16, 16, 1, 3), (1, 48, 32, 9, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tile", [2, 4])
def test_output_and_gradients_match_float64_as_closely_as_onednn(shape, tile):
    x, w, b, grad = conv3x3_case(shape)

    def conv2d(*a):
        return F.conv2d(*a, padding=1)

    reference = outputs_and_grads(conv2d, torch.float64, (x, w, b), grad)
    onednn = outputs_and_grads(conv2d, torch.float32, (x, w, b), grad)
    nhwc = x.contiguous(memory_format=torch.channels_last)
    ours = outputs_and_grads(lambda *a: conv3x3(*a, tile=tile), torch.float32, (nhwc, w, b), grad)
    for name, mine, theirs, exact in zip(("y", "dx", "dw", "db"), ours, onednn, reference):
        assert mine.shape == exact.shape, name
        # F(4x4, 3x3)'s transforms scale by up to 8: a looser bound than F(2x2, 3x3)'s additions (the kernel's tests).
        assert relative_error(mine, exact) <= {2: 3, 4: 10}[tile] * relative_error(theirs, exact) + 1e-6, name
    assert ours[0].is_contiguous(memory_format=torch.channels_last)


def test_weight_grad_op_passes_opcheck():
    x = torch.randn(2, 16, 6, 5).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(2, 32, 6, 5).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd_weight_grad, (x, grad))


def channels_last(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "x, grad, message",
    [
        (torch.randn(2, 16, 4, 4), channels_last(2, 16, 4, 4), "x must be a channels-last float32"),
        (channels_last(2, 16, 4, 4, dtype=torch.float64), channels_last(2, 16, 4, 4), "x must be a channels-last"),
        (channels_last(2, 8, 4, 4), channels_last(2, 16, 4, 4), "multiples of 16"),
        (channels_last(2, 16, 4, 4), channels_last(2, 16, 4, 6), "grad_out must be"),
        (channels_last(2, 16, 4, 4), torch.randn(2, 16, 4, 4), "grad_out must be"),
        (channels_last(2, 16, 4, 4), channels_last(2, 16, 4, 4), "tile must be 2"),
    ],
)
def test_weight_grad_op_refuses_what_it_cannot_compute(x, grad, message):
    tile = 3 if message.startswith("tile") else 2
    with pytest.raises(RuntimeError, match=message):
        torch.ops.diffusion_kernels.conv3x3_winograd_weight_grad(x, grad, tile=tile)


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("rotated", [False, True])
def test_the_kernel_transform_op_matches_the_runners_float64_transform(tile, rotated):
    weight = torch.randn(32, 48, 3, 3, dtype=torch.float64)
    # The rotated kernel: turned 180 degrees, its channels swapped (the input gradient's convolution).
    turned = weight.flip(2, 3).transpose(0, 1) if rotated else weight
    reference = ops.winograd_weight(turned, tile=tile).double()  # computed in float64, rounded once
    G = torch.tensor(ops.WINOGRAD_G[tile], dtype=torch.float64)
    exact = torch.einsum("ai,ocij,bj->abco", G, turned, G).reshape(reference.shape)  # U = G g G^T
    ours = ops.winograd_kernel(weight.float(), tile=tile, rotated=rotated)
    assert ours.shape == reference.shape and ours.dtype == torch.float32
    assert relative_error(ours, exact) <= 4 * relative_error(reference, exact) + 1e-7


@pytest.mark.parametrize("wanted", [(True, True, True), (False, True, False), (True, False, True)])
def test_the_backward_op_returns_only_the_gradients_asked_for(wanted):
    x, grad = channels_last(2, 16, 5, 6), channels_last(2, 32, 5, 6)
    weight = torch.randn(32, 16, 3, 3)
    ours = ops.conv3x3_winograd_backward(grad, x, weight, tile=4, wanted=wanted)
    leaves = [x.double().requires_grad_(), weight.double().requires_grad_(), torch.zeros(32, dtype=torch.float64)]
    leaves[2].requires_grad_()
    F.conv2d(*leaves, padding=1).backward(grad.double())
    for mine, leaf, asked in zip(ours, leaves, wanted):
        assert (mine is None) == (not asked)
        if asked:
            assert mine.shape == leaf.shape and relative_error(mine, leaf.grad) < 1e-5


@pytest.mark.parametrize("threads", [1, 2])
def test_the_backward_op_on_two_threads_sums_every_threads_share(threads):
    """150 tiles in several blocks: on two threads each thread sums its share of the kernel's gradient and the op
    adds the shares; every tile counts once either way."""
    x, grad = channels_last(5, 16, 9, 11), channels_last(5, 32, 9, 11)
    weight = torch.randn(32, 16, 3, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = ops.conv3x3_winograd_backward(grad, x, weight, tile=4, wanted=(True, True, True))
    finally:
        torch.set_num_threads(before)
    leaves = [x.double().requires_grad_(), weight.double().requires_grad_(), torch.zeros(32, dtype=torch.float64)]
    leaves[2].requires_grad_()
    F.conv2d(*leaves, padding=1).backward(grad.double())
    for mine, leaf in zip(ours, leaves):
        assert relative_error(mine, leaf.grad) < 1e-5


def test_the_transform_and_backward_ops_pass_opcheck():
    x, grad = channels_last(2, 16, 6, 5), channels_last(2, 32, 6, 5)
    weight = torch.randn(32, 16, 3, 3)
    for rotated in (False, True):
        torch.library.opcheck(torch.ops.diffusion_kernels.winograd_kernel, (weight, 4, rotated))
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd_backward, (grad, x, weight, 4, mask))


@pytest.mark.parametrize(
    "weight, tile, message",
    [
        (torch.randn(32, 16, 3, 3, dtype=torch.float64), 4, "weight must be a contiguous float32"),
        (torch.randn(16, 32, 3, 3).transpose(0, 1), 4, "weight must be a contiguous float32"),
        (torch.randn(32, 16, 5, 5), 4, "weight must be a contiguous float32"),
        (torch.randn(24, 16, 3, 3), 4, "multiples of 16"),
        (torch.randn(32, 16, 3, 3), 3, "tile must be 2"),
    ],
)
def test_the_transform_op_refuses_what_it_cannot_compute(weight, tile, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.diffusion_kernels.winograd_kernel(weight, tile, False)


@pytest.mark.parametrize(
    "x, grad, message",
    [
        (channels_last(2, 16, 4, 4), torch.randn(2, 32, 4, 4), "grad_out must be a channels-last float32"),
        (channels_last(2, 16, 4, 4), channels_last(2, 16, 4, 4), "grad_out must be a channels-last float32"),
        (channels_last(2, 16, 4, 5), channels_last(2, 32, 4, 4), "x must be"),
        (channels_last(2, 48, 4, 4), channels_last(2, 32, 4, 4), "x must be"),
    ],
)
def test_the_backward_op_refuses_what_it_cannot_compute(x, grad, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.diffusion_kernels.conv3x3_winograd_backward(grad, x, torch.randn(32, 16, 3, 3), 4, [True] * 3)


def test_swapped_unet_keeps_its_parameters_and_computes_the_same_function():
    torch.manual_seed(0)
    model = UNet(tiny_unet_config())
    before = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, t = torch.randn(4, 1, 16, 16), torch.randint(0, 50, (4,))
    expected = model(x, t)
    swapped = use_winograd_convs(model)
    eligible = [m for m in model.modules() if isinstance(m, nn.Conv2d) and ops.winograd_applies(m)]
    assert swapped == len(eligible) > 0
    assert all(type(m) is WinogradConv2d for m in eligible)
    assert {name: p for name, p in model.named_parameters()} == before  # the same Parameter objects
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    torch.testing.assert_close(model(x, t), expected, rtol=1e-4, atol=1e-5)


def test_a_swapped_kernel_is_nchw_contiguous_the_layout_its_gradient_comes_out_in():
    model = UNet(tiny_unet_config()).to(memory_format=torch.channels_last)  # as the trainer holds it
    use_winograd_convs(model)
    kernels = [m.weight for m in model.modules() if isinstance(m, WinogradConv2d)]
    assert kernels and all(kernel.is_contiguous() for kernel in kernels)  # read as (Cout * Cin, 9) with no copy
    kernel, x = kernels[0], torch.randn(2, kernels[0].shape[1], 6, 6)
    (grad,) = torch.autograd.grad(conv3x3(x, kernel).sum(), kernel)
    assert grad.is_contiguous()  # AccumulateGrad keeps it as it is
    # A kernel re-laid channels-last afterwards (as .to(memory_format=...) does) still trains, to the same gradient.
    relaid = kernel.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    (again,) = torch.autograd.grad(conv3x3(x, relaid).sum(), relaid)
    torch.testing.assert_close(again, grad)


@pytest.mark.parametrize("shape", [(3, 96, 32, 8, 8), (2, 64, 192, 2, 2), (1, 16, 48, 5, 7)], ids=str)
def test_a_1x1_gemm_convolution_matches_float64_as_closely_as_onednn(shape):
    B, cin, cout, H, W = shape
    gen = torch.Generator().manual_seed(sum(shape))
    conv = nn.Conv2d(cin, cout, 1).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(cout, cin, 1, 1, generator=gen, dtype=torch.float64) / cin**0.5)
    x = torch.randn(B, cin, H, W, generator=gen, dtype=torch.float64)
    grad = torch.randn(B, cout, H, W, generator=gen, dtype=torch.float64)

    def run(module):
        module.zero_grad()
        leaf = x.to(next(module.parameters()).dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
        y = module(leaf)
        y.backward(grad.to(y.dtype))
        return [y.detach(), leaf.grad, module.weight.grad, module.bias.grad]

    reference = run(conv)
    plain = nn.Conv2d(cin, cout, 1)
    plain.load_state_dict(conv.state_dict())
    expected = run(plain)
    gemm = nn.Sequential(copy := nn.Conv2d(cin, cout, 1))
    copy.load_state_dict(conv.state_dict())
    assert use_gemm_1x1_convs(gemm) == 1 and type(gemm[0]) is GemmConv1x1
    ours = run(gemm[0])
    assert ours[0].is_contiguous(memory_format=torch.channels_last)  # the next layer's layout, no reorder
    for name, mine, theirs, exact in zip(("y", "dx", "dw", "db"), ours, expected, reference):
        assert mine.shape == exact.shape, name
        assert relative_error(mine, exact) <= 2 * relative_error(theirs, exact) + 1e-7, name


@pytest.mark.parametrize("side", [(6, 5), (96, 64)], ids=["a few pixels", "pixels enough for the chunked product"])
@pytest.mark.parametrize("split", [None, 20], ids=["one input", "the skip connection apart"])
def test_a_fused_norm_and_skip_matches_float64_as_closely_as_pytorchs(split, side):
    """A block's first norm and 1x1 skip (basic_diffusion.norm_and_skip) through _NormActSkip: both outputs and every
    gradient as close to float64 as PyTorch's float32 GroupNorm, SiLU and 1x1 convolution; with x2, a norm group
    straddling the seam between x's channels and x2's; with a batch of more pixels than winograd._TN_MIN_ROWS, the
    skip's weight gradient summed over chunks of them."""
    gen = torch.Generator().manual_seed(3)
    block = ResBlock(48, 32, emb_dim=16, dropout=0.0, groups=8).double()
    for parameter in block.parameters():
        parameter.data.normal_(0, 0.3, generator=gen)
    x = torch.randn(3, 48, *side, generator=gen, dtype=torch.float64) + 0.4
    grads = [torch.randn(3, c, *side, generator=gen, dtype=torch.float64) for c in (48, 32)]

    def run(module, dtype, fused):
        module.zero_grad()
        leaf = x.to(dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
        parts = (leaf, None) if split is None or not fused else (leaf[:, :split], leaf[:, split:])
        parts = [p if p is None else p.contiguous(memory_format=torch.channels_last) for p in parts]
        h, skipped = module.norm_and_skip(module, *parts)
        assert not fused or type(h.grad_fn).__name__ == "_NormActSkipBackward"  # the swapped function ran
        torch.autograd.backward((h, skipped), [g.to(dtype) for g in grads])
        params = (module.norm1.weight, module.norm1.bias, module.skip.weight, module.skip.bias)
        return [h.detach(), skipped.detach(), leaf.grad] + [p.grad for p in params]

    reference = run(block, torch.float64, fused=False)
    plain = copy.deepcopy(block).float()
    expected = run(plain, torch.float32, fused=False)
    fused = copy.deepcopy(block).float()
    assert use_fused_norms(fused) == 1 and use_gemm_1x1_convs(fused) == 1 and use_fused_skips(fused) == 1
    assert list(fused.state_dict()) == list(block.state_dict())
    ours = run(fused, torch.float32, fused=True)
    names = ("h", "skip", "dx", "dnorm_weight", "dnorm_bias", "dskip_weight", "dskip_bias")
    for name, mine, theirs, exact in zip(names, ours, expected, reference):
        assert mine.shape == exact.shape, name
        assert relative_error(mine, exact) <= 2 * relative_error(theirs, exact) + 1e-7, name


def test_only_plain_1x1_convolutions_become_gemms():
    layers = nn.Sequential(
        nn.Conv2d(16, 32, 1),
        nn.Conv2d(32, 32, 1, stride=2),
        nn.Conv2d(32, 32, 1, groups=2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.Conv2d(32, 16, 1, bias=False),
    )
    before = list(layers.parameters())
    assert use_gemm_1x1_convs(layers) == 2
    assert [type(m).__name__ for m in layers] == ["GemmConv1x1", "Conv2d", "Conv2d", "Conv2d", "GemmConv1x1"]
    assert list(layers.parameters()) == before  # the same Parameter objects: the optimizer and the EMA keep them
    x = torch.randn(2, 16, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's convolutions stay nn.Conv2d's
        assert layers[0](x).dtype == torch.bfloat16


def test_training_with_swapped_convolutions_takes_the_same_steps(tmp_path, monkeypatch):
    from ddpm.benchmarks.sampling_bench import perturb_zero_init

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # the thin convolutions too

    def trained(folder, *, winograd: bool) -> tuple[list[dict], dict]:
        # seeds torch: the same weights, dropout, noise; oneDNN's convolutions unless swapped below
        trainer = make_trainer(tmp_path / folder, total_steps=4, winograd_convs=False)
        perturb_zero_init(trainer.model, seed=0, std=0.05)  # gradients through every layer from the first step
        assert not winograd or (use_winograd_convs(trainer.model) > 0 and use_gemm_1x1_convs(trainer.model) > 0)
        assert not winograd or use_fused_skips(trainer.model) > 0  # the norms are the extension's in both runs
        assert not winograd or use_thin_convs(trainer.model) == 2  # the first and last
        grads = []
        for _ in range(4):
            trainer.train_step()
            grads.append({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
        return grads, trainer.model.state_dict()

    (plain_grads, plain), (runner_grads, runner) = trained("a", winograd=False), trained("b", winograd=True)
    # Every step's gradients: the first from the same weights, to rounding; the later ones from weights that AdamW's
    # normalized steps have already moved apart by rounding (below), so ten times looser.
    for step, (mine, theirs) in enumerate(zip(runner_grads, plain_grads)):
        rtol, atol = (1e-4, 1e-6) if step == 0 else (1e-3, 1e-5)
        for name, grad in mine.items():
            torch.testing.assert_close(grad, theirs[name], rtol=rtol, atol=atol, msg=f"step {step}: {name}")
    # AdamW divides each gradient by its running size: where a gradient is zero but for rounding in every step (a
    # channel's bias that the next GroupNorm cancels), each run's rounding walks it by up to a step of the learning
    # rate a step, either way, so those entries are left out; elsewhere the parameters agree to a fifth of a step (a
    # wrong gradient moves them apart by a step a step).
    for name, mine in runner.items():
        rounding = torch.stack([g[name].abs() for g in runner_grads + plain_grads]).amax(0) < 1e-7
        torch.testing.assert_close(mine[~rounding], plain[name][~rounding], rtol=1e-5, atol=2e-4, msg=name)


def test_a_cpu_trains_fp32_channels_last_and_bf16_not_with_the_same_gradients(tmp_path):
    from ddpm.benchmarks.sampling_bench import perturb_zero_init

    def first_grads(folder, **overrides):
        trainer = make_trainer(tmp_path / folder, **overrides)
        perturb_zero_init(trainer.model, seed=0, std=0.05)
        for layer in trainer.model.modules():  # dropout's mask follows the layout (ops.SeededDropout): none
            if isinstance(layer, SeededDropout):
                layer.p = 0.0
        trainer.train_step()
        return trainer, {name: p.grad for name, p in trainer.model.named_parameters()}

    nhwc, grads = first_grads("a")
    nchw, reference = first_grads("b", cpu_channels_last=False)
    assert nhwc.memory_format == torch.channels_last and nchw.memory_format == torch.contiguous_format
    assert nhwc.model.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6, msg=name)
    # bf16 trains channels-last through the fused norms (PyTorch's channels-last GroupNorm is slow in bf16), and
    # NCHW without them.
    assert make_trainer(tmp_path / "c", precision="bf16").memory_format == torch.channels_last
    unfused = make_trainer(tmp_path / "d", precision="bf16", cpu_fused_norms=False)
    assert unfused.memory_format == torch.contiguous_format


@pytest.mark.parametrize("capability, side", [("AVX2", 1), ("AVX512", 1), ("DEFAULT", None), ("SVE256", None)])
def test_each_cpu_trains_in_winograds_domain_from_the_maps_where_it_is_faster(monkeypatch, capability, side):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert winograd.faster_from() == side


@pytest.mark.parametrize(
    "capability, gemm, up_to", [("AVX2", True, None), ("AVX512", True, 8), ("DEFAULT", False, None)]
)
def test_the_trainer_takes_1x1_convolutions_as_gemms_where_this_cpu_gains(
    tmp_path, monkeypatch, capability, gemm, up_to
):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(winograd, "faster_from", lambda: 1)  # Winograd's 3x3 convolutions on every CPU here
    trainer = make_trainer(tmp_path)
    gemms = [m for m in trainer.model.modules() if isinstance(m, GemmConv1x1)]
    assert bool(gemms) == gemm and all(m.max_side == up_to for m in gemms)
    assert ("1x1 convolutions as GEMMs" in trainer.step_layout) == gemm  # the run's line
    skipping = [m for m in trainer.model.modules() if isinstance(m, ResBlock) and isinstance(m.skip, nn.Conv2d)]
    assert skipping and all((m.norm_and_skip is fused_norm_and_skip) == gemm for m in skipping)
    assert ("on maps up to 8x8" in trainer.step_layout) == (up_to == 8)
    assert not any(isinstance(m, GemmConv1x1) for m in trainer.ema.modules())


def test_a_1x1_gemm_keeps_onednns_above_its_side(monkeypatch):
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 32, 1)
    use_gemm_1x1_convs(holder := nn.Sequential(conv), max_side=8)
    gemm, calls = holder[0], []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    for side in (4, 8, 9, 14):
        x = torch.randn(2, 16, side, side).contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(gemm(x), F.conv2d(x, conv.weight, conv.bias), rtol=1e-4, atol=1e-5)
    assert calls == [4, 8]  # 9x9 and 14x14 maps by nn.Conv2d


def test_a_swapped_convolution_keeps_onednns_below_its_side(monkeypatch):
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 16, 3, padding=1)
    use_winograd_convs(holder := nn.Sequential(conv), side=8)
    swapped, calls = holder[0], []
    real = ops.conv3x3_winograd
    monkeypatch.setattr(ops, "conv3x3_winograd", lambda *a: calls.append(a[0].shape[-1]) or real(*a))
    for side in (4, 7, 8, 12):
        x = torch.randn(2, 16, side, side).contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(swapped(x), F.conv2d(x, conv.weight, conv.bias, padding=1), rtol=1e-4, atol=1e-5)
    assert calls == [8, 12]  # 4x4 and 7x7 maps by nn.Conv2d


@pytest.mark.parametrize(
    "overrides, swapped",
    [
        ({}, True),
        ({"precision": "bf16"}, False),  # autocast's convolutions stay oneDNN's
        ({"winograd_convs": False}, False),
        ({"cpu_channels_last": False}, False),  # the NCHW step, which the benchmark's fp32 row times
    ],
)
def test_the_trainer_swaps_winograd_in_for_fp32_channels_last_only(tmp_path, monkeypatch, overrides, swapped):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    trainer = make_trainer(tmp_path, **overrides)
    convs = [m for m in trainer.model.modules() if isinstance(m, WinogradConv2d)]
    assert bool(convs) == swapped
    assert all(m.min_side == 1 for m in convs)
    assert ("Winograd 3x3 convolutions" in trainer.step_layout) == swapped  # the run's line
    assert not any(isinstance(m, WinogradConv2d) for m in trainer.ema.modules())  # exports and previews: plain


def test_the_trainer_swaps_nothing_where_every_map_is_smaller_than_winograds_side(tmp_path, monkeypatch):
    monkeypatch.setattr(winograd, "faster_from", lambda: 32)  # the tiny U-Net's largest maps are 16x16
    trainer = make_trainer(tmp_path)
    assert not any(isinstance(m, WinogradConv2d) for m in trainer.model.modules())
    assert "Winograd" not in trainer.step_layout  # the run's line claims nothing that does not run


def test_resume_takes_this_versions_step_switches_and_the_files_training(tmp_path):
    from ddpm.training.trainer import resume_config

    trainer = make_trainer(tmp_path, winograd_convs=False, cpu_fused_norms=False, ema_decay=0.99)
    config = resume_config(trainer.state_dict())  # a checkpoint written when Winograd was a benchmark row
    assert config.winograd_convs and config.cpu_fused_norms and config.cpu_channels_last
    assert config.ema_decay == 0.99  # what the run learns stays the file's


def test_float32_convolutions_take_f4x4_from_4x4_maps_and_f2x2_below(monkeypatch):
    if not ops.has_winograd_tile4():
        pytest.skip("the built extension predates F(4x4, 3x3): rebuild it (make install)")
    assert [ops.winograd_tile(side) for side in (1, 2, 3, 4, 7, 28)] == [2, 2, 2, 4, 4, 4]
    monkeypatch.setattr(ops, "has_winograd_tile4", lambda: False)  # an extension built before F(4x4, 3x3)
    assert ops.winograd_tile(28) == 2
