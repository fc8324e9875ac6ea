"""TensorRT engines without TensorRT: which build each TensorRT version gets, and the engine cache.

Everything here is a pure function of versions, files and metadata, testable without TensorRT or a GPU;
tensorrt_integration.py builds, loads and runs the engines.

* **Build plan** (:func:`build_plan`): TensorRT 11 removed the weak-typing flags
  (BuilderFlag.FP16 / BF16 / OBEY_PRECISION_CONSTRAINTS) and builds every network strongly typed,
  so from 10.12 on an fp16/bf16 engine is built, STRONGLY_TYPED, from a mixed-precision ONNX graph
  (precision.py: the precision written into the graph, the time embedding in fp32); 10.0-10.11 keep
  weak typing with the time-embedding layers pinned to fp32; before 10.9 the graph is opset 18.
  :func:`torch_tensorrt_arguments` makes the same choice for Torch-TensorRT's releases.
* **Cache.** Beside every engine lies a metadata file (TensorRT version, GPU, compute capability,
  ONNX sha256, precision, shapes, optimization level): any difference rebuilds. The engine file's
  own sha256 is checked before it is deserialized, since an engine is code; a mismatch is refused. The ONNX an
  engine is built from is cached per precision, keyed by the weights' hash (tensorrt_integration.cached_onnx; a
  latent model's decoder: cached_decoder_onnx, keyed by its latent scale too). Engines are cached per profile size
  (``unet_fp16_max64.engine``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpm.formats.unet_io import BF16_MIN_OPSET, DEFAULT_OPSET, default_opset
from ddpm.util.precision import PRECISIONS, QUANTIZED
from ddpm.util.safe_files import atomic_write, parse_json, read_limited

ENGINE_PRECISIONS = PRECISIONS + QUANTIZED  # an engine is built in any of them (int8/fp8: from a Q/DQ graph only)
TENSORRT_INSTALL = "pip install tensorrt (NVIDIA's wheels, for a machine with an NVIDIA GPU)"
MIN_TENSORRT_MAJOR = 10
METADATA_VERSION = 1
ENVIRONMENT_FIELDS = ("tensorrt_version", "gpu_name", "compute_capability")
DEFAULT_CACHE_DIR = Path("tensorrt_cache")
Log = Callable[[str], None]


def cache_dir_for(source: str | Path) -> Path:
    """The engine cache of a checkpoint or ONNX file: a folder beside it."""
    source = Path(source)
    return source.with_name(f"{source.stem}_tensorrt")


STRONG_TYPING_FROM = (10, 12)  # NetworkDefinitionCreationFlag.STRONGLY_TYPED; always on (flag ignored) in 11
GROUP_NORM_21_FROM = (10, 9)  # the ONNX parser's GroupNormalization-21 (per-channel scale and bias)
LEGACY_OPSET = 18  # before 10.9: GroupNormalization exported as InstanceNormalization + affine
TORCH_TENSORRT_EXPLICIT_TYPING_FROM = (2, 8)  # compile(use_explicit_typing=True)
TORCH_TENSORRT_STRONGLY_TYPED_FROM = (2, 10)  # explicit typing by default; enabled_precisions rejected/ignored


# --------------------------------------------------------------------------------------------
# Which build a TensorRT version gets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildPlan:
    """How an engine of one precision is built with one TensorRT version."""

    strongly_typed: bool  # create the network with STRONGLY_TYPED (10.12+; implied in 11)
    graph_precision: str  # the precision written into the ONNX graph (precision.mixed_precision_unet)
    builder_flags: tuple[str, ...]  # BuilderFlag names to set (weak typing only: FP16 / BF16 ...)
    pin_time_embedding: bool  # weak typing: force the layers that depend only on t to float32
    opset: int


def build_plan(tensorrt_version: str, precision: str, *, opset: int | None = None) -> BuildPlan:
    """The build for ``precision`` on ``tensorrt_version``.

    * 10.12 and later, 11.x: a strongly typed network from a graph that already holds the precision
      (fp16/bf16 mixed-precision ONNX); no precision flags (11 removed them).
    * 10.0-10.11: weak typing: the fp32 graph with BuilderFlag.FP16/BF16, and the timestep embedding
      pinned to float32 (OBEY_PRECISION_CONSTRAINTS), since sin/cos of large t lose their phase in fp16 or
      bf16.
    * The opset: 18 before 10.9 (no GroupNormalization-21 in the parser), else 21, or 22 for a bf16
      graph. An explicit ``opset`` is kept, unless it cannot hold the graph.
    """
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"unknown engine precision {precision!r}; choose one of {', '.join(ENGINE_PRECISIONS)}")
    version = version_tuple(tensorrt_version)
    if version < (MIN_TENSORRT_MAJOR,):
        raise ValueError(
            f"TensorRT {tensorrt_version} is too old; this code uses the 10.x/11.x API: {TENSORRT_INSTALL}"
        )
    if precision in QUANTIZED:
        # Explicit quantization only: the Q/DQ graph of formats/quantization.py (opset 21, GroupNormalization-21), built
        # strongly typed with no precision flags, as NVIDIA documents for Q/DQ networks. Implicit INT8 (a calibrator on
        # an fp32 graph, removed in 11) is never requested, on any version.
        if version < GROUP_NORM_21_FROM:
            raise ValueError(
                f"TensorRT {tensorrt_version} cannot parse the {precision} graph's GroupNormalization-21; "
                "install TensorRT 10.9 or later"
            )
        if opset is not None and opset != DEFAULT_OPSET:
            raise ValueError(f"{precision} graphs are written at opset {DEFAULT_OPSET}; drop --opset")
        return BuildPlan(
            strongly_typed=True,
            graph_precision=precision,
            builder_flags=(),
            pin_time_embedding=False,
            opset=DEFAULT_OPSET,
        )
    strongly_typed = version >= STRONG_TYPING_FROM
    graph_precision = precision if strongly_typed else "fp32"
    flags = () if strongly_typed or precision == "fp32" else (precision.upper(), "OBEY_PRECISION_CONSTRAINTS")
    automatic = LEGACY_OPSET if version < GROUP_NORM_21_FROM else default_opset(graph_precision)
    chosen = automatic if opset is None else opset
    if graph_precision == "bf16" and chosen < BF16_MIN_OPSET:
        raise ValueError(f"a bf16 engine is built from a bf16 graph, which needs --opset {BF16_MIN_OPSET} or later")
    if version < GROUP_NORM_21_FROM and chosen > LEGACY_OPSET:
        raise ValueError(
            f"TensorRT {tensorrt_version} parses GroupNormalization only up to opset {LEGACY_OPSET}; drop --opset "
            f"or pass --opset {LEGACY_OPSET} (or install TensorRT 10.9 or later)"
        )
    return BuildPlan(
        strongly_typed=strongly_typed,
        graph_precision=graph_precision,
        builder_flags=flags,
        pin_time_embedding=not strongly_typed and precision != "fp32",
        opset=chosen,
    )


def torch_tensorrt_arguments(version: str, precision: str) -> tuple[bool, dict]:
    """(whether to compile the explicitly mixed-precision U-Net, the extra compile() keyword
    arguments) for Torch-TensorRT ``version``; ValueError for a combination it cannot honour.

    From 2.10 networks are strongly typed and ``enabled_precisions`` raises (2.10-2.12) or is
    ignored (2.13+): the precision must be in the model. 2.8-2.9 take the same model with
    ``use_explicit_typing=True``. Older releases could only promise weak typing, which may put the
    timestep embedding in fp16; they are refused for fp16/bf16 rather than silently built wrong.
    """
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"unknown engine precision {precision!r}; choose one of {', '.join(ENGINE_PRECISIONS)}")
    if precision in QUANTIZED:
        raise ValueError(
            f"--trt_backend torch_tensorrt compiles fp32/fp16/bf16 modules here; a {precision} engine is built "
            "natively from the Q/DQ ONNX graph (drop --trt_backend)"
        )
    v = version_tuple(version)
    if precision == "fp32":
        return False, {"enabled_precisions": {torch.float32}} if v < TORCH_TENSORRT_STRONGLY_TYPED_FROM else {}
    if v >= TORCH_TENSORRT_STRONGLY_TYPED_FROM:
        return True, {}
    if v >= TORCH_TENSORRT_EXPLICIT_TYPING_FROM:
        return True, {"use_explicit_typing": True, "enabled_precisions": {torch.float32}}
    raise ValueError(
        f"torch_tensorrt {version} cannot build a {precision} module with the timestep embedding kept in fp32; "
        "upgrade it (pip install -U torch-tensorrt, 2.8 or later) or use --trt_backend native"
    )


def version_tuple(version: str) -> tuple[int, ...]:
    """ "10.12.0.36" -> (10, 12, 0, 36); "2.10.0+cu130" -> (2, 10, 0); "11.4" -> (11, 4); junk -> ()."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


