"""Latent diffusion through the whole tool: a U-Net trained on an autoencoder's latents, sampled and
decoded by each implementation, and the link between the two files.

Specification: latent train -> sample writes images of the autoencoder's size (not latents) and every
implementation that runs latent models draws the same images; the decoder run by onnxruntime matches
PyTorch's; a latent model refuses an autoencoder that is not the one it was trained with, or a missing
one, in one line and accepts --autoencoder pointing at the right file; a U-Net of latent channels with
no autoencoder is refused; the latents are fed to training as stored (not rescaled, not flipped); an
exported latent model (ONNX, TorchScript) carries its decoder beside it, draws the checkpoint's images, and
refuses a decoder file that is not the one it names.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import main
from ddpm.latent.autoencoder import Autoencoder, AutoencoderConfig, checkpoint_state
from ddpm.util.safe_files import atomic_write

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

AE_CONFIG = AutoencoderConfig(image_size=8, in_channels=1, latent_channels=2, downsample=2, base_channels=8)


def write_autoencoder(path, *, seed: int = 0, latent_scale: float = 1.5) -> None:
    torch.manual_seed(seed)
    model = Autoencoder(AE_CONFIG)
    state = checkpoint_state(model, latent_scale=latent_scale, dataset="digits", metrics={}, step=0)
    atomic_write(path, lambda f: torch.save(state, f))


@pytest.fixture(scope="module")
def latent_model(latent_export):
    """An autoencoder file (write_autoencoder's, seed 0) and a latent DDPM trained two steps on its latents of the
    offline digits, with their ONNX export (tests/conftest.py's, shared with other modules)."""
    folder, _ = latent_export
    return folder


def sample_args(folder, *extra: str) -> list[str]:
    return [
        "--device",
        "cpu",
        "--mode",
        "sample",
        "--model_path",
        str(folder / "lat.pt"),
        "--n_samples",
        "3",
        "--sampler",
        "dpm_solver_sde",
        "--sampling_steps",
        "3",
        "--output",
        str(folder / "s.png"),
        "--save_npz",
        str(folder / "s.npz"),
        *extra,
    ]


def test_a_latent_model_draws_decoded_images_alike_in_every_implementation(latent_model, capsys):
    pytest.importorskip("onnxruntime")
    drawn = {}
    # onnxruntime runs the model's ONNX export (conftest.py's: an export takes seconds); the conditional model's test
    # below draws through onnxruntime from a checkpoint, exported in memory.
    exported = ("--model_path", str(latent_model / "lat.onnx"))  # the last --model_path wins
    for implementation, extra in (("original", ()), ("cuda", ()), ("onnxruntime", exported)):
        args = sample_args(latent_model, "--implementation", implementation, *extra)
        assert main.main(args) == 0, capsys.readouterr().err
        with np.load(latent_model / "s.npz") as data:
            drawn[implementation] = data["images"].astype(int)
        assert (latent_model / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert drawn["original"].shape == (3, 8, 8, 1)  # the autoencoder's images, not its 2x4x4 latents
    for implementation in ("cuda", "onnxruntime"):
        assert np.abs(drawn[implementation] - drawn["original"]).max() <= 1  # uint8 levels
    assert main.main(sample_args(latent_model, "--implementation", "tensorrt", "--device", "cpu")) == 2
    assert "\n" not in capsys.readouterr().err.strip()


def test_a_latent_model_never_clips_its_unit_variance_latents(latent_model, capsys):
    drawn = []
    for extra in ((), ("--no_clip",)):
        assert main.main(sample_args(latent_model, *extra)) == 0, capsys.readouterr().err
        with np.load(latent_model / "s.npz") as data:
            drawn.append(data["images"])
    np.testing.assert_array_equal(drawn[0], drawn[1])


def test_the_autoencoder_is_an_input_a_training_run_cannot_overwrite(latent_model, tmp_path, capsys):
    autoencoder = tmp_path / "ae.pt"
    shutil.copy(latent_model / "ae.pt", autoencoder)
    before = autoencoder.read_bytes()
    train = [
        "--device",
        "cpu",
        "--mode",
        "train",
        "--dataset",
        "digits",
        "--autoencoder",
        str(autoencoder),
        "--model_path",
        str(autoencoder),
        "--overwrite",
        "--max_steps",
        "1",
    ]
    assert main.main(train) == 2
    assert "--autoencoder" in capsys.readouterr().err and autoencoder.read_bytes() == before
    # An autoencoder whose latents the U-Net preset cannot halve twice is refused before any data is read.
    assert (
        main.main(
            [
                "--mode",
                "train_autoencoder",
                "--dataset",
                "mnist",
                "--downsample",
                "2",
                "--model_path",
                str(tmp_path / "m.pt"),
                "--data_dir",
                str(tmp_path / "none"),
            ]
        )
        == 2
    )
    assert "14x14 latent" in capsys.readouterr().err


def test_the_decoder_run_by_onnxruntime_matches_pytorch(tmp_path):
    pytest.importorskip("onnxruntime")
    from ddpm.backends.runtimes import OnnxRuntimeDecoder
    from ddpm.latent.autoencoder import load_first_stage

    write_autoencoder(tmp_path / "ae.pt")
    stage, _ = load_first_stage(tmp_path / "ae.pt", device=torch.device("cpu"))
    runner = OnnxRuntimeDecoder.exported(stage.decoder, io=stage.io, device=torch.device("cpu"), opset=21)
    z = torch.randn(
        5, *stage.latent_shape, generator=torch.Generator().manual_seed(0)
    )  # another batch than the export's
    with torch.no_grad():
        torch.testing.assert_close(runner(z), stage.decoder(z), rtol=1e-4, atol=1e-5)


def test_another_or_a_missing_autoencoder_is_refused_in_one_line(latent_model, tmp_path, capsys):
    model = latent_model / "lat.pt"
    moved = tmp_path / "lat.pt"
    shutil.copy(model, moved)
    shutil.copy(latent_model / "ae.pt", tmp_path / "right.pt")
    write_autoencoder(tmp_path / "other.pt", seed=1)  # the same shapes, other weights
    args = [
        "--device",
        "cpu",
        "--mode",
        "sample",
        "--model_path",
        str(moved),
        "--n_samples",
        "2",
        "--sampling_steps",
        "2",
        "--sampler",
        "ddim",
        "--output",
        str(tmp_path / "x.png"),
    ]
    assert main.main([*args, "--autoencoder", str(tmp_path / "other.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "another autoencoder" in err and "\n" not in err
    assert main.main([*args, "--autoencoder", str(tmp_path / "missing.pt")]) == 2
    assert "--autoencoder" in capsys.readouterr().err
    assert main.main([*args, "--autoencoder", str(tmp_path)]) == 2  # it exists: a folder is not "missing"
    err = capsys.readouterr().err
    assert "is a folder, not a checkpoint file" in err and " is missing" not in err
    assert not (tmp_path / "x.png").exists()
    assert main.main([*args, "--autoencoder", str(tmp_path / "right.pt")]) == 0, capsys.readouterr().err
    assert (tmp_path / "x.png").is_file()


def test_a_latent_unet_without_an_autoencoder_is_refused(latent_model, tmp_path, capsys):
    from ddpm.formats.checkpoints import LINK_KEY, load_checkpoint, save_checkpoint

    state = load_checkpoint(latent_model / "lat.pt")
    del state[LINK_KEY]
    save_checkpoint(tmp_path / "orphan.pt", state)
    args = [
        "--device",
        "cpu",
        "--mode",
        "sample",
        "--model_path",
        str(tmp_path / "orphan.pt"),
        "--output",
        str(tmp_path / "x.png"),
    ]
    assert main.main(args) == 2
    assert "no autoencoder" in capsys.readouterr().err


def test_latents_train_as_stored_without_flips_and_the_sizes_must_match(latent_model):
    from ddpm.data.datasets import load_images
    from ddpm.latent.autoencoder import encode_dataset, load_autoencoder

    loaded = load_autoencoder(latent_model / "ae.pt", device="cpu")
    digits = load_images("digits", data_dir="unused", image_size=8)
    latents = encode_dataset(digits, loaded, source="ae.pt")
    assert latents.images.dtype == torch.float32 and latents.images.shape[1:] == (2, 4, 4) and not latents.hflip
    batch = latents.batch(0, batch_size=4, seed=0)
    order = torch.randperm(len(latents), generator=torch.Generator().manual_seed(0))[:4]
    torch.testing.assert_close(batch, latents.images[order], rtol=0, atol=0)
    with pytest.raises(ValueError, match="match --img_size"):
        encode_dataset(load_images("digits", data_dir="unused", image_size=16), loaded, source="ae.pt")


@pytest.mark.parametrize(
    "fmt, suffix, extra",
    [("onnx", ".onnx", ("--implementation", "onnxruntime")), ("torchscript", ".ts", ("--trust_torchscript",))],
)
def test_an_exported_latent_model_carries_its_decoder_and_draws_the_checkpoints_images(
    latent_model, latent_export, tmp_path, capsys, monkeypatch, fmt, suffix, extra
):
    pytest.importorskip("onnxruntime")
    unet, decoder = tmp_path / f"lat{suffix}", tmp_path / f"lat.decoder{suffix}"
    if fmt == "onnx":  # the same command, run once a session (tests/conftest.py): copies of its two files
        folder, out = latent_export
        shutil.copy(folder / "lat.onnx", unet)
        shutil.copy(folder / "lat.decoder.onnx", decoder)
    else:
        export = [
            "--device",
            "cpu",
            "--mode",
            "export",
            "--format",
            fmt,
            "--model_path",
            str(latent_model / "lat.pt"),
            "--output",
            str(unet),
        ]
        from ddpm.latent import autoencoder

        opened, load = [], autoencoder.load_autoencoder
        monkeypatch.setattr(autoencoder, "load_autoencoder", lambda path, **kw: opened.append(path) or load(path, **kw))
        assert main.main(export) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert len(opened) == 1  # the link is resolved once, where the checkpoint is opened (load_artifact)
    assert decoder.is_file() and "the decoder" in out
    drawn = {}
    for name, path, flags in (("checkpoint", latent_model / "lat.pt", ()), ("exported", unet, extra)):
        args = [
            "--device",
            "cpu",
            "--mode",
            "sample",
            "--model_path",
            str(path),
            "--n_samples",
            "3",
            "--sampler",
            "ddim",
            "--sampling_steps",
            "3",
            "--no_grid",
            "--save_npz",
            str(tmp_path / f"{name}.npz"),
            *flags,
        ]
        assert main.main(args) == 0, capsys.readouterr().err
        with np.load(tmp_path / f"{name}.npz") as data:
            drawn[name] = data["images"].astype(int)
    assert drawn["exported"].shape == (3, 8, 8, 1)
    assert np.abs(drawn["exported"] - drawn["checkpoint"]).max() <= 1
    # The decoder is the one the U-Net names: another file in its place, or none, is refused in one line.
    decoder.write_bytes(decoder.read_bytes()[:-1] + b"x")
    args = [
        "--device",
        "cpu",
        "--mode",
        "sample",
        "--model_path",
        str(unet),
        "--n_samples",
        "2",
        "--no_grid",
        "--save_npz",
        str(tmp_path / "x.npz"),
        *extra,
    ]
    assert main.main(args) == 2
    assert "not the decoder" in capsys.readouterr().err
    decoder.unlink()
    assert main.main(args) == 2
    assert "decoder" in capsys.readouterr().err and not (tmp_path / "x.npz").exists()


# ----- the decoder in reduced precision and as a TensorRT engine (TensorRT itself is not installed here) -----


def first_stage(folder):
    from ddpm.latent.autoencoder import load_first_stage

    write_autoencoder(folder / "ae.pt")
    stage, _ = load_first_stage(folder / "ae.pt", device=torch.device("cpu"))
    return stage


def test_the_decoder_graph_follows_its_spec_and_onnxruntime_runs_the_fp16_one_like_pytorch(tmp_path):
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto

    from ddpm.backends.runtimes import OnnxRuntimeDecoder, onnxruntime_session
    from ddpm.formats.exporters import export_decoder_onnx, onnx_io_mismatches
    from ddpm.formats.unet_io import default_opset
    from ddpm.util.precision import mixed_precision_decoder

    stage = first_stage(tmp_path)
    z = torch.randn(5, *stage.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference, mixed = stage.decoder(z), mixed_precision_decoder(stage.decoder, "fp16")(z)
    protos = {}
    for precision in ("fp16", "bf16"):  # each at its default opset (bf16 needs 22); fp32's: latent_export's
        proto = export_decoder_onnx(stage.decoder, io=stage.io, opset=default_opset(precision), precision=precision)
        assert onnx_io_mismatches(proto, stage.io) == []  # latents (batch, 2, 4, 4) in, images (batch, 1, 8, 8) out
        weights = {init.name: init.data_type for init in proto.graph.initializer}
        convs = [node for node in proto.graph.node if node.op_type == "Conv"]
        low = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}[precision]
        assert convs and {weights[node.input[1]] for node in convs if node.input[1] in weights} == {low}
        protos[precision] = proto
    proto = protos["fp16"]  # opset 21, which onnxruntime runs
    assert proto.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT  # images stay float32
    session = onnxruntime_session(proto.SerializeToString(), device=torch.device("cpu"))
    runner = OnnxRuntimeDecoder(session, image_shape=stage.image_shape)
    torch.testing.assert_close(runner(z), mixed, rtol=0, atol=4e-3)  # the same fp16 arithmetic, other kernels
    torch.testing.assert_close(mixed, reference, rtol=0, atol=2e-2)
    assert not torch.equal(mixed, reference)  # it did compute in fp16


@pytest.mark.slow  # a training run and two fp16 exports (U-Net and decoder each): a minute on 2 cores
def test_an_fp16_onnx_export_of_a_latent_model_draws_the_checkpoints_images(latent_model, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    import onnx

    # A U-Net trained 2 steps predicts eps ~ 0, so its unclipped x0 = x_t / sqrt(alpha_bar) is huge on the
    # fixture's 20-step schedule; on a 1000-step schedule it stays within fp16's range.
    train = [
        "--device",
        "cpu",
        "--mode",
        "train",
        "--dataset",
        "digits",
        "--autoencoder",
        str(latent_model / "ae.pt"),
        "--model_channels",
        "8",
        "--num_res_blocks",
        "1",
        "--max_steps",
        "2",
        "--batch_size",
        "8",
        "--save_every",
        "0",
        "--sample_every",
        "0",
        "--model_path",
        str(tmp_path / "lat.pt"),
    ]
    assert main.main(train) == 0
    drawn = {}
    for name, source in (("fp16", tmp_path / "lat.pt"), ("overflows", latent_model / "lat.pt")):
        export = [
            "--device",
            "cpu",
            "--mode",
            "export",
            "--format",
            "onnx",
            "--precision",
            "fp16",
            "--model_path",
            str(source),
            "--output",
            str(tmp_path / f"{name}.onnx"),
            "--autoencoder",  # outside lat.pt's folder: named by the user
            str(latent_model / "ae.pt"),
        ]
        assert main.main(export) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert (
            "against PyTorch's fp16 decoder: max abs diff" in out and "cannot run it" not in out
        )  # onnxruntime ran it
        for graph in (f"{name}.onnx", f"{name}.decoder.onnx"):  # both graphs hold fp16 weights: not an fp32 export
            proto = onnx.load(str(tmp_path / graph))
            assert any(w.data_type == onnx.TensorProto.FLOAT16 for w in proto.graph.initializer), graph
    runs = (
        ("checkpoint", tmp_path / "lat.pt", ("--autoencoder", str(latent_model / "ae.pt"))),
        ("fp16", tmp_path / "fp16.onnx", ("--implementation", "onnxruntime")),
        ("overflows", tmp_path / "overflows.onnx", ("--implementation", "onnxruntime")),
    )
    for name, path, flags in runs:
        args = [
            "--device",
            "cpu",
            "--mode",
            "sample",
            "--model_path",
            str(path),
            "--n_samples",
            "3",
            "--sampler",
            "ddim",
            "--sampling_steps",
            "3",
            "--no_grid",
            "--save_npz",
            str(tmp_path / f"{name}.npz"),
            *flags,
        ]
        if name == "overflows":  # NaN is refused in one line, never written as black images
            assert main.main(args) == 2
            err = capsys.readouterr().err.strip()
            assert "non-finite" in err and "\n" not in err and not (tmp_path / "overflows.npz").exists()
            continue
        assert main.main(args) == 0, capsys.readouterr().err
        with np.load(tmp_path / f"{name}.npz") as data:
            drawn[name] = data["images"].astype(int)
    assert np.abs(drawn["fp16"] - drawn["checkpoint"]).max() <= 4  # 8-bit levels, fp16 rounding through 3 steps


class FakeDataType:  # tensorrt.DataType members are pybind11 enums with a .name
    def __init__(self, name: str) -> None:
        self.name = name


class FakeCudaEngine:
    """The ICudaEngine calls Engine's I/O check makes: tensors by index, their mode and dtype."""

    def __init__(self, tensors: dict[str, tuple[str, str]]) -> None:
        self.tensors = tensors
        self.num_io_tensors = len(tensors)

    def get_tensor_name(self, index: int) -> str:
        return list(self.tensors)[index]

    def get_tensor_mode(self, name: str) -> str:
        return self.tensors[name][0]

    def get_tensor_dtype(self, name: str) -> FakeDataType:
        return FakeDataType(self.tensors[name][1])


def test_a_decoder_engine_is_checked_against_the_decoder_spec_not_the_unets(tmp_path):
    from types import SimpleNamespace

    from ddpm.formats.unet_io import BatchRange
    from tensorrt_integration import Engine

    stage = first_stage(tmp_path)
    trt = SimpleNamespace(TensorIOMode=SimpleNamespace(INPUT="input", OUTPUT="output"))
    decoder = FakeCudaEngine({"latents": ("input", "FLOAT"), "images": ("output", "FLOAT")})
    engine = Engine(decoder, trt=trt, runtime=None, io=stage.io, batch=BatchRange(), device=torch.device("cpu"))
    assert engine.io.shapes(3) == {"latents": (3, 2, 4, 4), "images": (3, 1, 8, 8)}
    assert engine.io.profile(BatchRange(1, 16, 64))["latents"] == ((1, 2, 4, 4), (16, 2, 4, 4), (64, 2, 4, 4))
    unet = FakeCudaEngine({"x_t": ("input", "FLOAT"), "t": ("input", "INT64"), "eps": ("output", "FLOAT")})
    with pytest.raises(ValueError, match="differ from its spec"):
        Engine(unet, trt=trt, runtime=None, io=stage.io, batch=BatchRange(), device=torch.device("cpu"))
    half = FakeCudaEngine({"latents": ("input", "HALF"), "images": ("output", "FLOAT")})
    with pytest.raises(ValueError, match="latents"):
        Engine(half, trt=trt, runtime=None, io=stage.io, batch=BatchRange(), device=torch.device("cpu"))


@pytest.fixture
def stand_in_tensorrt(monkeypatch):
    """No TensorRT here: its module, the GPU check, the builder and the loader are stand-ins. The builder
    records what it was asked to build (ONNX file, I/O spec, plan) and returns distinct bytes; the loader
    returns a stand-in engine holding those bytes, spec and batch range, whose infer returns zeros of the
    spec's output shape. What this checks is which graphs, cache files, keys and metadata the code around
    the engines produces; no engine runs."""
    from types import SimpleNamespace

    import tensorrt_integration as trt_integration

    builds = []

    def build(onnx_path, *, io, batch, plan, optimization_level, timing_cache):
        builds.append(SimpleNamespace(onnx_path=onnx_path, io=io, batch=batch, plan=plan))
        return f"engine #{len(builds)}".encode(), b"timing"

    def load(cls, data, *, io, batch, device):
        def infer(feed):
            size = next(iter(feed.values())).shape[0]
            return {spec.name: torch.zeros(spec.concrete(size)) for spec in io.outputs}

        return SimpleNamespace(data=data, io=io, batch=batch, infer=infer)

    monkeypatch.setattr(trt_integration, "import_tensorrt", lambda: SimpleNamespace(__version__="11.4.1"))
    monkeypatch.setattr(trt_integration, "require_cuda", lambda device: None)
    monkeypatch.setattr(
        trt_integration,
        "runtime_environment",
        lambda trt, device: {
            "tensorrt_version": "11.4.1",
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "compute_capability": "9.0",
        },
    )
    monkeypatch.setattr(trt_integration.Engine, "build", staticmethod(build))
    monkeypatch.setattr(trt_integration.Engine, "load", classmethod(load))
    return builds


@pytest.mark.slow  # 8-20 s: two decoder exports; the engine cache rules are unit-tested in tests/formats
def test_the_decoder_engine_is_built_from_its_own_cached_graph_and_rebuilt_when_it_changes(tmp_path, stand_in_tensorrt):
    from dataclasses import replace

    import tensorrt_integration as trt_integration
    from ddpm.formats.unet_io import BatchRange, sha256_file

    builds = stand_in_tensorrt
    stage, cache = first_stage(tmp_path), tmp_path / "cache"
    options = trt_integration.TensorRTOptions(cache_dir=cache)
    logs = []
    arguments = dict(device=torch.device("cpu"), precision="fp16", batch=BatchRange(), options=options, log=logs.append)
    data, key = trt_integration.decoder_engine_bytes(stage, **arguments)
    assert data == b"engine #1" and builds[0].onnx_path == cache / "decoder_fp16.onnx" and builds[0].io == stage.io
    assert (
        builds[0].plan.strongly_typed and builds[0].plan.graph_precision == "fp16"
    )  # TensorRT 11: the precision is in the graph
    assert key["onnx_sha256"] == sha256_file(builds[0].onnx_path) and set(key["shapes"]) == {"latents"}
    assert (cache / "decoder_fp16_max64.engine").read_bytes() == b"engine #1"
    assert trt_integration.decoder_engine_bytes(stage, **arguments)[0] == b"engine #1" and len(builds) == 1  # cached
    # Another latent scale is another decoder: a new graph, a new engine.
    rescaled = replace(stage, decoder=type(stage.decoder)(stage.decoder.autoencoder, latent_scale=2.5))
    assert trt_integration.decoder_engine_bytes(rescaled, **arguments)[0] == b"engine #2"
    assert sum("exporting the decoder" in line for line in logs) == 2
    # The implementation's decoder builds its engine before any sampling, and a larger profile for a larger batch.
    decode = trt_integration.tensorrt_decoder(stage, device=torch.device("cpu"), options=options, log=logs.append)
    assert len(builds) == 3 and builds[-1].batch == BatchRange(1, 16, 64)
    assert decode(torch.randn(3, *stage.latent_shape)).shape == (3, 1, 8, 8) and len(builds) == 3
    assert decode(torch.randn(100, *stage.latent_shape)).shape == (100, 1, 8, 8)
    assert len(builds) == 4 and builds[-1].batch.max == 100 and (cache / "decoder_fp32_max100.engine").is_file()


@pytest.mark.slow  # engines from a checkpoint and from its ONNX export (the export: most of a minute on 2 cores)
def test_an_exported_latent_engine_names_its_decoder_engine_and_loads_it_checked(
    latent_model, tmp_path, stand_in_tensorrt
):
    from ddpm.backends.artifacts import load_artifact
    from ddpm.formats.engine_cache import metadata_path, read_metadata
    from ddpm.formats.unet_io import BatchRange, DecoderIO, UNetIO
    from ddpm.modes.export import export_artifact, export_checkpoint
    from tensorrt_integration import TensorRTDecoder, TensorRTOptions, tensorrt_decoder

    builds, cpu = stand_in_tensorrt, torch.device("cpu")
    options = TensorRTOptions(cache_dir=tmp_path / "cache")
    lines = export_artifact(
        latent_model / "lat.pt",
        fmt="tensorrt",
        output=tmp_path / "lat.engine",
        weights="ema",
        device=cpu,
        tensorrt_options=options,
    )
    assert [type(b.io) for b in builds] == [UNetIO, DecoderIO] and "the decoder's engine" in lines[-1]
    assert (tmp_path / "lat.decoder.engine").read_bytes() == b"engine #2"
    entry = read_metadata(metadata_path(tmp_path / "lat.engine"))["decoder"]
    assert (
        entry["file"] == "lat.decoder.engine"
        and entry["latent_shape"] == [2, 4, 4]
        and entry["image_shape"] == [1, 8, 8]
    )
    artifact = load_artifact(tmp_path / "lat.engine", device=cpu)
    decoder = artifact.first_stage.decoder
    assert isinstance(decoder, TensorRTDecoder) and decoder.engine.data == b"engine #2"
    assert decoder.engine.io == DecoderIO((2, 4, 4), (1, 8, 8)) and decoder.engine.batch == BatchRange(1, 16, 64)
    assert artifact.output_shape == (1, 8, 8)
    assert tensorrt_decoder(artifact.first_stage, device=cpu) is decoder  # used as exported, nothing built
    assert len(builds) == 2
    # From an exported ONNX model, the decoder's engine is built from its .decoder.onnx file.
    export_checkpoint(latent_model / "lat.pt", fmt="onnx", output=tmp_path / "lat.onnx", device=cpu)
    export_artifact(
        tmp_path / "lat.onnx",
        fmt="tensorrt",
        output=tmp_path / "from_onnx.engine",
        weights="ema",
        device=cpu,
        tensorrt_options=TensorRTOptions(cache_dir=tmp_path / "cache2"),
    )
    assert [b.onnx_path for b in builds[2:]] == [tmp_path / "lat.onnx", tmp_path / "lat.decoder.onnx"]
    # Another decoder engine in its place is refused before it is deserialized.
    (tmp_path / "lat.decoder.engine").write_bytes(b"engine #9")
    with pytest.raises(ValueError, match="not the decoder"):
        load_artifact(tmp_path / "lat.engine", device=cpu)


def test_the_tensorrt_implementation_takes_latent_models_and_says_what_to_install(
    latent_model, tmp_path, capsys, monkeypatch
):
    import sys

    from ddpm.backends import registry

    registry.get("tensorrt").check(latent=True)  # no longer refused
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # TensorRT absent, even where it is installed
    for args in (
        ["--mode", "sample", "--implementation", "tensorrt", "--output", str(tmp_path / "x.png")],
        ["--mode", "export", "--format", "tensorrt", "--output", str(tmp_path / "lat.engine")],
    ):
        assert main.main(["--device", "cpu", "--model_path", str(latent_model / "lat.pt"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert "pip install tensorrt" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_the_training_benchmark_times_a_latent_unet_on_latents(latent_model, tmp_path, capsys, monkeypatch):
    import json

    args = [
        "--device",
        "cpu",
        "--mode",
        "benchmark",
        "--bench",
        "training",
        "--model_path",
        str(latent_model / "lat.pt"),
        "--batch_size",
        "4",
        "--train_steps",
        "1",
        "--rows",
        "fp32",
        "--json",
        str(tmp_path / "t.json"),
    ]
    from ddpm.benchmarks import training_bench

    fed, time_variant = [], training_bench.time_variant

    def spy(*args, images, **kwargs):  # the real timing, with a look at the data it trains on
        fed.append(images)
        return time_variant(*args, images=images, **kwargs)

    monkeypatch.setattr(training_bench, "time_variant", spy)
    assert main.main(args) == 0, capsys.readouterr().err
    assert "2x4x4 latents" in capsys.readouterr().out
    assert fed[0].images.dtype == torch.float32 and fed[0].images.shape[1:] == (2, 4, 4)  # latents, not uint8 images
    assert abs(fed[0].images.std().item() - 1) < 0.1
    (row,) = json.loads((tmp_path / "t.json").read_text())["training_rows"]
    assert row["status"] == "ok" and row["images_per_s"] > 0
    assert main.main([*args, "--autoencoder", str(latent_model / "ae.pt")]) == 2  # it would be ignored
    assert "reads no autoencoder" in capsys.readouterr().err


@pytest.mark.slow  # 13-30 s on 2 cores: every implementation on a conditional latent model
def test_a_conditional_latent_model_draws_the_requested_labels_alike_in_every_implementation(
    latent_model, tmp_path, capsys
):
    # The labels and guidance travel with the latents: the original, cuda and onnxruntime implementations
    # draw the same guided, decoded images for the same labels, and other labels draw other images.
    pytest.importorskip("onnxruntime")
    shutil.copy(latent_model / "ae.pt", tmp_path / "ae.pt")  # beside the checkpoint: its link is followed there
    train = [
        "--device",
        "cpu",
        "--mode",
        "train",
        "--dataset",
        "digits",
        "--autoencoder",
        str(tmp_path / "ae.pt"),
        "--class_cond",
        "--timesteps",
        "20",  # the end-of-run preview (70 guided latents, decoded) samples 20 steps, not 100
        "--model_channels",
        "32",
        "--num_res_blocks",
        "1",
        "--max_steps",
        "2",
        "--batch_size",
        "8",
        "--lr",
        "3e-3",
        "--ema_decay",
        "0.5",
        "--save_every",
        "0",
        "--sample_every",
        "0",
        "--model_path",
        str(tmp_path / "cond.pt"),
    ]
    assert main.main(train) == 0, capsys.readouterr().err
    assert "conditioned on 10 classes" in capsys.readouterr().out
    drawn = {}
    for impl, labels in (("original", "3,7"), ("cuda", "3,7"), ("onnxruntime", "3,7"), ("original", "1,2")):
        args = [
            "--device",
            "cpu",
            "--mode",
            "sample",
            "--model_path",
            str(tmp_path / "cond.pt"),
            "--class_label",
            labels,
            "--n_samples",
            "2",
            "--sampler",
            "ddim",
            "--sampling_steps",
            "3",
            "--implementation",
            impl,
            "--no_grid",
            "--save_npz",
            str(tmp_path / f"{impl}{labels}.npz"),
        ]
        assert main.main(args) == 0, capsys.readouterr().err
        with np.load(tmp_path / f"{impl}{labels}.npz") as data:
            drawn[impl, labels] = data["images"].astype(int)
    assert drawn["original", "3,7"].shape == (2, 8, 8, 1)
    for impl in ("cuda", "onnxruntime"):
        assert np.abs(drawn[impl, "3,7"] - drawn["original", "3,7"]).max() <= 1
    assert not np.array_equal(drawn["original", "1,2"], drawn["original", "3,7"])  # the labels reach the U-Net


def test_an_autoencoder_given_for_a_pixel_model_is_refused_in_one_line_wherever_it_would_be_ignored(
    latent_model, tmp_path, capsys
):
    pixel = tmp_path / "pixel.pt"
    train = [
        "--device",
        "cpu",
        "--mode",
        "train",
        "--dataset",
        "digits",
        "--img_size",
        "8",
        "--timesteps",
        "10",  # a cheap end-of-run preview
        "--model_channels",
        "8",
        "--num_res_blocks",
        "1",
        "--max_steps",
        "1",
        "--batch_size",
        "4",
        "--save_every",
        "0",
        "--sample_every",
        "0",
        "--model_path",
        str(pixel),
    ]
    assert main.main(train) == 0, capsys.readouterr().err
    capsys.readouterr()
    before = pixel.read_bytes()
    given = ["--autoencoder", str(latent_model / "ae.pt")]
    for args in (
        [*train[:-2], "--model_path", str(pixel), "--resume", "--max_steps", "2"],
        ["--device", "cpu", "--mode", "sample", "--model_path", str(pixel), "--output", str(tmp_path / "x.png")],
        ["--device", "cpu", "--mode", "benchmark", "--model_path", str(pixel), "--rows", "original"],
        ["--device", "cpu", "--mode", "benchmark", "--bench", "training", "--model_path", str(pixel)],
    ):
        assert main.main([*args, *given]) == 2
        err = capsys.readouterr().err.strip()
        assert "is a pixel model; it has no autoencoder to replace" in err and "\n" not in err, err
    assert pixel.read_bytes() == before and not (tmp_path / "x.png").exists()


def test_a_latent_teachers_discriminator_takes_its_ode_ends_and_refuses_the_data(latent_model, tmp_path):
    """A latent student's x_0 is a latent: the digits' pixels are no real images for its discriminator."""
    from helpers import assert_user_error, run_here

    flags = ["--mode", "distill", "--model_path", str(latent_model / "lat.pt"), "--sampling_steps", "1"]
    flags += ["--distill_samples", "4", "--teacher_steps", "4", "--batch_size", "4", "--max_steps", "1"]
    result = run_here(*flags, "--output", "adv.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "GAN term against the teacher's ODE ends" in result.stdout + result.stderr
    refused = run_here(*flags, "--output", "data.pt", "--adv_real", "data", cwd=tmp_path)
    assert_user_error(refused, "is a latent model, whose discriminator sees latents, not images")
    assert not (tmp_path / "data.pt").exists()


def test_a_latent_teacher_distills_its_latent_unet_and_the_student_keeps_the_autoencoder_link(latent_model):
    from ddpm.formats.checkpoints import LINK_KEY

    student = latent_model / "lat_student2.pt"
    args = [
        "--device",
        "cpu",
        "--mode",
        "distill",
        "--model_path",
        str(latent_model / "lat.pt"),
        "--sampling_steps",
        "2",
    ]
    tiny = ["--distill_samples", "4", "--teacher_steps", "4", "--batch_size", "4", "--max_steps", "1"]
    assert main.main([*args, *tiny]) == 0  # --output defaults to beside the teacher
    teacher_state, student_state = (torch.load(p, weights_only=True) for p in (latent_model / "lat.pt", student))
    assert student_state[LINK_KEY] == teacher_state[LINK_KEY]
    assert list(student_state["schedule_config"]["student_timesteps"]) == [19, 2]  # sigma 0.83 x 4 / 8: 4x4 latents
    out = latent_model / "student.npz"
    drawn = ["--device", "cpu", "--mode", "sample", "--model_path", str(student), "--n_samples", "2"]
    assert main.main([*drawn, "--no_grid", "--save_npz", str(out)]) == 0
    images = next(iter(np.load(out).values()))
    assert images.shape == (2, 8, 8, 1)  # 8x8 digits decoded by the linked autoencoder
