"""Artifacts are validated at load, not trusted: every failure is one line, and no file runs code unasked.

Specification: a TorchScript file is a program, so without trust_torchscript it is refused before
anything reads it (a hostile file's __setstate__ does not run), with it the file loads and its
errors come back in one line; a TorchScript archive renamed to .pt runs nothing either; an ONNX
file is validated before onnxruntime sees it (graph I/O against its metadata, opset, external data,
metadata depth and keys); --opset is checked against the range the exporter and onnxruntime support;
configs read from files refuse unknown keys, wrong types and absurd ranges; weights that do not
match their config are named in one line; JSON metadata is size- and depth-limited; a file larger
than its kind's limit is refused before it is read. Every refusal is a ValueError whose message is
one line, and leaves the file it read byte-identical.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_SCHEDULE as SCHEDULE
from helpers import needs_onnx, perturbed_unet, tiny_unet_config
from torch import nn

import tensorrt_integration
from basic_diffusion import UNetConfig
from ddpm.backends import artifacts, runtimes
from ddpm.formats import checkpoints, engine_cache, exporters, unet_io
from ddpm.formats.checkpoints import load_checkpoint, save_checkpoint
from ddpm.formats.torch_files import load_weights
from ddpm.util import safe_files
from ddpm.util.safe_files import parse_json
from noise_schedule import ScheduleConfig

CONFIG = tiny_unet_config()

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def refused(call, match: str, *, unchanged: Path | None = None) -> str:
    """``call()`` raises a ValueError with a one-line message containing ``match``; the file is untouched."""
    before = unchanged.read_bytes() if unchanged is not None else None
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    assert match in message, message
    if unchanged is not None:
        assert unchanged.read_bytes() == before
    return message


def metadata(model_config: UNetConfig = CONFIG, **extra) -> dict:
    return unet_io.artifact_metadata(model_config=model_config, schedule_config=SCHEDULE, weights="ema", **extra)


def checkpoint_state(model_config: dict, weights: dict) -> dict:
    return {
        "format_version": checkpoints.FORMAT_VERSION,
        "model_config": model_config,
        "schedule_config": dataclasses.asdict(SCHEDULE),
        "model": weights,
        "ema": weights,
        "step": 0,
    }


# ----- TorchScript needs consent ------------------------------------------------------------------


class WritesAFileWhenLoaded(nn.Module):
    """A U-Net stand-in whose __setstate__, which torch.jit.load runs, creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.probe = torch.zeros(1, dtype=torch.uint8)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x_t

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.marker, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.marker = state[0]
        self.training = state[1]
        self.probe = torch.from_file(self.marker, shared=True, size=1, dtype=torch.uint8)  # creates the file


class FailsWhenRun(nn.Module):
    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if t.sum() >= 0:
            raise ValueError("the archive's own error")
        return x_t


