"""The trainer's CPU dropout (ddpm/kernels/ops.py): the extension's seeded_dropout op against SplitMix64
written out in Python, its keep rate, its gradient, and the trainer's use of it."""

from __future__ import annotations

import pytest
import torch
from helpers import make_trainer, tiny_unet_config
from torch import nn

from basic_diffusion import UNet
from ddpm.kernels import ops
from ddpm.kernels.ops import SeededDropout, seeded_dropout_available, use_seeded_dropout

MASK64 = 2**64 - 1


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    ops.load_extension()
    if not seeded_dropout_available():
        pytest.skip("the built extension predates seeded_dropout: rebuild it (make install)")


def splitmix64(seed: int, n: int) -> int:
    """Output number n (from 0) of SplitMix64 seeded with ``seed`` (Steele, Lea & Flood 2014), in Python ints."""
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def reference_dropout(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """Element i kept when half (i & 1) of SplitMix64 number i // 2 is >= p * 2^32, then scaled by 1 / (1 - p)."""
    flat = x.contiguous().reshape(-1).float()
    threshold = int(p * 2**32)
    keep = []
    for i in range(flat.numel()):
        z = splitmix64(seed, i // 2)
        keep.append(((z >> 32) if i & 1 else (z & 0xFFFFFFFF)) >= threshold)
    scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    out = torch.where(torch.tensor(keep), flat * scale, torch.zeros(()))
    return out.to(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7,), (3, 5, 4, 3), (1,)], ids=str)
def test_seeded_dropout_keeps_the_elements_splitmix64_says_bit_for_bit(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    for seed, p in [(0, 0.1), (2**62 - 1, 0.5), (123456789, 0.9), (5, 0.0)]:
        out = torch.ops.diffusion_kernels.seeded_dropout(x, seed, p)
        torch.testing.assert_close(out, reference_dropout(x, seed, p), rtol=0, atol=0)


def test_seeded_dropout_keeps_1_minus_p_of_the_elements_and_its_pairs_independently():
    x = torch.ones(1_000_000)
    for seed, p in [(1, 0.1), (2, 0.5)]:
        keep = torch.ops.diffusion_kernels.seeded_dropout(x, seed, p) != 0
        n = keep.numel()
        sigma = (n * p * (1 - p)) ** 0.5
        assert abs(keep.sum().item() - n * (1 - p)) < 5 * sigma
        # the two elements drawn from one 64-bit number: both kept as often as independent draws would be
        both = (keep[0::2] & keep[1::2]).sum().item()
        pairs, q = n // 2, (1 - p) ** 2
        assert abs(both - pairs * q) < 5 * (pairs * q * (1 - q)) ** 0.5


def test_seeded_dropout_masks_by_logical_position_whatever_the_layout_and_threads():
    x = torch.randn(4, 8, 5, 5)
    expected = torch.ops.diffusion_kernels.seeded_dropout(x, 99, 0.3)
    channels_last = torch.ops.diffusion_kernels.seeded_dropout(x.contiguous(memory_format=torch.channels_last), 99, 0.3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = torch.ops.diffusion_kernels.seeded_dropout(x, 99, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(channels_last, expected) and torch.equal(one_thread, expected)
    assert not torch.equal(torch.ops.diffusion_kernels.seeded_dropout(x, 100, 0.3), expected)  # another seed


def test_seeded_dropout_passes_opcheck_and_its_gradient_is_the_same_mask():
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.diffusion_kernels.seeded_dropout, (x, 7, 0.25))
    y = torch.ops.diffusion_kernels.seeded_dropout(x, 7, 0.25)
    grad = torch.randn_like(y)
    y.backward(grad)
    scale = torch.tensor(1 / 0.75, dtype=torch.float32)
    assert torch.equal(x.grad, torch.where(y != 0, grad * scale, torch.zeros(())))


def test_seeded_dropout_refuses_a_rate_outside_zero_to_one():
    with pytest.raises(RuntimeError, match=r"p must be in \[0, 1\)"):
        torch.ops.diffusion_kernels.seeded_dropout(torch.ones(3), 0, 1.0)
    with pytest.raises(ValueError, match="dropout must be in"):
        SeededDropout(-0.1)


def test_seeded_dropout_module_draws_its_seed_from_the_global_generator_and_is_identity_in_eval():
    layer, x = SeededDropout(0.5), torch.randn(64)
    torch.manual_seed(3)
    first = layer(x)
    torch.manual_seed(3)
    assert torch.equal(layer(x), first)  # the global generator's state decides the mask
    assert not torch.equal(layer(x), first)  # and moves on with each call
    assert layer.eval()(x) is x


def test_seeded_dropout_keeps_channels_last_activations_channels_last_with_the_same_mask_for_the_gradient():
    layer = SeededDropout(0.25)
    x = torch.randn(2, 16, 3, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    torch.manual_seed(4)
    y = layer(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.manual_seed(4)  # the same seed: the mask in (B, H, W, C) order
    seed = int(torch.randint(2**62, ()).item())
    expected = reference_dropout(x.detach().permute(0, 2, 3, 1), seed, 0.25).permute(0, 3, 1, 2)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    grad = torch.randn(2, 16, 3, 5)  # an NCHW gradient: masked where the output was
    y.backward(grad)
    scale = torch.tensor(1 / 0.75, dtype=torch.float32)
    assert torch.equal(x.grad, torch.where(y != 0, grad * scale, torch.zeros(())))


def test_the_cpu_trainer_swaps_dropout_keeps_the_state_dict_and_fuses_adamw(tmp_path):
    trainer = make_trainer(tmp_path)
    swapped = [m for m in trainer.model.modules() if isinstance(m, SeededDropout)]
    assert swapped and not any(type(m) is nn.Dropout for m in trainer.model.modules())
    assert all(m.p == 0.1 for m in swapped)
    assert trainer.model.state_dict().keys() == UNet(tiny_unet_config(dropout=0.1)).state_dict().keys()
    assert trainer.optimizer.defaults["fused"]
    model = UNet(tiny_unet_config(dropout=0.0))
    count = sum(type(m) is nn.Dropout for m in model.modules())
    assert count > 0 and use_seeded_dropout(model) == count  # nn.Dropout(0.0) too: a no-op either way
