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
