"""formats/engine_cache.py: which build each TensorRT version gets, and the engine cache, without TensorRT.

Specification: an engine's cache key records everything it depends on and any difference rebuilds; an
engine whose sha256 differs from its metadata is refused, never deserialized; missing or corrupt metadata
and a crash while storing lead to a rebuild; the build plan (strong typing, flags, opset) and
Torch-TensorRT's arguments are pure functions of the versions.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_unet_config

from ddpm.formats import engine_cache
from ddpm.formats.unet_io import BatchRange, UNetIO

IO = UNetIO.from_config(tiny_unet_config())


def key(**changes) -> dict:
    environment = {"tensorrt_version": "10.9.0", "gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    fields = dict(
        environment=environment,
        onnx_sha256="ab" * 32,
        precision="fp16",
        profile=IO.profile(BatchRange()),
        optimization_level=3,
    )
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
    for field in (
        "tensorrt_version",
        "gpu_name",
        "compute_capability",
        "onnx_sha256",
        "precision",
        "builder_optimization_level",
        "shapes",
    ):
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
)
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
)
def test_torch_tensorrt_gets_the_arguments_its_version_honours(version, precision, mixed, arguments):
    assert engine_cache.torch_tensorrt_arguments(version, precision) == (mixed, arguments)


def test_an_old_torch_tensorrt_is_refused_for_reduced_precision_not_built_in_fp32():
    with pytest.raises(ValueError, match="upgrade"):
        engine_cache.torch_tensorrt_arguments("2.5.1", "fp16")
    assert engine_cache.torch_tensorrt_arguments("2.5.1", "fp32") == (False, {"enabled_precisions": {torch.float32}})