def save_script(module: nn.Module, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated, and still what .ts files are
        scripted = torch.jit.script(module)
        torch.jit.save(scripted, str(path), _extra_files={"ddpm.json": json.dumps(metadata(traced_on="cpu"))})
    return path


def test_a_torchscript_file_runs_no_code_without_trust(tmp_path):
    marker = tmp_path / "marker"
    hostile = save_script(WritesAFileWhenLoaded(str(marker)), tmp_path / "hostile.ts")
    refused(lambda: artifacts.load_artifact(hostile, device=CPU), "--trust_torchscript", unchanged=hostile)
    refused(lambda: runtimes.load_torchscript(hostile, device=CPU, trusted=False), "a program", unchanged=hostile)
    assert not marker.exists()
    # The control: with consent the file's code runs, so the refusal above is what kept the marker away.
    artifacts.load_artifact(hostile, device=CPU, trust_torchscript=True)
    assert marker.exists()


def test_a_trusted_torchscript_file_that_fails_when_run_is_one_line(tmp_path):
    path = save_script(FailsWhenRun(), tmp_path / "fails.ts")
    artifact = artifacts.load_artifact(path, device=CPU, trust_torchscript=True)
    x_t, t = unet_io.UNetIO.from_config(CONFIG).example_inputs(2)
    message = refused(lambda: artifact.model(x_t, t), "fails.ts failed when run")
    assert "the archive's own error" in message


def test_a_torchscript_archive_renamed_to_pt_runs_no_code(tmp_path, recwarn):
    marker = tmp_path / "marker"
    renamed = save_script(WritesAFileWhenLoaded(str(marker)), tmp_path / "hostile.pt")
    recwarn.clear()
    refused(lambda: load_checkpoint(renamed), "is a TorchScript archive", unchanged=renamed)
    refused(lambda: artifacts.load_artifact(renamed, device=CPU), "is a TorchScript archive", unchanged=renamed)
    assert not marker.exists()
    assert not [w for w in recwarn if "TorchScript" in str(w.message)]  # torch.load never saw it


# ----- ONNX is validated before onnxruntime sees it -----------------------------------------------


@pytest.fixture(scope="module")
def onnx_bytes(tiny_onnx_bytes) -> bytes:
    return tiny_onnx_bytes  # tests/conftest.py: perturbed_unet(CONFIG) with metadata(), exported once a session


def set_metadata(proto, value: str) -> None:
    (entry,) = [e for e in proto.metadata_props if e.key == unet_io.METADATA_KEY]
    entry.value = value


def other_image_size(proto) -> None:  # metadata for 32x32 images; the graph takes 16x16
    set_metadata(proto, json.dumps(metadata(dataclasses.replace(CONFIG, image_size=32, attention_resolutions=(16,)))))


def opset_30(proto) -> None:
    (default,) = [o for o in proto.opset_import if o.domain == ""]
    default.version = 30


def external_weights(proto) -> None:
    import onnx

    tensor = proto.graph.initializer[0]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "/etc/passwd"


def deep_metadata(proto) -> None:
    set_metadata(proto, "[" * 100_000 + "]" * 100_000)


def unknown_config_key(proto) -> None:
    meta = metadata()
    meta["model_config"]["evil"] = 1
    set_metadata(proto, json.dumps(meta))


def appended_allocation(proto) -> None:  # a 2^30-element ConstantOfShape beside the U-Net (4 GiB of fp32)
    import onnx

    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1 << 30], dtype=np.int64), "huge_shape"))
    proto.graph.node.append(onnx.helper.make_node("ConstantOfShape", ["huge_shape"], ["huge"]))


def resize_by_1000(proto) -> None:  # its stored shapes dropped, as an attacker would, so onnx.checker passes it
    import onnx

    del proto.graph.value_info[:]
    node = next(n for n in proto.graph.node if n.op_type == "Resize")
    scales = next(t for t in proto.graph.initializer if t.name == node.input[2])
    scales.CopyFrom(onnx.numpy_helper.from_array(np.array([1, 1, 1000, 1000], dtype=np.float32), scales.name))


def dilated_convolution(proto) -> None:
    del proto.graph.value_info[:]
    node = next(n for n in proto.graph.node if n.op_type == "Conv")
    next(a for a in node.attribute if a.name == "dilations").ints[:] = [64, 64]


@needs_onnx
@pytest.mark.parametrize(
    "tamper,match",
    [
        (other_image_size, "do not match its metadata (x_t is float [B, 1, 16, 16], expected float [B, 1, 32, 32]"),
        (opset_30, "uses ONNX opset 30; this tool runs opsets 18 to 25"),
        (external_weights, "in an external file, which is not read"),
        (deep_metadata, "nests deeper than 32 levels"),
        (unknown_config_key, "its model config is unusable (unknown key 'evil'"),
        (appended_allocation, "uses the ONNX op 'ConstantOfShape', which this tool's exports never contain"),
        (resize_by_1000, "by computed or more than 2x scales"),
        (dilated_convolution, "pads, strides or dilations this tool's exports never use"),
    ],
)
def test_an_onnx_file_is_validated_before_a_session_is_created(tmp_path, monkeypatch, onnx_bytes, tamper, match):
    import onnx
    import onnxruntime

    good = tmp_path / "good.onnx"
    good.write_bytes(onnx_bytes)
    assert artifacts.load_artifact(good, device=CPU).model_config == CONFIG  # the control: untampered, it loads
    proto = onnx.load_model_from_string(onnx_bytes)
    tamper(proto)
    path = tmp_path / "tampered.onnx"
    path.write_bytes(proto.SerializeToString())

    def no_session(*args, **kwargs):
        pytest.fail("an onnxruntime session was created for an invalid file")

    monkeypatch.setattr(onnxruntime, "InferenceSession", no_session)
    refused(lambda: artifacts.load_artifact(path, device=CPU), match, unchanged=path)