# --------------------------------------------------------------------------------------------
# The engine cache: key, metadata file, verification
# --------------------------------------------------------------------------------------------


def runtime_environment(trt, device: torch.device) -> dict[str, str]:
    """TensorRT version, GPU name and compute capability: an engine runs only where these match."""
    major, minor = torch.cuda.get_device_capability(device)
    return {
        "tensorrt_version": trt.__version__,
        "gpu_name": torch.cuda.get_device_name(device),
        "compute_capability": f"{major}.{minor}",
    }


def engine_key(
    *, environment: Mapping[str, str], onnx_sha256: str, precision: str, profile: Mapping, optimization_level: int
) -> dict:
    """Everything an engine depends on (the ONNX file by its sha256), as JSON-comparable data."""
    return {
        "metadata_version": METADATA_VERSION,
        **{field: environment[field] for field in ENVIRONMENT_FIELDS},
        "onnx_sha256": onnx_sha256,
        "precision": precision,
        "shapes": {
            name: {"min": list(lo), "opt": list(opt), "max": list(hi)} for name, (lo, opt, hi) in profile.items()
        },
        "builder_optimization_level": optimization_level,
    }


def key_mismatches(stored: Mapping | None, expected: Mapping) -> list[str]:
    """The fields of ``expected`` that ``stored`` lacks or holds differently ("field: stored -> expected")."""
    if stored is None:
        return ["no metadata"]
    return [f"{k}: {stored.get(k)!r} -> {v!r}" for k, v in expected.items() if stored.get(k) != v]


