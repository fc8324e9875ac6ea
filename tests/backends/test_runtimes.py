"""Export and the onnxruntime and TorchScript runtimes, specified against PyTorch.

Specification: the ONNX export (random weights and a trained checkpoint) agrees with PyTorch through
onnxruntime at several batch sizes, and so does the TorchScript trace; sampling from a checkpoint,
its TorchScript and ONNX exports, and with --implementation onnxruntime gives the checkpoint's images
from one seed; without TensorRT every TensorRT path ends in one line naming what to install; a corrupt
artifact, or an implementation that cannot run it, is one line. (The engine cache: tests/formats/test_engine_cache.py;
the tensorrt implementation's loop: tests/test_tensorrt_integration.py.)
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_SCHEDULE, needs_onnx, perturbed_unet, tiny_unet_config

import main
from basic_diffusion import UNet
from basic_diffusion import sample as original_sample
from ddpm.backends import artifacts, runtimes
from ddpm.data.datasets import load_images
from ddpm.formats import checkpoints, unet_io
from ddpm.formats.unet_io import BatchRange, UNetIO
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import NoiseSchedule

CONFIG, SCHEDULE = tiny_unet_config(), TINY_SCHEDULE
IO = UNetIO.from_config(CONFIG)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def random_onnx(tiny_onnx_bytes) -> tuple[UNet, object]:
    import onnx

    return perturbed_unet(CONFIG), onnx.load_model_from_string(tiny_onnx_bytes)  # exported once a session (conftest)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A checkpoint trained for a few steps (high LR, so the weights leave their init), and its exports."""
    work = tmp_path_factory.mktemp("export")
    images = load_images("digits", data_dir=work, image_size=CONFIG.image_size)
    config = TrainConfig(
        dataset="digits",
        total_steps=6,
        batch_size=8,
        lr=3e-3,
        warmup_steps=0,
        ema_decay=0.5,
        checkpoint=str(work / "ck.pt"),
        save_every=0,
        sample_every=0,
    )
    trainer = Trainer(config, CONFIG, SCHEDULE, images=images, device="cpu")
    for _ in range(config.total_steps):
        trainer.train_step()
    trainer.save()
    return work