def doubling_concats(proto, *, doublings: int) -> None:
    """x_t flattened and concatenated with itself ``doublings`` times, added (times 0) to eps: only ops the
    exporter writes, and sizes known only when it runs (the flatten hides the batch), so no check of the
    file can bound it. 2 KiB of x_t (batch 2) becomes 2 KiB * 2^doublings."""
    import onnx
    from onnx import helper, numpy_helper

    (output,) = proto.graph.output
    producer = next(node for node in proto.graph.node if output.name in node.output)
    producer.output[list(producer.output).index(output.name)] = "eps_before"
    constants = {"flat": [-1], "start": [0], "stop": [1]}
    proto.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in constants.items())
    proto.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "zero"))
    nodes = [helper.make_node("Reshape", ["x_t", "flat"], ["grown_0"])]
    nodes += [helper.make_node("Concat", [f"grown_{i}"] * 2, [f"grown_{i + 1}"], axis=0) for i in range(doublings)]
    nodes += [
        helper.make_node("Slice", [f"grown_{doublings}", "start", "stop"], ["first"]),
        helper.make_node("Mul", ["first", "zero"], ["nothing"]),
        helper.make_node("Add", ["eps_before", "nothing"], [output.name]),
    ]
    proto.graph.node.extend(nodes)
    onnx.checker.check_model(proto)


@needs_onnx
def test_a_graph_sized_at_run_time_fails_at_its_memory_cap_not_the_machines(tmp_path, onnx_bytes):
    """The sessions of a file get an arena of runtimes.unet_memory_cap bytes: the file's own graph runs
    under it, and one growing to 1 GiB at batch 2 (2 KiB of x_t doubled 19 times) ends in one line."""
    import onnx

    x_t, t = torch.randn(2, *CONFIG.sample_shape(1)[1:]), torch.tensor([3, 7])
    for doublings, fails in ((1, False), (19, True)):
        proto = onnx.load_model_from_string(onnx_bytes)
        doubling_concats(proto, doublings=doublings)
        path = tmp_path / f"grown_{doublings}.onnx"
        path.write_bytes(proto.SerializeToString())
        model, *_ = runtimes.load_onnx(path, device=CPU, max_batch=2)  # every check of the file passes
        assert runtimes.unet_memory_cap(CONFIG, max_batch=2, file_bytes=path.stat().st_size) < (1 << 30) // 10
        if fails:
            refused(lambda: model(x_t, t), "tried to allocate far more memory than its model needs", unchanged=path)
        else:  # the control: a graph that grows a little runs, and is the U-Net
            reference = perturbed_unet(CONFIG).eval()
            with torch.no_grad():
                torch.testing.assert_close(model(x_t, t), reference(x_t, t), atol=1e-4, rtol=1e-4)


@needs_onnx
@pytest.mark.parametrize(
    "variant,opset,precision",
    [
        ("decoder", 21, "fp32"),
        # An export each, 5-20 s on 2 cores: the other variants, opsets and precisions run with make test-slow. The
        # plain U-Net's graph at the default opset is checked at every load (the control of the validation test).
        pytest.param("plain", 18, "fp32", marks=pytest.mark.slow),
        pytest.param("conditional", 21, "fp16", marks=pytest.mark.slow),
        pytest.param("3-D", 22, "bf16", marks=pytest.mark.slow),
        pytest.param("patched", 25, "fp32", marks=pytest.mark.slow),
    ],
)
def test_every_graph_the_exporter_writes_passes_the_bounded_work_check(variant, opset, precision):
    """EXPORTED_OPS and the Resize/Conv limits hold the exporter's own graphs, whatever their opset and precision."""
    from ddpm.latent.autoencoder import Autoencoder, AutoencoderConfig, LatentDecoder

    if variant == "decoder":
        torch.manual_seed(0)
        ae = Autoencoder(
            AutoencoderConfig(image_size=16, in_channels=1, latent_channels=2, downsample=4, base_channels=8)
        )
        io = unet_io.DecoderIO(latent_shape=ae.config.latent_shape, image_shape=ae.config.image_shape)
        proto = exporters.export_decoder_onnx(LatentDecoder(ae, 1.5).eval(), io=io, opset=opset, precision=precision)
    else:
        overrides = {
            "conditional": {"num_classes": 3},
            "3-D": {"dims": 3, "image_size": 8, "attention_resolutions": (4,)},
            "patched": {"patch_size": 2},
        }.get(variant, {})
        config = tiny_unet_config(**overrides)
        proto = exporters.export_onnx_model(
            perturbed_unet(config), metadata=metadata(config), opset=opset, precision=precision
        )
    runtimes.check_bounded_work(proto, source=variant)


