"""Export and the onnxruntime / tensorrt implementations, specified against PyTorch.

Specification: the ONNX export (random weights and a trained checkpoint) agrees with PyTorch through
onnxruntime at several batch sizes, and so does the TorchScript trace; sampling from a checkpoint,
its TorchScript and ONNX exports, and with --implementation onnxruntime gives the checkpoint's images
from one seed; the tensorrt implementation's step loop reproduces the original loop exactly (a
PyTorch U-Net stands in for the engine: no engine runs here); the engine cache rebuilds on any
metadata difference and refuses an engine whose sha256 differs; without TensorRT every TensorRT
path ends in one line naming what to install, and importing the project never imports it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_SCHEDULE, needs_onnx, perturbed_unet, tiny_unet_config

import main
import tensorrt_integration as trt_integration
from basic_diffusion import UNet
from basic_diffusion import sample as original_sample
from ddpm.backends import artifacts, engine_cache, runtimes
from ddpm.data.datasets import load_images
from ddpm.formats import checkpoints, exporters, unet_io
from ddpm.formats.unet_io import BatchRange, UNetIO
from ddpm.training.trainer import TrainConfig, Trainer
from noise_schedule import NoiseSchedule
from optimized_diffusion import FusedSampler

ROOT = Path(__file__).resolve().parents[1]
CONFIG, SCHEDULE = tiny_unet_config(), TINY_SCHEDULE
IO = UNetIO.from_config(CONFIG)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def random_onnx() -> tuple[UNet, object]:
    model = perturbed_unet(CONFIG)
    metadata = unet_io.artifact_metadata(model_config=CONFIG, schedule_config=SCHEDULE, weights="ema")
    return model, exporters.export_onnx_model(model, metadata=metadata)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A checkpoint trained for a few steps (high LR, so the weights leave their init), and its exports."""
    work = tmp_path_factory.mktemp("export")
    images = load_images("digits", data_dir=work, image_size=CONFIG.image_size)
    config = TrainConfig(dataset="digits", total_steps=6, batch_size=8, lr=3e-3, warmup_steps=0, ema_decay=0.5,
                         checkpoint=str(work / "ck.pt"), save_every=0, sample_every=0)  # fmt: skip
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
    plan = NoiseSchedule(SCHEDULE).make_plan("ddpm", num_steps=6)
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


@needs_onnx
def test_sampling_from_every_artifact_gives_the_checkpoints_images(workdir, exported, capsys):
    runs = {
        "checkpoint": ("ck.pt", "original"),
        "torchscript": ("ck.ts", "original"),
        "onnx": ("ck.onnx", "onnxruntime"),
        "checkpoint_onnxruntime": ("ck.pt", "onnxruntime"),  # exported in memory
    }
    images = {}
    for name, (artifact, implementation) in runs.items():
        npz = workdir / f"{name}.npz"
        trust = ["--trust_torchscript"] if artifact.endswith(".ts") else []
        rc, _, err = run_cli(
            capsys, "--mode", "sample", "--model_path", str(workdir / artifact), "--implementation", implementation,
            "--sampler", "ddpm", "--sampling_steps", "5", "--n_samples", "3", "--seed", "7",
            "--output", str(workdir / f"{name}.png"), "--save_npz", str(npz), *trust,
        )  # fmt: skip
        assert rc == 0, err
        images[name] = np.load(npz)["images"].astype(np.int16)
    assert images["checkpoint"].std() > 10  # real images, not a constant
    for name, pixels in images.items():
        assert np.abs(pixels - images["checkpoint"]).max() <= 1, name  # uint8 rounding of float-tolerance values


def test_onnxruntime_prefers_the_gpu_providers_where_installed():
    gpu_build = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert runtimes.onnxruntime_providers(gpu_build, device_type="cpu") == ["CPUExecutionProvider"]
    chosen = runtimes.onnxruntime_providers(gpu_build, device_type="cuda", trt_cache_dir=Path("cache"))
    assert [p if isinstance(p, str) else p[0] for p in chosen] == gpu_build
    assert chosen[0][1]["trt_engine_cache_enable"]  # TensorRT's provider builds engines: cache them
    assert chosen[1][1]["use_tf32"] == "0"  # the fp32 rows compute true fp32, like the original
    assert runtimes.onnxruntime_providers(["CPUExecutionProvider"], device_type="cuda") == ["CPUExecutionProvider"]


