"""Reduced precision written into the model and its ONNX graph (what strongly typed TensorRT builds).

Specification: the mixed-precision U-Net leaves the original untouched and stays close to it; its
fp16 and bf16 ONNX graphs pass onnx.checker and strict shape inference, compute the timestep
embedding, normalization and softmax in float32 and the convolutions and matmuls in the low
precision, keep float32 inputs and output; onnxruntime runs the fp16 graph like PyTorch runs the
mixed-precision U-Net; the CLI exports a mixed-precision ONNX file that onnxruntime samples from.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from helpers import needs_onnx, perturbed_unet

import main
from basic_diffusion import UNet, UNetConfig
from ddpm.backends import runtimes
from ddpm.formats import exporters, unet_io
from ddpm.util.precision import CastInput, Float32, mixed_precision_unet

CONFIG = UNetConfig(
    image_size=8,
    in_channels=1,
    model_channels=16,
    channel_mult=(1,),  # one level: the middle block's attention still puts a softmax and matmuls in the graph
    num_res_blocks=1,
    attention_resolutions=(),
    num_heads=2,
    dropout=0.0,
    norm_groups=8,
)
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def random_unet() -> UNet:
    return perturbed_unet(CONFIG)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_mixed_precision_unet_follows_autocasts_policy_and_leaves_the_original(precision):
    model = random_unet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mixed = mixed_precision_unet(model, precision)
    assert all(torch.equal(before[k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    unet = mixed.unet
    assert all(p.dtype == torch.float32 for p in unet.time_mlp.parameters())  # the time embedding's MLP
    assert isinstance(unet.conv_in, CastInput) and unet.conv_in.inner.weight.dtype == LOW[precision]
    assert isinstance(unet.mid_block1.norm1, Float32) and unet.mid_block1.norm1.inner.weight.dtype == torch.float32
    assert isinstance(unet.mid_block1.emb_proj, CastInput) and unet.mid_attention.float32_softmax
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([999, 500, 0])
    with torch.no_grad():
        eps, reference = mixed(x, t), model(x, t)
    assert eps.dtype == torch.float32
    # Low-precision operands: fp16 keeps ~3 decimal digits, bf16 ~2 (METHOD: 1e-3 to 1e-2).
    assert relative_error(eps, reference) < {"fp16": 5e-3, "bf16": 3e-2}[precision]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_bf16_graph_needs_opset_22(precision):
    if precision == "bf16":
        with pytest.raises(ValueError, match="opset 22"):
            exporters.export_onnx_model(random_unet(), metadata={}, opset=21, precision="bf16")
    assert unet_io.default_opset(precision) == (22 if precision == "bf16" else 21)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(folder, EMA U-Net, what the CLI printed): m.pt, a checkpoint of CONFIG trained a few steps at a high rate, so
    eps is not zero, and m16.onnx and m_bf16.onnx, the CLI's fp16 and bf16 exports of it (an export takes seconds: the
    graph tests read them)."""
    from ddpm.data.datasets import ImageSet
    from ddpm.formats.checkpoints import load_checkpoint_model
    from ddpm.training.trainer import TrainConfig, Trainer
    from noise_schedule import ScheduleConfig

    work = tmp_path_factory.mktemp("precision")
    ckpt = work / "m.pt"
    config = TrainConfig(
        dataset="random",
        total_steps=3,
        batch_size=4,
        lr=3e-3,
        warmup_steps=0,
        ema_decay=0.5,
        save_every=0,
        sample_every=0,
        checkpoint=str(ckpt),
    )
    images = ImageSet(
        "random", torch.randint(0, 256, (8, 1, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    )
    trainer = Trainer(config, CONFIG, ScheduleConfig(num_timesteps=20), images=images, device="cpu")
    for _ in range(config.total_steps):
        trainer.train_step()
    trainer.save()
    export = ["--device", "cpu", "--mode", "export", "--format", "onnx"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for precision, name in (("fp16", "m16.onnx"), ("bf16", "m_bf16.onnx")):
            rc = main.main([*export, "--precision", precision, "--model_path", str(ckpt), "--output", str(work / name)])
            assert rc == 0
    return work, load_checkpoint_model(ckpt)[0], out.getvalue()


@pytest.fixture(scope="module")
def graphs(trained) -> dict:
    """The fp16 and bf16 graphs the CLI wrote."""
    import onnx

    work = trained[0]
    return {"fp16": onnx.load(work / "m16.onnx"), "bf16": onnx.load(work / "m_bf16.onnx")}


def tensor_types(proto) -> tuple[dict[str, int], object]:
    """Every value's element type after strict shape inference, and the inferred model."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types.update({init.name: init.data_type for init in graph.initializer})
    return types, inferred


@needs_onnx
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_graph_computes_the_time_embedding_norms_and_softmax_in_fp32(graphs, precision):
    import onnx
    from onnx import TensorProto

    proto = graphs[precision]
    onnx.checker.check_model(proto, full_check=True)
    types, inferred = tensor_types(proto)
    low = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}[precision]
    nodes = inferred.graph.node
    by_type = {}
    for node in nodes:
        by_type.setdefault(node.op_type, []).append(node)
    for op in ("Sin", "Cos", "Softmax", "GroupNormalization"):
        assert by_type.get(op), f"no {op} in the graph"
        for node in by_type[op]:
            assert {types[name] for name in node.input if name} == {TensorProto.FLOAT}, (op, node.name)
    for node in by_type["Conv"]:
        assert types[node.input[1]] == low, node.name  # the weights, in the low precision
    assert {types[node.input[0]] for node in by_type["MatMul"]} == {low}  # attention's QK^T and AV
    assert [types[v.name] for v in inferred.graph.input] == [TensorProto.FLOAT, TensorProto.INT64]
    assert [types[v.name] for v in inferred.graph.output] == [TensorProto.FLOAT]
    assert json.loads(proto.metadata_props[0].value)["precision"] == precision


@needs_onnx
def test_onnxruntime_runs_the_fp16_graph_like_pytorch_runs_the_mixed_unet(trained, graphs):
    _, model, _ = trained
    session = runtimes.onnxruntime_session(graphs["fp16"].SerializeToString(), device=torch.device("cpu"))
    runtime = runtimes.OnnxRuntimeUNet(session, io=unet_io.UNetIO.from_config(CONFIG))
    x, t = torch.randn(4, 1, 8, 8), torch.tensor([999, 600, 20, 0])
    with torch.no_grad():
        eps, mixed, reference = runtime(x, t), mixed_precision_unet(model, "fp16")(x, t), model(x, t)
    assert relative_error(eps, mixed) < 5e-3  # the same fp16 arithmetic, other kernels
    assert 1e-6 < relative_error(eps, reference) < 5e-3  # close to fp32, and not computed in it


@needs_onnx
def test_the_cli_exports_an_fp16_graph_that_onnxruntime_samples_from(trained, tmp_path, capsys):
    work, _, out = trained  # the export ran in the fixture
    ckpt, onnx_path = work / "m.pt", work / "m16.onnx"
    assert "fp16, opset 21" in out and "mixed-precision" in out
    rc = main.main(
        [
            "--device",
            "cpu",
            "--mode",
            "sample",
            "--model_path",
            str(onnx_path),
            "--implementation",
            "onnxruntime",
            "--sampler",
            "ddim",
            "--sampling_steps",
            "3",
            "--n_samples",
            "2",
            "--output",
            str(tmp_path / "g.png"),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    rc = main.main(
        [
            "--device",
            "cpu",
            "--mode",
            "export",
            "--format",
            "torchscript",
            "--precision",
            "fp16",
            "--model_path",
            str(ckpt),
            "--output",
            str(tmp_path / "m.ts"),
        ]
    )
    assert rc == 2 and "fp32 weights" in capsys.readouterr().err


@needs_onnx
def test_the_tools_own_bf16_onnx_export_is_sampled_or_refused_for_what_onnxruntime_lacks_never_called_corrupt(
    trained, tmp_path, capsys
):
    work = trained[0]  # the CLI's bf16 export ran in the fixture
    draw = ["--sampler", "ddim", "--sampling_steps", "2", "--n_samples", "2", "--no_grid"]
    rc = main.main(["--device", "cpu", "--mode", "sample", "--model_path", str(work / "m_bf16.onnx"), *draw,
                    "--save_npz", str(tmp_path / "bf16.npz")])  # fmt: skip
    err = capsys.readouterr().err
    if rc != 0:  # onnxruntime's CPU provider has no bf16 convolution: a refusal that says so
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("main.py: error:"), err
        assert "is a bf16 graph, and onnxruntime here has no bf16 Conv kernel on the CPU" in lines[0]
        assert "corrupt" not in err
