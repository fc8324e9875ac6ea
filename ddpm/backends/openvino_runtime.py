"""OpenVINO running the tool's own ONNX export of a U-Net, inside the original sampling loop (benchmark rows).

    unet = as_openvino(model)               # OpenVINO's default inference precision on this CPU
    unet = as_openvino(model, hint="f32")   # forced f32
    eps = unet(x_t, t)                                # the PyTorch U-Net's call: any sampling loop takes it

The U-Net is exported as the onnxruntime row exports it (formats/exporters.export_onnx_model, dynamic batch) and
compiled for the CPU with the latency hint and as many threads as PyTorch uses. openvino is optional and imported
when used (``pip install openvino``).

Compiling can crash the whole process on some CPUs (BENCHMARKS.md, "OpenVINO on this tool's ONNX export"), so
the graph is compiled first in a child process; a crash or failure there becomes a one-line ValueError.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from ddpm.util.messages import first_line

OPENVINO_INSTALL = "pip install openvino"

# The child: compile the ONNX file at argv[1] with the KEY=VALUE config in argv[2:], print the precision used.
CHILD_COMPILE = """
import sys
import openvino as ov
core = ov.Core()
config = dict(arg.split("=", 1) for arg in sys.argv[2:])
compiled = core.compile_model(core.read_model(sys.argv[1]), "CPU", config)
print(compiled.get_property("INFERENCE_PRECISION_HINT"))
"""

# OpenVINO's element type names -> this tool's precision names.
PRECISION_NAMES = {
    "f32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "f16": "fp16",
    "float16": "fp16",
}


def import_openvino():
    try:
        import openvino
    except ImportError as exc:
        raise ImportError(f"openvino is not installed ({first_line(exc)}); install it: {OPENVINO_INSTALL}") from exc
    return openvino


def precision_name(ov_type: object) -> str:
    """OpenVINO's element type (``<Type: 'bfloat16'>``, ``bf16``) as a precision name ("bf16")."""
    text = str(ov_type).removeprefix("<Type: ").strip("'<>\" ")
    return PRECISION_NAMES.get(text, text)


def compile_config(hint: str | None) -> dict[str, str]:
    """The CPU plugin's settings: latency hint, PyTorch's thread count, and ``hint`` as the inference precision
    (None: OpenVINO's default for this CPU)."""
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": str(torch.get_num_threads())}
    # No pinning: OpenVINO's pinning of the process's threads to cores slows every row timed after it
    # (BENCHMARKS.md, "OpenVINO on this tool's ONNX export").
    config["ENABLE_CPU_PINNING"] = "NO"
    if hint is not None:
        config["INFERENCE_PRECISION_HINT"] = hint
    return config


def compile_in_child(
    onnx_path: Path, config: dict[str, str], *, code: str = CHILD_COMPILE, timeout_s: float = 900
) -> str:
    """Compile ``onnx_path`` with ``config`` in a child process; returns the inference precision it used.
    ValueError (one line) if the child crashed (the signal's name), failed or ran past ``timeout_s``."""
    settings = ", ".join(f"{k}={v}" for k, v in config.items() if k == "INFERENCE_PRECISION_HINT") or "its defaults"
    command = [sys.executable, "-c", code, str(onnx_path), *(f"{k}={v}" for k, v in config.items())]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ValueError(f"OpenVINO had not compiled the U-Net ({settings}) after {timeout_s:.0f} s") from exc
    if result.returncode < 0:
        try:
            name = signal.Signals(-result.returncode).name
        except ValueError:
            name = f"signal {-result.returncode}"
        raise ValueError(f"OpenVINO crashed ({name}) while compiling the U-Net with {settings}")
    lines = (result.stderr or result.stdout).strip().splitlines()
    if result.returncode != 0:
        raise ValueError(
            f"OpenVINO could not compile the U-Net with {settings} ({lines[-1] if lines else 'no output'})"
        )
    return precision_name(result.stdout.strip().splitlines()[-1])


class OpenVinoUNet(nn.Module):
    """eps = unet(x_t, t[, y]) through a compiled OpenVINO model of one static batch (CPU tensors, float32 out)."""

    def __init__(self, compiled, *, input_names: tuple[str, ...], precision: str, version: str) -> None:
        super().__init__()
        self.compiled, self.input_names = compiled, input_names
        self.request = compiled.create_infer_request()
        self.precision = precision  # the inference precision OpenVINO used ("bf16", "fp32")
        self.provider = f"OpenVINO {version.split('-')[0]}, {precision}"  # shown beside the row's name

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        caller = x_t.device
        inputs = [x_t.detach().float().cpu().contiguous(), t.detach().to("cpu", torch.int64).contiguous()]
        if y is not None:
            inputs.append(y.detach().to("cpu", torch.int64).contiguous())
        feeds = {name: tensor.numpy() for name, tensor in zip(self.input_names, inputs, strict=True)}
        self.request.infer(feeds, share_inputs=True)
        eps = torch.from_numpy(self.request.get_output_tensor(0).data.copy())  # the request reuses its buffer
        return eps.to(caller)  # (B, C, H, W) float32


def as_openvino(model: nn.Module, *, hint: str | None = None, opset: int | None = None) -> OpenVinoUNet:
    """``model`` (a PyTorch U-Net) exported to ONNX and compiled by OpenVINO for the CPU
    (first in a child process: see the module's docstring). ValueError if OpenVINO cannot or crashes."""
    from basic_diffusion import UNet
    from ddpm.formats.exporters import export_onnx_model
    from ddpm.formats.unet_io import DEFAULT_OPSET, UNetIO, artifact_metadata

    ov = import_openvino()
    if not isinstance(model, UNet):
        raise ValueError("the OpenVINO rows run a checkpoint's U-Net, exported to ONNX in memory")
    io = UNetIO.from_config(model.config)
    metadata = artifact_metadata(model_config=model.config, schedule_config=None, weights=None)
    proto = export_onnx_model(model.cpu(), metadata=metadata, opset=opset or DEFAULT_OPSET)
    config = compile_config(hint)
    with tempfile.TemporaryDirectory(prefix="ddpm-openvino-") as folder:
        path = Path(folder, "unet.onnx")
        path.write_bytes(proto.SerializeToString())
        precision = compile_in_child(path, config)  # survives, or says what happened
        compiled = ov.Core().compile_model(str(path), "CPU", config)
    return OpenVinoUNet(compiled, input_names=tuple(io.input_names), precision=precision, version=ov.__version__)