def metadata_path(path: str | Path) -> Path:
    """The JSON file beside an engine or cached ONNX file: ``unet.engine`` -> ``unet.engine.json``."""
    path = Path(path)
    return path.with_name(f"{path.name}.json")


def read_metadata(path: Path) -> dict | None:
    """A cache metadata file's contents, or None when it is missing, too large, too deep or not JSON
    (which means: rebuild). Exported engines' metadata is read strictly, by
    tensorrt_integration.read_engine_metadata."""
    try:
        meta = parse_json(read_limited(path, kind="metadata"), source=path)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


class IntegrityError(ValueError):
    """A file's sha256 differs from the one its metadata recorded: it is refused, never loaded."""


def verified_bytes(path: Path, metadata: Mapping) -> bytes:
    """The bytes of ``path``, after checking their sha256 against ``metadata["sha256"]``."""
    data = Path(path).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if metadata.get("sha256") != digest:
        raise IntegrityError(
            f"{path} does not match the sha256 recorded in {metadata_path(path).name} "
            f"({digest[:12]} vs {str(metadata.get('sha256'))[:12]}); refusing to load it (an engine is executable "
            "code); delete both files to rebuild"
        )
    return data


def store_with_metadata(path: Path, data: bytes, metadata: Mapping) -> dict:
    """Write ``data`` and its metadata (plus its sha256), each atomically; returns the metadata."""
    meta_file = metadata_path(path)
    # The old metadata goes first: a crash between the two writes then leaves a file without
    # metadata (rebuilt next time), never new bytes beside an old hash (refused next time).
    meta_file.unlink(missing_ok=True)
    atomic_write(path, lambda f: f.write(data))
    meta = {**metadata, "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write(meta_file, lambda f: f.write(json.dumps(meta, indent=1, sort_keys=True).encode()))
    return meta


@dataclass(frozen=True)
class CacheLookup:
    data: bytes | None  # the verified engine, or None: build one
    reason: str


def lookup_engine(engine_path: Path, key: Mapping) -> CacheLookup:
    """Decide from the metadata file whether a cached engine can be used; verify its hash if so."""
    meta = read_metadata(metadata_path(engine_path))
    if meta is None or not engine_path.is_file():
        return CacheLookup(None, f"no cached engine in {engine_path.parent}")
    differences = key_mismatches(meta, key)
    if differences:
        return CacheLookup(None, "the cached engine was built for other settings (" + "; ".join(differences) + ")")
    return CacheLookup(verified_bytes(engine_path, meta), f"cached engine {engine_path}")


def get_or_build_engine(engine_path: Path, *, key: Mapping, build: Callable[[], bytes], log: Log) -> bytes:
    """The cached engine when its metadata matches ``key``, else ``build()``'s, stored with ``key``."""
    found = lookup_engine(engine_path, key)
    log(("using " if found.data is not None else "building a TensorRT engine: ") + found.reason)
    if found.data is not None:
        return found.data
    data = build()
    store_with_metadata(engine_path, data, key)
    return data
