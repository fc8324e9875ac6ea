"""INT8 U-Nets: explicit Q/DQ ONNX graphs calibrated on the model's own sampling trajectories.

    python main.py --mode export --format onnx --precision int8 --model_path checkpoints/digits.pt \\
        --sampler dpm_solver_sde --calibration_samples 16          # -> checkpoints/digits_int8.onnx
    python main.py --mode sample --model_path checkpoints/digits_int8.onnx --implementation onnxruntime

The graph is the fp32 export (formats/exporters.py) with QuantizeLinear/DequantizeLinear pairs written
in by onnxruntime's static quantizer (``quantize_static``, Q/DQ format), the explicit form TensorRT 10/11
builds strongly typed and onnxruntime runs as QLinearConv on the CPU:

* quantized: every convolution but the first and the last, weights per output channel and activations
  per tensor, both symmetric signed INT8 (zero points 0, as TensorRT requires);
* kept in fp32 (the mixed-precision graphs' policy): the time embedding and its MLP
  (Gemm), the label embedding, GroupNorm (its statistics and output), SiLU, the attention matmuls and
  their softmax, the first and the last convolution; inputs and output stay fp32, so every sampling loop
  runs the file unchanged.

Calibration needs no dataset: :func:`calibration_feeds` runs the sampler the user names on
``calibration_samples`` seeded trajectories with the fp32 model, ``--batch_size`` at a time, and records
the U-Net's inputs at every step, since activation ranges move with t. Activation ranges are the min and max over
those inputs (MinMax); the feeds are made a batch at a time, so memory is that of one batch.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddpm.choices import CALIBRATION_DEFAULTS
from ddpm.conditioning import Guidance
from noise_schedule import SamplingPlan

QUANTIZED_OPS = ("Conv",)  # the op types given Q/DQ pairs
KEPT_FP32_WEIGHTS = ("conv_in.weight", "conv_out.weight")  # the first and the last convolution stay fp32
DEFAULT_CALIBRATION_SAMPLES = CALIBRATION_DEFAULTS["samples"]
DEFAULT_CALIBRATION_SAMPLER = (CALIBRATION_DEFAULTS["sampler"], CALIBRATION_DEFAULTS["sampling_steps"])
MAX_CALIBRATION_SAMPLES = 1024


class _Recorder(nn.Module):
    """Runs ``model`` and keeps a copy of every input it was called with."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append(
            (x.detach().cpu().clone(), t.detach().cpu().clone(), None if y is None else y.detach().cpu().clone())
        )
        return self.model(x, t) if y is None else self.model(x, t, y)


def calibration_feeds(
    model: nn.Module, plan: SamplingPlan, *, samples: int, seed: int = 0, batch_size: int = 64
) -> Iterator[dict[str, np.ndarray]]:
    """The U-Net inputs (onnxruntime feeds: x_t, t[, y]) along ``samples`` trajectories of ``plan``, one feed
    per step of each batch (a class-conditional model's doubled with the null label, as guidance at scale != 1
    runs it). Lazily: the trajectories run ``batch_size`` at a time, each batch when its first feed is asked for,
    so memory holds one batch's trajectory whatever ``samples`` is."""
    from basic_diffusion import sample

    if not 1 <= samples <= MAX_CALIBRATION_SAMPLES:
        raise ValueError(f"--calibration_samples must be between 1 and {MAX_CALIBRATION_SAMPLES}, got {samples}")
    if batch_size < 1:
        raise ValueError(f"--batch_size must be a positive integer, got {batch_size}")
    config = model.config
    generator = torch.Generator().manual_seed(seed)  # one noise stream for all the batches
    for start in range(0, samples, batch_size):
        n = min(batch_size, samples - start)
        guidance = None
        if config.num_classes:  # every class in turn, and the null label beside them
            labels = torch.arange(start, start + n) % config.num_classes
            guidance = Guidance(labels=labels, null_label=config.null_label, scale=2.0)
        recorder = _Recorder(model)
        with torch.no_grad():
            sample(recorder, plan, shape=config.sample_shape(n), generator=generator, guidance=guidance)
        for x, t, y in recorder.calls:
            feed = {"x_t": x.float().numpy(), "t": t.long().numpy()}
            if y is not None:
                feed["y"] = y.long().numpy()
            yield feed


def import_quantizer():
    try:
        from onnxruntime import quantization
    except ImportError as exc:
        raise ImportError("INT8 export needs onnxruntime's quantizer: pip install onnxruntime") from exc
    return quantization


