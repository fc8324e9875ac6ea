"""The sampling benchmark's rows: each a sample-mode implementation with its parameters, or a peer timed beside them.

    row = ROWS["cuda_compile"]           # SamplingRow(key="cuda_compile", implementation="cuda", compile=True, ...)
    parse_rows("all", device_type="cpu") # the rows --rows all runs on a CPU

A variant (``cuda_fp32``, ``cuda_compile_max_autotune``, ``onnxruntime_int8``, ``openvino_f32``, ...) is an
implementation with a precision, the fused U-Net runner or torch.compile fixed: a registry entry
(backends/registry.REGISTRY, what ``--implementation`` offers) or a peer (registry.PEERS: ``compile``,
``torchscript``, ``diffusers``, ``openvino``, which no user picks for sampling). Row keys are the names ``--rows``
takes and the JSON's ``name`` field; sampling_bench.make_row builds a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingRow:
    """One row: the implementation named ``implementation`` run with these parameters."""

    key: str
    implementation: str  # a registry.REGISTRY or registry.PEERS name
    precision: str | None = None  # the row always runs in this precision (else the run's, where it can)
    fused_unet: bool | None = False  # cuda: the fused U-Net runner always (True), never (False), where verified (None)
    compile: bool | str = False  # cuda: its U-Net through torch.compile (a mode name: that mode) inside the graph
    openvino_precision: str | None = None  # openvino: its inference precision hint (None: OpenVINO's default)
    winograd: bool = True  # cuda's runner: Winograd convolutions where they are faster (False: oneDNN's everywhere)
    default_on: tuple[str, ...] = ("cpu", "cuda")  # --rows all includes it on these devices


# In this order: the table's, and the one --rows' refusal lists.
ROWS: dict[str, SamplingRow] = {
    row.key: row
    for row in (
        SamplingRow("original", "original"),
        SamplingRow("cuda", "cuda", fused_unet=None),  # as sample mode runs it: the runner where it is verified
        SamplingRow("cuda_steps", "cuda_steps", default_on=()),
        # The step ops with the fused U-Net runner on any device and precision, also where cuda does not use it.
        SamplingRow("cuda_fused_unet", "cuda", fused_unet=True, default_on=("cuda",)),
        # The runner with oneDNN's convolutions where cuda runs Winograd's: what Winograd's kernels gain on this CPU.
        SamplingRow("cuda_onednn", "cuda", fused_unet=True, winograd=False, default_on=()),
        SamplingRow("cuda_compile", "cuda", compile=True, default_on=("cuda",)),
        SamplingRow("cuda_compile_max_autotune", "cuda", compile="max-autotune-no-cudagraphs", default_on=("cuda",)),
        # cuda_steps in fp32 whatever --precision says: the staircase's graphed eager fp32 step.
        SamplingRow("cuda_fp32", "cuda_steps", precision="fp32", default_on=("cuda",)),
        SamplingRow("diffusers", "diffusers"),
        SamplingRow("compile", "compile"),
        SamplingRow("onnxruntime", "onnxruntime"),
        SamplingRow("onnxruntime_int8", "onnxruntime", precision="int8", default_on=()),  # beside the fp32 rows
        SamplingRow("openvino", "openvino", default_on=("cpu",)),
        SamplingRow("openvino_f32", "openvino", openvino_precision="f32", default_on=("cpu",)),
        SamplingRow("torchscript", "torchscript"),
        SamplingRow("tensorrt", "tensorrt"),
    )
}


def parse_rows(text: str, *, device_type: str = "cuda") -> list[str]:
    """The --rows list; "all" is every row that is a default row on this device (cuda_compile is not on a CPU: a
    second compile of the same U-Net through the same CPU kernels)."""
    if text == "all":
        return [key for key, row in ROWS.items() if device_type in row.default_on]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise ValueError(f"unknown benchmark rows {unknown or text!r}; choose from {', '.join(ROWS)}, or all (alone)")
    return names
