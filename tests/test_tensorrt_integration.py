"""tensorrt_integration.py's own logic, with no engine run here (TensorRT cannot be installed on these machines).

Specification: the tensorrt implementation's step loop reproduces the original loop exactly (a PyTorch
U-Net stands in for the engine), an engine's inputs and outputs are checked against the I/O spec, weak
typing pins exactly the layers that depend only on t, and importing the project never imports tensorrt.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TINY_SCHEDULE, perturbed_unet, tiny_unet_config

import tensorrt_integration as trt_integration
from basic_diffusion import sample as original_sample
from ddpm.formats.unet_io import UNetIO
from noise_schedule import NoiseSchedule
from optimized_diffusion import FusedSampler

CONFIG, SCHEDULE = tiny_unet_config(), TINY_SCHEDULE
IO = UNetIO.from_config(CONFIG)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("sampler,eta", [("ddpm", 0.0), ("ddim", 1.0), ("dpm_solver", 0.0), ("dpm_solver_sde", 0.0)])
@pytest.mark.parametrize("fused_step", [True, False])
def test_reference_step_sampler_reproduces_the_original_loop_exactly(sampler, eta, fused_step):
    # The engine's place is taken by the PyTorch U-Net: this checks the loop, buffers, device-side
    # step index and noise order that the tensorrt implementation wraps around its engine, with the
    # fused op and with the p_step fallback used where the extension is not built.
    model = perturbed_unet(CONFIG)
    plan = NoiseSchedule(SCHEDULE).make_plan(sampler, num_steps=6, eta=eta)
    g_ours, g_ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampler_ = FusedSampler(model, plan, shape=(2, 1, 16, 16), channels_last=False, fused_step=fused_step)
    ours = sampler_(generator=g_ours)
    reference = original_sample(model, plan, shape=(2, 1, 16, 16), generator=g_ref)
    assert torch.equal(ours, reference)
    assert torch.equal(g_ours.get_state(), g_ref.get_state())  # the generator is left where the original leaves it


def test_engine_io_is_checked_against_the_spec():
    good = {"x_t": ("input", torch.float32), "t": ("input", torch.int64), "eps": ("output", torch.float32)}
    assert trt_integration.io_mismatches(IO, good) == []
    problems = trt_integration.io_mismatches(
        IO, {**good, "eps": ("output", torch.float16), "extra": ("output", torch.float32)}
    )
    assert len(problems) == 2 and "eps" in problems[0] and "extra" in problems[1]

    class FakeDataType:  # tensorrt.DataType members are pybind11 enums with a .name
        def __init__(self, name: str) -> None:
            self.name = name

    assert trt_integration.torch_dtype(FakeDataType("INT64")) is torch.int64
    assert trt_integration.torch_dtype(FakeDataType("BF16")) is torch.bfloat16


def test_weak_typing_pins_exactly_the_layers_that_depend_only_on_t():
    # A network in TensorRT's layer order: constants, the time branch, the image branch, their sum.
    layers = [
        ([], ["freqs"]),  # 0 constant
        (["t"], ["t_float"]),  # 1 cast
        (["t_float", "freqs"], ["phase"]),  # 2 t * freqs
        (["phase"], ["sin"]),  # 3
        (["phase"], ["cos"]),  # 4
        (["cos", "sin"], ["emb"]),  # 5 concat
        ([], ["w1"]),  # 6 constant
        (["emb", "w1"], ["emb_mlp"]),  # 7 time MLP
        (["x_t"], ["h"]),  # 8 conv on the image
        (["h", "emb_mlp"], ["h_plus"]),  # 9 image + embedding: not pinned
        (["h_plus"], ["eps"]),  # 10
    ]
    assert trt_integration.time_embedding_layers(layers) == [1, 2, 3, 4, 5, 7]


def test_importing_the_project_never_imports_tensorrt(tmp_path):
    # A tensorrt that fails loudly when imported, first on the path: the project must not touch it.
    (tmp_path / "tensorrt.py").write_text("raise RuntimeError('tensorrt was imported')\n")
    code = (
        "import main, tensorrt_integration, optimized_diffusion; from ddpm.cli import parser, resolve; "
        "from ddpm.modes import benchmark, evaluate, export, sample, train, train_autoencoder; parser.build_parser()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
