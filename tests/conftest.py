"""Fixtures shared by several test modules."""

import pytest
import torch

from basic_diffusion import UNet, UNetConfig


def perturbed_unet(config: UNetConfig, *, device: str | torch.device = "cpu", std: float = 0.05) -> UNet:
    """A U-Net of ``config`` (seed 0) with every weight perturbed, in eval mode: its zero-initialized
    output layers would otherwise give eps = 0, and every implementation would agree trivially."""
    torch.manual_seed(0)
    model = UNet(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
    return model.to(device).eval()


@pytest.fixture(scope="module")
def one_thread():
    # Tiny models: one thread is fastest, and immune to a busy 2-core machine (onnxruntime follows).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