# ----- the tensorrt implementation's own logic (no engine runs here) ----------------------------------


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


def key(**changes) -> dict:
    environment = {"tensorrt_version": "10.9.0", "gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    fields = dict(environment=environment, onnx_sha256="ab" * 32, precision="fp16", profile=IO.profile(BatchRange()),
                  optimization_level=3)  # fmt: skip
    environment.update({k: v for k, v in changes.items() if k in environment})
    fields.update({k: v for k, v in changes.items() if k not in environment})
    return engine_cache.engine_key(**fields)


class FakeBuilder:
    """Counts builds; returns distinct bytes each time (no TensorRT involved)."""

    def __init__(self) -> None:
        self.builds = 0

    def __call__(self) -> bytes:
        self.builds += 1
        return f"serialized engine #{self.builds}".encode()


def test_engine_key_records_everything_an_engine_depends_on_as_json():
    stored = json.loads(json.dumps(key()))  # what a metadata file gives back
    assert engine_cache.key_mismatches(stored, key()) == []
    for field in ("tensorrt_version", "gpu_name", "compute_capability", "onnx_sha256", "precision",
                  "builder_optimization_level", "shapes"):  # fmt: skip
        assert field in stored
    assert stored["shapes"]["x_t"] == {"min": [1, 1, 16, 16], "opt": [16, 1, 16, 16], "max": [64, 1, 16, 16]}


@pytest.mark.parametrize(
    "change",
    [
        dict(tensorrt_version="10.10.0"),
        dict(gpu_name="NVIDIA H200"),
        dict(compute_capability="8.0"),
        dict(onnx_sha256="cd" * 32),
        dict(precision="fp32"),
        dict(profile=IO.profile(BatchRange(1, 16, 128))),
        dict(optimization_level=5),
    ],
)
def test_any_metadata_difference_rebuilds_the_engine(tmp_path, change):
    engine_path, build, logs = tmp_path / "unet_fp16.engine", FakeBuilder(), []
    first = engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=logs.append)
    again = engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=logs.append)
    assert first == again == b"serialized engine #1" and build.builds == 1  # a matching cache is reused
    rebuilt = engine_cache.get_or_build_engine(engine_path, key=key(**change), build=build, log=logs.append)
    assert rebuilt == b"serialized engine #2" and build.builds == 2
    assert "other settings" in logs[-1]
    meta = engine_cache.read_metadata(engine_cache.metadata_path(engine_path))
    assert engine_cache.key_mismatches(meta, key(**change)) == []  # the new metadata describes the new engine


def test_an_engine_whose_sha256_differs_is_refused_not_deserialized(tmp_path):
    engine_path, build = tmp_path / "unet_fp16.engine", FakeBuilder()
    engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=lambda _: None)
    engine_path.write_bytes(b"serialized engine #1, tampered with")
    with pytest.raises(engine_cache.IntegrityError, match="refusing to load"):
        engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=lambda _: None)
    assert build.builds == 1


def test_missing_or_corrupt_metadata_rebuilds(tmp_path):
    engine_path, build = tmp_path / "unet_fp16.engine", FakeBuilder()
    engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=lambda _: None)
    engine_cache.metadata_path(engine_path).write_text("{not json")
    engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=lambda _: None)
    engine_cache.metadata_path(engine_path).unlink()
    engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=lambda _: None)
    assert build.builds == 3


