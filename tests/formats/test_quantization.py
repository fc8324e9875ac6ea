"""INT8 Q/DQ U-Nets (ddpm/formats/quantization.py): the graph's structure, the calibration, the quality
onnxruntime's INT8 kernels keep, the export, the TensorRT build plans, and what is refused."""

from __future__ import annotations

import copy
import errno
import json
import os
import tempfile

import numpy as np
import pytest
import torch
from helpers import assert_user_error, needs_onnx, perturbed_unet, run_here, tiny_unet_config

from basic_diffusion import sample
from ddpm.backends.runtimes import OnnxRuntimeUNet, onnxruntime_session
from ddpm.benchmarks.report import psnr_db
from ddpm.formats import exporters, quantization, unet_io
from ddpm.formats.checkpoints import save_checkpoint
from ddpm.formats.engine_cache import build_plan, torch_tensorrt_arguments
from noise_schedule import NoiseSchedule, ScheduleConfig

pytestmark = needs_onnx
# One level (it exports in about half the time); the middle block's attention keeps matmuls in the graph.
CONFIG = tiny_unet_config(image_size=8, norm_groups=8, channel_mult=(1,), attention_resolutions=(), dropout=0.0)
SCHEDULE = ScheduleConfig(num_timesteps=100)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny digits model trained for 60 steps (its activations those of a real model, not of an init), its
    checkpoint, and its fp32 graph."""
    from ddpm.data.datasets import load_images
    from ddpm.training.trainer import TrainConfig, Trainer

    work = tmp_path_factory.mktemp("int8")
    images = load_images("digits", data_dir=work, image_size=8)
    config = TrainConfig(
        dataset="digits",
        total_steps=60,
        batch_size=32,
        lr=3e-3,
        warmup_steps=10,
        ema_decay=0.9,
        checkpoint=str(work / "ck.pt"),
        save_every=0,
        sample_every=0,
    )
    torch.set_num_threads(1)
    trainer = Trainer(config, CONFIG, SCHEDULE, images=images, device="cpu")
    for _ in range(config.total_steps):
        trainer.train_step()
    trainer.save()
    model = trainer.ema.eval()
    metadata = unet_io.artifact_metadata(model_config=CONFIG, schedule_config=SCHEDULE, weights="ema")
    return work, model, exporters.export_onnx_model(model, metadata=metadata)


def quantized(model, proto, *, sampler="ddim", steps=10, samples=8):
    plan = NoiseSchedule(SCHEDULE).make_plan(sampler, sampling_steps=steps)
    feeds = list(quantization.calibration_feeds(model, plan, samples=samples))
    return quantization.quantize_unet(proto, feeds), feeds


def test_the_graph_quantizes_every_inner_convolution_per_channel_and_keeps_the_rest_fp32(trained):
    import onnx
    from onnx import numpy_helper

    _, model, proto = trained
    q, _ = quantized(model, proto)
    onnx.checker.check_model(q, full_check=True)
    onnx.shape_inference.infer_shapes(q, strict_mode=True)
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    dequantized = {n.output[0]: n for n in q.graph.node if n.op_type == "DequantizeLinear"}
    convs = [n for n in q.graph.node if n.op_type == "Conv"]
    conv_weights = {name for name, _ in model.named_parameters() if name.endswith(".weight") and _.ndim == 4}
    quantized_weights = set()
    for conv in convs:
        weight = conv.input[1]
        if weight in dequantized:  # DQ(int8 weight, per-channel scale, zero point 0) -> Conv
            dq = dequantized[weight]
            w, scale, zero = (inits[i] for i in dq.input)
            assert w.dtype == np.int8 and zero.dtype == np.int8 and not zero.any()
            assert scale.shape == (w.shape[0],)  # one scale per output channel
            assert conv.input[0] in dequantized  # and its activation quantized per tensor
            assert inits[dequantized[conv.input[0]].input[1]].shape == ()
            quantized_weights.add(dq.input[0].removesuffix("_quantized"))
        else:
            quantized_weights.discard(weight)
            assert weight in ("conv_in.weight", "conv_out.weight"), weight
    assert quantized_weights == conv_weights - {"conv_in.weight", "conv_out.weight"}
    # The time MLP, the attention matmuls and softmax, GroupNorm take fp32 weights and run in fp32.
    for node in q.graph.node:
        if node.op_type in ("Gemm", "MatMul", "Softmax", "Sin", "Cos"):
            assert not any(i in dequantized for i in node.input), node.name
        if node.op_type == "GroupNormalization":
            assert node.input[1] not in dequantized and node.input[2] not in dequantized
    assert all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for v in (q.graph.input[0], q.graph.output[0]))


def test_calibration_sees_the_samplers_own_inputs_and_sets_ranges_from_them(trained):
    """The feeds are the U-Net's inputs along the sampler's trajectories (every timestep of the plan), and a
    quantized activation's scale is its range over them: checked against a float64 run of the model."""
    _, model, proto = trained
    plan = NoiseSchedule(SCHEDULE).make_plan("ddim", sampling_steps=10)
    q, feeds = quantized(model, proto)
    assert [int(f["t"][0]) for f in feeds] == plan.timesteps.tolist()
    x_T = torch.randn(CONFIG.sample_shape(8), generator=torch.Generator().manual_seed(0))
    assert np.array_equal(feeds[0]["x_t"], x_T.numpy())
    # The first quantized convolution's input: SiLU(GroupNorm(conv_in(x_t))), in float64 over every feed.
    seen = []
    reference = copy.deepcopy(model).double()
    hook = (
        reference.down[0]
        .blocks[0]
        .conv1.register_forward_pre_hook(lambda m, args: seen.append(args[0].abs().max().item()))
    )
    with torch.no_grad():
        for f in feeds:
            reference(torch.from_numpy(f["x_t"]).double(), torch.from_numpy(f["t"]))
    hook.remove()
    absmax = max(seen)
    conv = next(
        n for n in q.graph.node if n.op_type == "Conv" and n.input[1].startswith("down.0.blocks.0.conv1.weight")
    )
    dq = next(n for n in q.graph.node if n.output[0] == conv.input[0])
    from onnx import numpy_helper

    scale = numpy_helper.to_array(next(t for t in q.graph.initializer if t.name == dq.input[1])).item()
    assert scale == pytest.approx(absmax / 127, rel=1e-4)  # symmetric int8: [-absmax, absmax] onto [-127, 127]


