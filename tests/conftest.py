"""Fixtures shared by several test modules (shared helpers that are not fixtures: helpers.py)."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    # Tiny models: one thread is fastest, and immune to a busy 2-core machine (onnxruntime follows).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_onnx_bytes() -> bytes:
    """helpers.py's tiny U-Net (perturbed, seed 0) exported to ONNX (default opset, fp32, EMA metadata) once per
    session: an export takes seconds. Bytes, so that each test parses a proto of its own."""
    from helpers import TINY_SCHEDULE, perturbed_unet, tiny_unet_config

    from ddpm.formats import exporters, unet_io

    config = tiny_unet_config()
    metadata = unet_io.artifact_metadata(model_config=config, schedule_config=TINY_SCHEDULE, weights="ema")
    return exporters.export_onnx_model(perturbed_unet(config), metadata=metadata).SerializeToString()