@needs_onnx
def test_an_exports_training_dataset_is_read_and_an_unknown_one_refused(tmp_path, onnx_bytes):
    import onnx

    proto = onnx.load_model_from_string(onnx_bytes)
    for dataset, outcome in (("digits", "digits"), ("../../etc", "unknown training dataset")):
        set_metadata(proto, json.dumps(metadata(dataset=dataset)))
        path = tmp_path / "m.onnx"
        path.write_bytes(proto.SerializeToString())
        if outcome == "digits":
            assert artifacts.load_artifact(path, device=CPU).dataset == "digits"
        else:
            refused(lambda: artifacts.load_artifact(path, device=CPU), outcome, unchanged=path)


def test_opset_must_be_in_the_supported_range():
    unet_io.check_opset(unet_io.MIN_OPSET)
    unet_io.check_opset(unet_io.MAX_OPSET)
    supported = f"--opset must be between 18 (GroupNormalization) and {unet_io.MAX_OPSET} ("
    for opset in (99, unet_io.MAX_OPSET + 1, unet_io.MIN_OPSET - 1, True):
        refused(lambda: unet_io.check_opset(opset), supported)
    refused(lambda: exporters.export_onnx_model(perturbed_unet(CONFIG), metadata=metadata(), opset=99), "got 99")


# ----- configs read from files --------------------------------------------------------------------


def test_configs_from_files_round_trip_and_refuse_unknown_keys_types_and_ranges(tmp_path):
    assert UNetConfig.from_dict(json.loads(json.dumps(CONFIG.to_dict()))) == CONFIG
    assert ScheduleConfig.from_dict(dataclasses.asdict(SCHEDULE)) == SCHEDULE
    good = CONFIG.to_dict()
    unet_cases = [
        ({**good, "evil": 1}, "unknown key 'evil'; the known keys are image_size,"),
        ({k: v for k, v in good.items() if k != "norm_groups"}, "missing norm_groups"),
        ({**good, "model_channels": "16"}, "model_channels must be an integer, got '16'"),
        ({**good, "model_channels": True}, "model_channels must be an integer, got True"),
        ({**good, "image_size": 16.0}, "image_size must be an integer, got 16.0"),
        ({**good, "channel_mult": [1, 2.0]}, "channel_mult must be a list of at most 16 integers"),
        ({**good, "dropout": float("nan")}, "dropout must be a finite number, got nan"),
        ({**good, "model_channels": 100_000}, "model_channels must be between 1 and 512, got 100000"),
        ({**good, "image_size": 4096}, "image_size must be between 1 and 1024"),
        ({**good, "channel_mult": [1] * 9}, "channel_mult must be 1 to 8 integers"),
        ([1, 2], "a list instead of a dict of settings"),
    ]
    for data, match in unet_cases:
        refused(lambda: UNetConfig.from_dict(data), match)
    schedule = dataclasses.asdict(SCHEDULE)
    refused(lambda: ScheduleConfig.from_dict({**schedule, "num_timesteps": 2_000_000_000}), "between 2 and 10000")
    refused(lambda: ScheduleConfig.from_dict(schedule | {"num_timesteps": 2e9}), "must be an integer, got 2000000000.0")
    refused(lambda: ScheduleConfig.from_dict({**schedule, "kind": "linear\nsecond line"}), "unknown beta schedule")
    refused(lambda: ScheduleConfig(num_timesteps=2_000_000_000), "between 2 and 10000")  # built in code, too
    # From a checkpoint file: the message names the file.
    path = tmp_path / "evil_config.pt"
    save_checkpoint(path, checkpoint_state({**good, "evil": 1}, perturbed_unet(CONFIG).state_dict()))
    refused(lambda: load_checkpoint(path), f"checkpoint {path}: its model config is unusable", unchanged=path)


# ----- weights must match their config ------------------------------------------------------------