def quantize_unet(
    proto,
    feeds: Iterable[dict[str, np.ndarray]],
    *,
    precision: str = "int8",
    keep_fp32: Sequence[str] = KEPT_FP32_WEIGHTS,
):
    """The Q/DQ version (``precision`` int8, or fp8: E4M3) of the fp32 U-Net graph ``proto`` (see the module
    docstring), calibrated on ``feeds``; its metadata is ``proto``'s (the caller updates it)."""
    import onnx

    quantization = import_quantizer()
    kind = quantization.QuantType.QInt8 if precision == "int8" else quantization.QuantType.QFLOAT8E4M3FN
    names = {i.name for i in proto.graph.input}
    feeds = ({k: v for k, v in feed.items() if k in names} for feed in feeds)  # lazily: one batch at a time

    class Reader(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter(feeds)

        def get_next(self):
            return next(self.items, None)

    excluded = [
        node.name for node in proto.graph.node if node.op_type in QUANTIZED_OPS and set(node.input) & set(keep_fp32)
    ]
    with _temporary_folder() as folder, _quiet_root_logger():
        source, target = folder / "fp32.onnx", folder / "int8.onnx"
        onnx.save(proto, source)
        quantization.quantize_static(
            str(source),
            str(target),
            Reader(),
            quant_format=quantization.QuantFormat.QDQ,
            op_types_to_quantize=list(QUANTIZED_OPS),
            nodes_to_exclude=excluded,
            per_channel=True,
            reduce_range=False,
            activation_type=kind,
            weight_type=kind,
            calibrate_method=quantization.CalibrationMethod.MinMax,
            # (not CalibMaxIntermediateOutputs: this onnxruntime drops the ranges collected so far when it is reached;
            # each feed's record is its tensors' min and max, two numbers each)
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
        )
        quantized = onnx.load(str(target))
    del quantized.metadata_props[:]
    quantized.metadata_props.extend(proto.metadata_props)
    return quantized


@contextlib.contextmanager
def _temporary_folder() -> Iterator[Path]:
    """The quantizer's working folder (it reads and writes files only), in TMPDIR, removed however the block ends. A
    write the file system refuses there (a full TMPDIR, also one that onnx's writers meet without saying so) ends in
    the one line every refused write ends in (util/safe_files.write_error), never in onnx's or onnxruntime's
    traceback."""
    from ddpm.util.safe_files import full_disk, write_error, write_failure

    where = f"the INT8 calibration's temporary files in {tempfile.gettempdir()} (TMPDIR)"
    try:
        with tempfile.TemporaryDirectory(prefix="ddpm-int8-") as folder:
            try:
                yield Path(folder)
            except Exception as exc:
                # onnx's C++ shape inference writes a file cut short without a word, then its reader fails on it
                failure = write_failure(exc) or full_disk(folder)
                if failure is None:
                    raise
                raise write_error(where, failure, existed=False) from exc
    except Exception as exc:  # creating or removing the folder; a WriteError from the block is already one line
        failure = write_failure(exc)
        if failure is None:
            raise
        raise write_error(where, failure, existed=False) from exc


@contextlib.contextmanager
def _quiet_root_logger():
    """Silence the advice onnxruntime's quantizer logs through the root logger ("consider pre-processing"), which
    does not apply to these graphs."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def quantized_nodes(proto) -> dict[str, list[str]]:
    """Which nodes take a DequantizeLinear output (run in INT8) and which do not: {"int8": [...], "fp32": [...]},
    node names; for the structure tests and the export's report."""
    dequantized = {node.output[0] for node in proto.graph.node if node.op_type == "DequantizeLinear"}
    out = {"int8": [], "fp32": []}
    for node in proto.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        out["int8" if any(i in dequantized for i in node.input) else "fp32"].append(node.name)
    return out


FP8_MIN_COMPUTE_CAPABILITY = (8, 9)  # Ada and Hopper: TensorRT's FP8 kernels


def fp8_runtime_problem(
    *, tensorrt_available: bool | None = None, compute_capability: tuple[int, int] | None = None
) -> str | None:
    """Why no runtime here can run an FP8 Q/DQ graph (None: TensorRT and an FP8-capable GPU are both here).
    onnxruntime has no FP8 convolutions on any provider this project uses, so only TensorRT counts."""
    import importlib.util

    if tensorrt_available is None:
        tensorrt_available = importlib.util.find_spec("tensorrt") is not None
    if compute_capability is None and torch.cuda.is_available():
        compute_capability = torch.cuda.get_device_capability()
    if not tensorrt_available:
        return "TensorRT is not installed here (onnxruntime has no FP8 convolutions), so it could not be run or checked"
    if compute_capability is None or tuple(compute_capability) < FP8_MIN_COMPUTE_CAPABILITY:
        have = (
            "no GPU"
            if compute_capability is None
            else f"a GPU of compute capability {compute_capability[0]}.{compute_capability[1]}"
        )
        return f"TensorRT runs FP8 on compute capability 8.9 and newer, and this machine has {have}"
    return None