def test_a_crash_while_storing_leaves_a_rebuild_not_a_refusal(tmp_path, monkeypatch):
    engine_path, build = tmp_path / "unet_fp16.engine", FakeBuilder()
    engine_cache.get_or_build_engine(engine_path, key=key(), build=build, log=lambda _: None)

    def crash(path, write):
        raise OSError("disk full")

    monkeypatch.setattr(engine_cache, "atomic_write", crash)
    with pytest.raises(OSError):
        engine_cache.store_with_metadata(engine_path, b"new engine", key())
    monkeypatch.undo()
    assert engine_cache.lookup_engine(engine_path, key()).data is None  # rebuild, no IntegrityError


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


@pytest.mark.parametrize(
    "version,precision,strongly_typed,graph,flags,pin,opset",
    [
        ("10.8.0.43", "fp16", False, "fp32", ("FP16", "OBEY_PRECISION_CONSTRAINTS"), True, 18),  # no GroupNorm-21
        ("10.9.0.34", "fp16", False, "fp32", ("FP16", "OBEY_PRECISION_CONSTRAINTS"), True, 21),
        ("10.9.0.34", "fp32", False, "fp32", (), False, 21),
        ("10.11.0", "bf16", False, "fp32", ("BF16", "OBEY_PRECISION_CONSTRAINTS"), True, 21),
        ("10.12.0.36", "fp16", True, "fp16", (), False, 21),  # STRONGLY_TYPED from a mixed graph
        ("10.12.0.36", "bf16", True, "bf16", (), False, 22),  # bf16 convolutions need opset 22
        ("11.0.0", "fp32", True, "fp32", (), False, 21),
        ("11.4.1", "fp16", True, "fp16", (), False, 21),
        ("11.4.1", "bf16", True, "bf16", (), False, 22),
    ],
)  # fmt: skip
def test_the_engine_build_follows_the_tensorrt_version(version, precision, strongly_typed, graph, flags, pin, opset):
    plan = engine_cache.build_plan(version, precision)
    assert (plan.strongly_typed, plan.graph_precision, plan.builder_flags) == (strongly_typed, graph, flags)
    assert (plan.pin_time_embedding, plan.opset) == (pin, opset)
    # Nothing TensorRT 11 removed is ever asked of it.
    if version.startswith("11"):
        assert not {"FP16", "BF16", "OBEY_PRECISION_CONSTRAINTS"} & set(plan.builder_flags)


def test_opsets_a_tensorrt_version_cannot_parse_are_refused_in_one_line():
    assert engine_cache.build_plan("11.4.1", "fp16", opset=18).opset == 18  # an explicit choice is kept
    with pytest.raises(ValueError, match="opset 18"):
        engine_cache.build_plan("10.8.0", "fp32", opset=21)
    with pytest.raises(ValueError, match="opset 22"):
        engine_cache.build_plan("11.4.1", "bf16", opset=21)
    with pytest.raises(ValueError, match="too old"):
        engine_cache.build_plan("8.6.1", "fp32")


@pytest.mark.parametrize(
    "version,precision,mixed,arguments",
    [
        ("2.9.0", "fp32", False, {"enabled_precisions": {torch.float32}}),
        ("2.9.0+cu128", "fp16", True, {"use_explicit_typing": True, "enabled_precisions": {torch.float32}}),
        ("2.8.0", "bf16", True, {"use_explicit_typing": True, "enabled_precisions": {torch.float32}}),
        ("2.10.0", "fp16", True, {}),  # enabled_precisions raises on 2.10-2.12
        ("2.13.0", "bf16", True, {}),  # ... and is silently ignored on 2.13+
        ("2.14.1+cu130", "fp32", False, {}),
    ],
)  # fmt: skip
def test_torch_tensorrt_gets_the_arguments_its_version_honours(version, precision, mixed, arguments):
    assert engine_cache.torch_tensorrt_arguments(version, precision) == (mixed, arguments)


def test_an_old_torch_tensorrt_is_refused_for_reduced_precision_not_built_in_fp32():
    with pytest.raises(ValueError, match="upgrade"):
        engine_cache.torch_tensorrt_arguments("2.5.1", "fp16")
    assert engine_cache.torch_tensorrt_arguments("2.5.1", "fp32") == (False, {"enabled_precisions": {torch.float32}})


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
        ("bad.bin", b"", "expected a file ending in"),
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
