"""tensorrt_integration.py's own logic, with no engine run here (TensorRT cannot be installed on these machines).

Specification: the tensorrt implementation's step loop reproduces the original loop exactly (a PyTorch
U-Net stands in for the engine); the whole path (tensorrt_sampler, TensorRTUNet, Engine.allocate_buffers
and Engine.infer) draws the original's images through a CPU fake of TensorRT's engine that, like the
real one, writes into the buffers bound by address and reuses them on every call (guided too, the
batch doubled); an engine's inputs and outputs are checked against the I/O spec, weak typing pins
exactly the layers that depend only on t, and importing the project never imports tensorrt.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, TINY_SCHEDULE, perturbed_unet, tiny_unet_config

import tensorrt_integration as trt_integration
from basic_diffusion import sample as original_sample
from ddpm.conditioning import Guidance
from ddpm.formats.unet_io import BatchRange, UNetIO
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
    plan = NoiseSchedule(SCHEDULE).make_plan(sampler, sampling_steps=6, eta=eta)
    g_ours, g_ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampler_ = FusedSampler(model, plan, shape=(2, 1, 16, 16), fused_step=fused_step)
    ours = sampler_(generator=g_ours)
    reference = original_sample(model, plan, shape=(2, 1, 16, 16), generator=g_ref)
    assert torch.equal(ours, reference)
    assert torch.equal(g_ours.get_state(), g_ref.get_state())  # the generator is left where the original leaves it


class FakeTensorRT:
    """The names of the tensorrt module that Engine reads."""

    class TensorIOMode:
        INPUT, OUTPUT = "input", "output"


class FakeCudaEngine:
    """A CPU stand-in for a deserialized ICudaEngine of ``unet``: it knows its I/O tensors, and its
    execution context runs the U-Net from the tensors bound by address into the bound output buffer,
    as TensorRT does. It is not TensorRT: it checks the wrapper around the engine, not an engine."""

    DTYPE_NAMES = {torch.float32: "FLOAT", torch.int64: "INT64"}

    def __init__(self, unet, io) -> None:
        self.unet, self.io, self.owner, self.runs = unet.eval(), io, None, 0
        self.num_io_tensors = len(io.tensors)

    def get_tensor_name(self, index):
        return self.io.tensors[index].name

    def get_tensor_mode(self, name):
        return "input" if name in self.io.input_names else "output"

    def get_tensor_dtype(self, name):
        (spec,) = [s for s in self.io.tensors if s.name == name]
        return SimpleNamespace(name=self.DTYPE_NAMES[spec.dtype])

    def create_execution_context(self):
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeCudaEngine) -> None:
        self.engine, self.shapes, self.addresses = engine, {}, {}

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        return self.shapes.get(name, self.shapes["x_t"])  # eps: x_t's shape

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def execute_async_v3(self, stream_handle):
        buffers = self.engine.owner.buffers  # the Engine this fake belongs to
        assert {name: b.data_ptr() for name, b in buffers.items()} == self.addresses  # reads what was bound
        inputs = [buffers[name] for name in self.engine.io.input_names]
        with torch.no_grad():
            buffers["eps"].copy_(self.engine.unet(*inputs))  # in place: the next run overwrites it
        self.engine.runs += 1
        return True


@pytest.fixture
def fake_tensorrt(monkeypatch):
    """The tensorrt implementation on the CPU: a fake tensorrt module, no CUDA stream or device needed."""
    monkeypatch.setattr(trt_integration, "import_tensorrt", lambda: FakeTensorRT)
    monkeypatch.setattr(trt_integration, "require_cuda", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def fake_engine_unet(unet, *, batch: BatchRange = BatchRange()) -> trt_integration.TensorRTUNet:
    io = UNetIO.from_config(unet.config)
    fake = FakeCudaEngine(unet, io)
    engine = trt_integration.Engine(
        fake, trt=FakeTensorRT, runtime=None, io=io, batch=batch, device=torch.device("cpu")
    )
    fake.owner = engine
    return trt_integration.TensorRTUNet(engine)


def test_the_engine_unet_keeps_its_buffers_and_hands_out_copies(fake_tensorrt):
    unet = perturbed_unet(CONFIG)
    engine_unet = fake_engine_unet(unet, batch=BatchRange(1, 2, 4))
    x1, x2, t = torch.randn(2, 1, 16, 16), torch.randn(2, 1, 16, 16), torch.tensor([5, 40])
    first = engine_unet(x1, t)
    buffer = engine_unet.engine.buffers["eps"]
    second = engine_unet(x2, t)
    assert engine_unet.engine.buffers["eps"] is buffer  # allocated once per batch size, bound once
    with torch.no_grad():
        torch.testing.assert_close(first, unet(x1, t), rtol=0, atol=0)  # not overwritten by the second call
        torch.testing.assert_close(second, unet(x2, t), rtol=0, atol=0)
    with pytest.raises(ValueError, match="takes batches of 1 to 4, not 8; rebuild it with a larger --max_batch"):
        engine_unet(torch.randn(8, 1, 16, 16), torch.zeros(8, dtype=torch.int64))


@pytest.mark.parametrize("sampler", ["ddim", "dpm_solver"])
def test_the_tensorrt_implementation_draws_the_originals_images_through_its_engine(fake_tensorrt, sampler):
    unet = perturbed_unet(CONFIG)
    engine_unet = fake_engine_unet(unet)
    plan = NoiseSchedule(SCHEDULE).make_plan(sampler, sampling_steps=5)
    ours = trt_integration.tensorrt_sampler(engine_unet, plan, shape=(2, 1, 16, 16))(
        generator=torch.Generator().manual_seed(4)
    )
    reference = original_sample(unet, plan, shape=(2, 1, 16, 16), generator=torch.Generator().manual_seed(4))
    assert engine_unet.engine.engine.runs == 5  # one engine run per step
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_a_guided_tensorrt_sampler_runs_its_engine_on_the_doubled_batch(fake_tensorrt):
    config = tiny_unet_config(num_classes=3)
    unet = perturbed_unet(config)
    engine_unet = fake_engine_unet(unet)
    plan = NoiseSchedule(SCHEDULE).make_plan("ddim", sampling_steps=4)
    guidance = Guidance(torch.tensor([0, 2]), null_label=config.null_label, scale=3.0)
    sampler = trt_integration.tensorrt_sampler(engine_unet, plan, shape=(2, 1, 16, 16), guidance=guidance)
    ours = sampler(generator=torch.Generator().manual_seed(6), guidance=guidance)
    reference = original_sample(
        unet, plan, shape=(2, 1, 16, 16), generator=torch.Generator().manual_seed(6), guidance=guidance
    )
    assert engine_unet.engine.batch_size == 4  # conditional and null-label copies in one run
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


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
        "from ddpm.modes import benchmark, distill, evaluate, export, sample, train; parser.build_parser()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