class _Counting(torch.nn.Module):
    """The model, counting its calls and the largest batch it was given."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.config, self.calls, self.largest = model, model.config, 0, 0

    def forward(self, x, t, y=None):
        self.calls, self.largest = self.calls + 1, max(self.largest, x.shape[0])
        return self.model(x, t) if y is None else self.model(x, t, y)


def test_calibration_runs_its_trajectories_a_batch_at_a_time_as_the_quantizer_reads_them(trained):
    _, model, _ = trained
    plan = NoiseSchedule(SCHEDULE).make_plan("ddim", sampling_steps=3)
    counting = _Counting(model)
    feeds = quantization.calibration_feeds(counting, plan, samples=20, batch_size=8)
    assert counting.calls == 0  # nothing runs until the quantizer asks
    first = next(feeds)
    assert counting.calls == 3 and first["x_t"].shape[0] == 8  # one batch's trajectory, no more
    rest = list(feeds)
    assert [f["x_t"].shape[0] for f in [first, *rest]] == [8] * 3 + [8] * 3 + [4] * 3
    assert counting.largest == 8 and counting.calls == 9
    with pytest.raises(ValueError, match="--batch_size must be a positive integer"):
        next(quantization.calibration_feeds(model, plan, samples=4, batch_size=0))


def test_out_of_memory_while_calibrating_names_the_flag_that_applies(trained, monkeypatch):
    from ddpm.modes.export import quantize_export
    from ddpm.requests import Calibration

    _, model, proto = trained

    def exhausted(proto, feeds, **_):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(quantization, "quantize_unet", exhausted)
    calibration = Calibration(sampler="ddim", sampling_steps=2, samples=512, batch_size=256)
    with pytest.raises(ValueError, match="calibrating on batches of 256 trajectories; lower --batch_size") as info:
        quantize_export(proto, model, SCHEDULE, calibration=calibration, precision="int8")
    assert "--n_samples" not in str(info.value)


# Peak resident memory of a fresh process after calibrating on (samples, batch): VmHWM, its own address space's peak
# (ru_maxrss also counts the parent's resident memory when it forked, which hid every peak under a large pytest).
_CALIBRATION_PEAKS = """
import json, torch
from helpers import perturbed_unet, tiny_unet_config
from ddpm.formats import exporters, quantization, unet_io
from noise_schedule import NoiseSchedule, ScheduleConfig
torch.set_num_threads(1)
schedule = ScheduleConfig(num_timesteps=50)
config = tiny_unet_config(image_size=16, norm_groups=8, attention_resolutions=(), model_channels=32)
model = perturbed_unet(config)
metadata = unet_io.artifact_metadata(model_config=config, schedule_config=schedule, weights="ema")
proto = exporters.export_onnx_model(model, metadata=metadata)
plan = NoiseSchedule(schedule).make_plan("ddim", sampling_steps=2)
peaks = []
for samples, batch_size in ((8, 8), (64, 8), (64, 64)):
    feeds = quantization.calibration_feeds(model, plan, samples=samples, batch_size=batch_size)
    quantization.quantize_unet(proto, feeds)
    status = open("/proc/self/status").read()
    peaks.append(int(status.split("VmHWM:")[1].split()[0]) / 1024)  # KiB