def test_weights_that_do_not_match_their_config_are_named_in_one_line(tmp_path):
    model = perturbed_unet(CONFIG)
    weights = dict(model.state_dict())
    good = tmp_path / "good.pt"
    save_checkpoint(good, checkpoint_state(CONFIG.to_dict(), weights))
    loaded, _ = checkpoints.load_checkpoint_model(good)  # the control: matching weights load, strictly
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), weights.values()))

    first, conv = next(iter(weights)), "conv_in.weight"
    bad_weights = {k: v for k, v in weights.items() if k != first}
    bad_weights["extra.weight"] = torch.zeros(1)
    bad_weights[conv] = torch.zeros(3, 3)
    bad = tmp_path / "bad.pt"
    save_checkpoint(bad, checkpoint_state(CONFIG.to_dict(), bad_weights))
    match = f"checkpoint {bad}: its weights do not match its model config ("
    message = refused(lambda: checkpoints.load_checkpoint_model(bad), match, unchanged=bad)
    assert f"1 missing, e.g. {first!r}; 1 unexpected, e.g. 'extra.weight'; " in message
    assert f"shape of {conv!r} is [3, 3] but the config makes {list(weights[conv].shape)}" in message
    # The helper training reuses, on a real (not meta) model:
    refused(
        lambda: load_weights(perturbed_unet(CONFIG), bad_weights, source="resume"), "resume: its weights do not match"
    )


# ----- metadata JSON is size- and depth-limited ---------------------------------------------------


def test_metadata_json_is_size_and_depth_limited(tmp_path):
    assert parse_json('{"a": [[1]]}', source="m") == {"a": [[1]]}
    refused(lambda: parse_json("[" * 33 + "]" * 33, source="m.json"), "m.json: its metadata nests deeper than 32")
    refused(lambda: parse_json("[" * 100_000 + "]" * 100_000, source="m.json"), "nests deeper than 32 levels")
    refused(lambda: parse_json('"' + "x" * (2 << 20) + '"', source="m.json"), "is 2.0 MiB, over the 1.0 MiB limit")
    refused(lambda: parse_json('{"a": NaN}', source="m.json"), "not valid JSON (NaN is not a number this tool reads)")
    # An engine's metadata file, read strictly without TensorRT: deep, then a sha256 that would break the line.
    engine = tmp_path / "u.engine"
    engine.write_bytes(b"engine bytes")
    sidecar = engine_cache.metadata_path(engine)
    sidecar.write_text("[" * 100_000 + "]" * 100_000)
    refused(lambda: tensorrt_integration.read_engine_metadata(engine), "nests deeper than 32 levels", unchanged=sidecar)
    environment = {"tensorrt_version": "10.9.0", "gpu_name": "NVIDIA H100", "compute_capability": "9.0"}
    meta = {**metadata(), **environment, "metadata_version": 1, "batch_range": [1, 16, 64], "sha256": "0" * 64}
    sidecar.write_text(json.dumps(meta))
    assert tensorrt_integration.read_engine_metadata(engine)[3] == unet_io.BatchRange(1, 16, 64)
    sidecar.write_text(json.dumps({**meta, "sha256": "ab\ncd", "batch_range": [4, 2, 1]}))
    refused(lambda: tensorrt_integration.read_engine_metadata(engine), "holds an invalid sha256 'ab\\ncd'; batch_range")


# ----- files larger than their kind's limit are not read ------------------------------------------


def load_engine_metadata(path: Path) -> None:
    tensorrt_integration.read_engine_metadata(path.with_name(path.name.removesuffix(".json")))


@pytest.mark.parametrize(
    "kind,name,load",
    [
        ("checkpoint", "m.pt", load_checkpoint),
        ("checkpoint", "m.pt", lambda p: artifacts.load_artifact(p, device=CPU)),
        ("torchscript", "m.ts", lambda p: artifacts.load_artifact(p, device=CPU, trust_torchscript=True)),
        pytest.param("onnx", "m.onnx", lambda p: artifacts.load_artifact(p, device=CPU), marks=needs_onnx),
        ("metadata", "m.engine.json", load_engine_metadata),
        ("tensorrt", "m.engine", lambda p: safe_files.check_file_size(p, kind="tensorrt")),
    ],
)
def test_a_file_over_its_kinds_limit_is_refused_before_it_is_read(tmp_path, monkeypatch, kind, name, load):
    path = tmp_path / name
    path.write_bytes(b"\x00junk" * 1000)  # read, it would be refused as corrupt instead
    monkeypatch.setitem(safe_files.MAX_FILE_BYTES, kind, 1000)
    refused(lambda: load(path), f"is 4.9 KiB, over the 1000 B limit for a {kind} file", unchanged=path)