@pytest.fixture(scope="module")
def exported(workdir) -> dict[str, str]:
    """The trained checkpoint exported by the CLI to ONNX and TorchScript; the CLI's reports by format."""
    reports = {}
    for fmt in ("onnx", "torchscript"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main.main(
                ["--device", "cpu", "--mode", "export", "--format", fmt, "--model_path", str(workdir / "ck.pt")]
            )
        assert rc == 0
        reports[fmt] = out.getvalue()
    return reports


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """main.main in this process (no interpreter start-up per call); returns (rc, stdout, stderr)."""
    rc = main.main(["--device", "cpu", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, match: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("main.py: error:"), err
    assert match in lines[0], lines[0]


# ----- the I/O spec ---------------------------------------------------------------------------------


def test_io_spec_gives_every_shape_and_the_optimization_profile():
    assert IO.input_names == ["x_t", "t"] and IO.output_names == ["eps"]
    assert IO.shapes(3) == {"x_t": (3, 1, 16, 16), "t": (3,), "eps": (3, 1, 16, 16)}
    assert IO.profile(BatchRange(1, 4, 8)) == {
        "x_t": ((1, 1, 16, 16), (4, 1, 16, 16), (8, 1, 16, 16)),
        "t": ((1,), (4,), (8,)),
    }
    assert BatchRange.covering(100, max_batch=64) == BatchRange(1, 16, 100)
    assert BatchRange.covering(4, max_batch=8) == BatchRange(1, 8, 8)
    with pytest.raises(ValueError, match="min <= opt <= max"):
        BatchRange(4, 2, 8)


# ----- ONNX and TorchScript against PyTorch ------------------------------------------------------------


@needs_onnx
def test_onnx_export_has_the_spec_io_native_groupnorm_and_dynamic_batch(random_onnx):
    _, proto = random_onnx
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [unet_io.DEFAULT_OPSET]
    assert "GroupNormalization" in {node.op_type for node in proto.graph.node}
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in proto.graph.input}
    assert inputs["x_t"][1:] == [1, 16, 16] and isinstance(inputs["x_t"][0], str) and inputs["t"] == inputs["x_t"][:1]
    stored = {p.key: p.value for p in proto.metadata_props}[unet_io.METADATA_KEY]
    model_config, schedule_config, _ = checkpoints.parse_artifact_metadata(stored, source=Path("random.onnx"))
    assert (model_config, schedule_config) == (CONFIG, SCHEDULE)


@needs_onnx
def test_onnx_export_of_random_weights_matches_pytorch_through_onnxruntime(random_onnx):
    model, proto = random_onnx
    runtime = runtimes.OnnxRuntimeUNet(
        runtimes.onnxruntime_session(proto.SerializeToString(), device=torch.device("cpu")), io=IO
    )
    diff = unet_io.max_abs_diff(runtime, model, io=IO, batch_sizes=(1, 2, 5))
    assert diff < 1e-4, diff


@needs_onnx
def test_onnxruntime_io_binding_takes_any_layout_and_returns_a_fresh_tensor(random_onnx):
    model, proto = random_onnx
    runtime = runtimes.OnnxRuntimeUNet(
        runtimes.onnxruntime_session(proto.SerializeToString(), device=torch.device("cpu")), io=IO
    )
    assert runtime.provider == "CPUExecutionProvider"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 16, 1, 4, generator=g).permute(3, 2, 0, 1)  # (4, 1, 16, 16), not contiguous
    t = torch.tensor([0, 10, 25, 49], dtype=torch.int32)  # another integer dtype
    first = runtime(x, t)
    kept = first.clone()
    second = runtime(x.flip(0), t.flip(0))
    assert torch.equal(first, kept)  # the next call writes a new tensor, not the one handed out
    with torch.no_grad():
        torch.testing.assert_close(first, model(x.contiguous(), t.long()), rtol=0, atol=1e-4)
        torch.testing.assert_close(second, model(x.flip(0).contiguous(), t.flip(0).long()), rtol=0, atol=1e-4)


@needs_onnx
def test_onnxruntime_implementation_draws_the_original_images(random_onnx):
    model, proto = random_onnx
    runtime = runtimes.OnnxRuntimeUNet(
        runtimes.onnxruntime_session(proto.SerializeToString(), device=torch.device("cpu")), io=IO
    )
    plan = NoiseSchedule(SCHEDULE).make_plan("ddpm", sampling_steps=6)
    ours = original_sample(runtime, plan, shape=(3, 1, 16, 16), generator=torch.Generator().manual_seed(1))
    reference = original_sample(model, plan, shape=(3, 1, 16, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)


@needs_onnx
def test_cli_exports_of_a_trained_checkpoint_match_pytorch(workdir, exported):
    assert "onnx.checker passed" in exported["onnx"]
    for report in exported.values():  # the CLI's own comparison, at batch sizes 1, 3 and 8
        diff = float(re.search(r"max abs diff ([0-9.e+-]+) at batch sizes 1, 3, 8", report).group(1))
        assert diff < 1e-4, report
    # Independently of the CLI's own report: the files against the checkpoint's EMA U-Net.
    model, _ = checkpoints.load_checkpoint_model(workdir / "ck.pt")
    onnx_model = artifacts.load_artifact(workdir / "ck.onnx", device=torch.device("cpu")).model
    script = artifacts.load_artifact(workdir / "ck.ts", device=torch.device("cpu"), trust_torchscript=True).model
    assert unet_io.max_abs_diff(onnx_model, model, io=IO, batch_sizes=(1, 4, 7), seed=5) < 1e-4
    assert unet_io.max_abs_diff(script, model, io=IO, batch_sizes=(2,), seed=5) < 1e-5
    x_t, t = IO.example_inputs(4, generator=torch.Generator().manual_seed(5))
    assert model(x_t, t).abs().max() > 1e-2  # the trained eps is not trivially zero


SAMPLING_RUNS = {  # name: (file in workdir, implementation)
    "checkpoint": ("ck.pt", "original"),
    "torchscript": ("ck.ts", "original"),
    "onnx": ("ck.onnx", "onnxruntime"),
    "checkpoint_onnxruntime": ("ck.pt", "onnxruntime"),  # exported in memory
}


def sampled(capsys, workdir: Path, name: str) -> np.ndarray:
    """The images ``python main.py --mode sample`` draws from SAMPLING_RUNS[name] (DDPM, 5 steps, seed 7)."""
    artifact, implementation = SAMPLING_RUNS[name]
    npz = workdir / f"{name}.npz"
    trust = ["--trust_torchscript"] if artifact.endswith(".ts") else []
    rc, _, err = run_cli(
        capsys,
        "--mode",
        "sample",
        "--model_path",
        str(workdir / artifact),
        "--implementation",
        implementation,
        "--sampler",
        "ddpm",
        "--sampling_steps",
        "5",
        "--n_samples",
        "3",
        "--seed",
        "7",
        "--output",
        str(workdir / f"{name}.png"),
        "--save_npz",
        str(npz),
        *trust,
    )
    assert rc == 0, err
    return np.load(npz)["images"].astype(np.int16)


@needs_onnx
@pytest.mark.parametrize(
    "name",
    ["torchscript", "onnx", pytest.param("checkpoint_onnxruntime", marks=pytest.mark.slow)],  # the last: an export
)
def test_sampling_from_every_artifact_gives_the_checkpoints_images(workdir, exported, capsys, name):
    reference = sampled(capsys, workdir, "checkpoint")
    assert reference.std() > 10  # real images, not a constant
    assert np.abs(sampled(capsys, workdir, name) - reference).max() <= 1  # uint8 rounding of float-tolerance values


def test_onnxruntime_prefers_the_gpu_providers_where_installed():
    gpu_build = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert runtimes.onnxruntime_providers(gpu_build, device_type="cpu") == ["CPUExecutionProvider"]
    chosen = runtimes.onnxruntime_providers(gpu_build, device_type="cuda", trt_cache_dir=Path("cache"))
    assert [p if isinstance(p, str) else p[0] for p in chosen] == gpu_build
    assert chosen[0][1]["trt_engine_cache_enable"]  # TensorRT's provider builds engines: cache them
    assert chosen[1][1]["use_tf32"] == "0"  # the fp32 rows compute true fp32, like the original
    assert runtimes.onnxruntime_providers(["CPUExecutionProvider"], device_type="cuda") == ["CPUExecutionProvider"]


# ----- errors ----------------------------------------------------------------------------------------


@pytest.fixture
def no_tensorrt(monkeypatch):
    """TensorRT absent, even on a machine that has it (None in sys.modules makes the import fail)."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)


@pytest.mark.parametrize(
    "args,match",
    [
        (["--mode", "sample", "--implementation", "tensorrt"], "pip install tensorrt"),
        (
            ["--mode", "sample", "--implementation", "tensorrt", "--trt_backend", "torch_tensorrt"],
            "pip install torch-tensorrt",
        ),
        (["--mode", "export", "--format", "tensorrt"], "pip install tensorrt"),
        (["--mode", "sample", "--model_path", "{work}/unet.engine"], "pip install tensorrt"),
    ],
)
def test_without_tensorrt_each_tensorrt_path_names_what_to_install(workdir, capsys, no_tensorrt, args, match):
    (workdir / "unet.engine").write_bytes(b"not run")
    args = [a.format(work=workdir) for a in args]
    if "--model_path" not in args:
        args += ["--model_path", str(workdir / "ck.pt")]
    assert_one_line_error(*run_cli(capsys, *args)[::2], match)


@pytest.mark.parametrize(
    "name,content,match",
    [
        pytest.param("bad.onnx", b"\x08\x07 not protobuf", "corrupt or not an ONNX model", marks=needs_onnx),
        ("bad.ts", b"PK\x03\x04 truncated zip", "corrupt or not a TorchScript file"),
        ("bad.bin", b"", "or a file ending in"),
    ],
)
def test_a_corrupt_artifact_is_a_one_line_error(workdir, capsys, name, content, match):
    (workdir / name).write_bytes(content)
    trust = ["--trust_torchscript"] if name.endswith(".ts") else []  # without it, a .ts is refused unread
    rc, _, err = run_cli(capsys, "--mode", "sample", "--model_path", str(workdir / name), *trust)
    assert_one_line_error(rc, err, match)


def test_an_implementation_that_cannot_run_an_artifact_is_a_one_line_error(workdir, capsys):
    (workdir / "x.onnx").write_bytes(b"")
    rc, _, err = run_cli(
        capsys, "--mode", "sample", "--model_path", str(workdir / "x.onnx"), "--implementation", "cuda"
    )
    assert_one_line_error(rc, err, "cannot run ONNX files")


def test_a_kernel_onnxruntime_lacks_is_named_as_such():
    error = "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for Conv(22) node with name c"
    cpu = torch.device("cpu")
    line = runtimes.missing_kernel_line(error, name="m.onnx", precision="bf16", device=cpu)
    assert line.startswith("m.onnx is a bf16 graph, and onnxruntime here has no bf16 Conv kernel on the CPU")
    assert "opset 22" in runtimes.missing_kernel_line(error, name="m.onnx", precision=None, device=cpu)
    other = "[ONNXRuntimeError] : 7 : INVALID_PROTOBUF : Load model failed"
    assert runtimes.missing_kernel_line(other, name="m.onnx", precision="bf16", device=cpu) is None