print(json.dumps(peaks))
"""


@pytest.mark.slow  # three calibrations of a 16x16 U-Net in a fresh process: about 20 seconds on 2 cores
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
def test_calibration_memory_is_flat_in_the_number_of_trajectories():
    """After calibrating on 8 trajectories, then on 64 in batches of 8: the same batch, so no new peak; 64 in one
    batch (what --batch_size 64 asks) lifts it by about 190 MiB. In a process of its own, whose peak no earlier test
    has raised."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    result = subprocess.run(
        [sys.executable, "-c", _CALIBRATION_PEAKS], cwd=tests.parent, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    base, batched, whole = json.loads(result.stdout.strip().splitlines()[-1])
    assert batched - base < 40
    assert whole - base > 80  # the measure sees a batch 8 times larger


def test_onnxruntime_int8_draws_nearly_the_fp32_models_images(trained, one_thread):
    _, model, proto = trained
    q, _ = quantized(model, proto, sampler="dpm_solver", steps=10, samples=16)
    runtime = OnnxRuntimeUNet(
        onnxruntime_session(q.SerializeToString(), device=torch.device("cpu")), io=unet_io.UNetIO.from_config(CONFIG)
    )
    plan = NoiseSchedule(SCHEDULE).make_plan("dpm_solver", sampling_steps=10)
    images = [
        sample(unet, plan, shape=CONFIG.sample_shape(16), generator=torch.Generator().manual_seed(3))
        for unet in (model, runtime)
    ]
    psnr = psnr_db(images[1], images[0])
    # On this model (onnxruntime 1.31.1, CPU): 41.2 dB; calibrated on inputs scaled by 0.02
    # (activation ranges far too narrow: clipped) 24.2 dB; an fp32 export gives over 100 dB.
    assert psnr >= 35.0, psnr


def test_the_export_writes_a_quantized_file_with_its_calibration_and_quality_that_samples(trained, one_thread):
    work, _, _ = trained
    args = [
        "--mode",
        "export",
        "--format",
        "onnx",
        "--precision",
        "int8",
        "--model_path",
        "ck.pt",
        "--sampler",
        "ddim",
        "--sampling_steps",
        "8",
        "--calibration_samples",
        "4",
    ]
    result = run_here(*args, cwd=work)
    assert result.returncode == 0, result.stderr
    assert "PSNR" in result.stdout and (work / "ck_int8.onnx").is_file()
    # The calibration's estimate, said before it starts (util/estimates.py).
    assert "calibration: 4 ddim trajectories of 8 steps: 32 U-Net calls, about " in result.stdout, result.stdout
    import onnx

    meta = json.loads(
        next(p.value for p in onnx.load(work / "ck_int8.onnx").metadata_props if p.key == unet_io.METADATA_KEY)
    )
    assert meta["precision"] == "int8"
    q = meta["quantization"]
    assert q["calibration"] == {"sampler": "ddim", "steps": 8, "trajectories": 4, "seed": 0}
    assert q["quality"]["psnr_db_vs_fp32"] > 20
    draw = ["--mode", "sample", "--n_samples", "2", "--sampler", "ddim", "--sampling_steps", "4", "--no_grid"]
    result = run_here(
        *draw, "--model_path", "ck_int8.onnx", "--implementation", "onnxruntime", "--save_npz", "q.npz", cwd=work
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (["--mode", "export", "--precision", "fp8"], "TensorRT is not installed here"),
        (["--mode", "export", "--format", "torchscript", "--precision", "int8"], "is written into an ONNX graph"),
        (
            ["--mode", "export", "--precision", "int8", "--calibration_samples", "0"],
            "--calibration_samples must be between 1",
        ),
        (["--mode", "export", "--calibration_samples", "4"], "pass --precision int8 or fp8"),
        (["--mode", "sample", "--precision", "int8", "--implementation", "cuda"], "use --implementation onnxruntime"),
        (["--mode", "sample", "--calibration_samples", "4"], "calibrates an INT8 export"),
        (["--mode", "train", "--dataset", "digits", "--precision", "int8"], "training runs in fp32, bf16 or fp16"),
    ],
)
def test_what_cannot_run_or_means_nothing_is_refused_in_one_line(tmp_path, args, named):
    model = tiny_unet_config(image_size=8, norm_groups=8)
    from basic_diffusion import UNet

    state = UNet(model).state_dict()
    save_checkpoint(
        tmp_path / "ck.pt",
        {
            "format_version": 1,
            "model_config": model.to_dict(),
            "schedule_config": vars(SCHEDULE),
            "model": state,
            "ema": state,
            "step": 0,
        },
    )
    assert_user_error(run_here(*args, "--model_path", "ck.pt", cwd=tmp_path), named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


def full_tmpdir_line(folder) -> str:
    return (
        f"cannot write the INT8 calibration's temporary files in {folder} (TMPDIR): No space left on device; no file "
        "was created and nothing partial was left"
    )


def test_a_full_temporary_folder_ends_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """Found by the adversarial pass: the quantizer's files in a full TMPDIR ended in onnx's traceback ("DecodeError:
    Wire format was corrupt": its C++ shape inference stops writing short without a word); now the one line of every
    refused write, exit 2, and neither the export nor the temporary folder is left."""
    model = tiny_unet_config(image_size=8, norm_groups=8, channel_mult=(1,), attention_resolutions=())
    state = perturbed_unet(model).state_dict()
    save_checkpoint(
        tmp_path / "ck.pt",
        {"format_version": 1, "model_config": model.to_dict(), "schedule_config": vars(SCHEDULE)}
        | {"model": state, "ema": state, "step": 0},
    )
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    def cut_short(source, target, *args, **kwargs):  # what onnx's shape inference leaves on a full disk
        with open(target, "wb") as f:
            f.write(b"\x08\x0a\x12")
        monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 256, 0, 0, 64, 0, 0, 0, 255)))

    monkeypatch.setattr(quantization.import_quantizer(), "quantize_static", cut_short)
    args = ["--precision", "int8", "--calibration_samples", "2", "--sampler", "ddim", "--sampling_steps", "2"]
    result = run_here("--mode", "export", "--model_path", "ck.pt", "--output", "q.onnx", *args, cwd=tmp_path)
    assert_user_error(result, full_tmpdir_line(tmp_path / "tmp"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "tmp"]
    assert not list((tmp_path / "tmp").glob("ddpm-int8-*"))


def test_a_full_temporary_folder_met_by_onnx_save_names_no_temporary_file(tmp_path, monkeypatch):
    """onnx.save's own OSError named the temporary file, in a folder already removed: the same one line instead."""
    import onnx
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in ("x", "y")]
    proto = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", io[:1], io[1:]))

    def refused(proto, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(onnx, "save", refused)
    with pytest.raises(OSError) as info:
        quantization.quantize_unet(proto, [])
    assert str(info.value) == full_tmpdir_line(tmp_path) and not list(tmp_path.iterdir())


def test_tensorrt_builds_quantized_graphs_explicitly_and_strongly_typed():
    for version in ("10.9.0", "10.11.0", "10.12.0", "11.0.0"):
        for precision in ("int8", "fp8"):
            plan = build_plan(version, precision)
            assert plan.strongly_typed and plan.graph_precision == precision and plan.builder_flags == ()
            assert not plan.pin_time_embedding and plan.opset == unet_io.DEFAULT_OPSET
    with pytest.raises(ValueError, match="GroupNormalization-21"):
        build_plan("10.8.0", "int8")
    with pytest.raises(ValueError, match="drop --opset"):
        build_plan("11.0.0", "int8", opset=18)
    with pytest.raises(ValueError, match="built natively from the Q/DQ ONNX graph"):
        torch_tensorrt_arguments("2.10.0", "int8")


def test_fp8_needs_tensorrt_and_compute_capability_8_9():
    problem = quantization.fp8_runtime_problem
    assert "not installed" in problem(tensorrt_available=False, compute_capability=(9, 0))
    assert "8.9 and newer" in problem(tensorrt_available=True, compute_capability=(8, 0))
    assert "no GPU" in problem(tensorrt_available=True, compute_capability=None) or torch.cuda.is_available()
    assert problem(tensorrt_available=True, compute_capability=(8, 9)) is None
    assert problem(tensorrt_available=True, compute_capability=(9, 0)) is None
