"""--mode export: a checkpoint's U-Net (and a latent model's decoder) as ONNX, TorchScript or a TensorRT
engine, each checked against PyTorch before it is written.

    python main.py --mode export --format onnx --model_path checkpoints/mnist.pt          # -> checkpoints/mnist.onnx
    python main.py --mode export --format onnx --precision fp16 --model_path checkpoints/mnist.pt
    python main.py --mode export --format tensorrt --model_path checkpoints/mnist.onnx     # a GPU with TensorRT

The writers are formats/exporters.py's; loading any of the files back is backends/artifacts.py's.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from ddpm.backends.artifacts import decoder_path, load_artifact, load_model_state
from ddpm.backends.runtimes import (
    OnnxRuntimeDecoder,
    OnnxRuntimeUNet,
    _ort_reason,
    import_onnxruntime,
    load_torchscript,
    onnxruntime_session,
)
from ddpm.choices import FORMATS
from ddpm.formats.diffusers_io import diffusers_folder_files
from ddpm.formats.engine_cache import metadata_path
from ddpm.formats.exporters import (
    _quiet_torchscript,
    export_decoder_onnx,
    export_onnx_model,
    import_onnx,
    save_torchscript,
    trace_decoder,
    trace_torchscript,
)
from ddpm.formats.torch_files import FORMAT_SUFFIXES, artifact_kind
from ddpm.formats.unet_io import UNetIO, artifact_metadata, default_opset, max_abs_diff
from ddpm.latent.autoencoder import FirstStage
from ddpm.requests import DECODER_KINDS, EXPORT_DECODER, EXPORT_METADATA, Calibration, ExportRequest, check_mode_outputs
from ddpm.util.memory import is_out_of_memory
from ddpm.util.model_folders import check_folder_output, replaced_files
from ddpm.util.precision import QUANTIZED
from ddpm.util.safe_files import as_input, atomic_write, check_outputs, check_target, sibling_temporary
from tensorrt_integration import TensorRTOptions


def run_export(request: ExportRequest) -> None:
    source, output = request.source, request.output
    lines = export_artifact(
        source.path,
        fmt=request.fmt,
        output=output,
        weights=source.weights,
        device=request.device,
        precision=request.precision,
        opset=request.opset,
        tensorrt_options=TensorRTOptions.for_source(source.path, **asdict(request.engine))
        if request.fmt == "tensorrt"
        else None,
        autoencoder=source.autoencoder,
        calibration=request.calibration,
        overwrite=request.overwrite,
    )
    for line in lines:
        print(line)


def checked_decoder_target(output: Path, *, fmt: str, inputs: Mapping[str, Path | str | None]) -> Path:
    """Where a latent model's exported decoder goes (:func:`decoder_path`), refused as any output is
    (``inputs``: every file the export read, the autoencoder included)."""
    file = decoder_path(output)
    check_mode_outputs("export", {EXPORT_DECODER: file}, inputs=inputs, fmt=fmt)
    return file


def export_decoder(
    stage: FirstStage,
    *,
    fmt: str,
    inputs: Mapping,
    output: Path,
    device: torch.device,
    opset: int,
    precision: str = "fp32",
) -> tuple[dict, str, Callable[[], None]]:
    """A latent model's decoder exported for beside its U-Net (ONNX in ``precision`` too) and checked
    against PyTorch; returns (the metadata entry naming it, a report line, write(): the file written,
    atomically, just before the U-Net)."""
    file = checked_decoder_target(output, fmt=fmt, inputs=inputs)
    decoder = stage.decoder.to(device).eval()
    reference, compared = decoder, "against PyTorch"
    if fmt == "onnx":
        data = export_decoder_onnx(decoder, io=stage.io, opset=opset, precision=precision).SerializeToString()
        if precision != "fp32":
            from ddpm.util.precision import mixed_precision_decoder

            reference, compared = mixed_precision_decoder(decoder, precision), f"against PyTorch's {precision} decoder"
        try:
            runner = OnnxRuntimeDecoder(onnxruntime_session(data, device=device), image_shape=stage.image_shape)
        except ValueError as exc:
            if precision == "fp32":
                raise
            # as for the U-Net: onnxruntime's CPU provider lacks some low-precision kernels
            runner, reference = reference, decoder
            compared = (
                f"onnxruntime here cannot run it ({_ort_reason(exc)}); PyTorch's {precision} decoder against fp32"
            )
    else:
        buffer = io.BytesIO()
        traced = trace_decoder(decoder, latent_shape=stage.latent_shape)
        with _quiet_torchscript():  # torch.jit.save's deprecation warning
            torch.jit.save(traced, buffer)
        data, runner = buffer.getvalue(), traced
    z = torch.randn(3, *stage.latent_shape, generator=torch.Generator().manual_seed(1)).to(device)  # another batch size
    with torch.no_grad():
        diff = (runner(z) - reference(z)).abs().max().item()
    entry = {
        "file": file.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "latent_shape": list(stage.latent_shape),
        "image_shape": list(stage.image_shape),
    }
    line = f"wrote {file} (the decoder; {compared}: max abs diff {diff:.3e})"
    return entry, line, lambda: atomic_write(file, lambda f: f.write(data))


# --------------------------------------------------------------------------------------------
# Exporting a checkpoint
# --------------------------------------------------------------------------------------------


def check_export_paths(
    source: Path, output: Path, fmt: str, *, overwrite: bool = False, autoencoder: str | None = None
) -> bool:
    """Refuse, before any work, an export that would destroy an input or change what an existing folder means
    (with ``autoencoder`` given, the model is a latent one: its decoder beside --output is checked too; a linked
    autoencoder's once the model is read, :func:`checked_decoder_target`); returns whether a diffusers --output holds
    an earlier export to replace (:func:`check_diffusers_output`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt != "tensorrt" and artifact_kind(source) != "checkpoint":  # an engine is also built from an ONNX file
        raise ValueError(
            f"--model_path {source} is {KIND_ARTICLES[artifact_kind(source)]}, which --format {fmt} does not read; "
            "it exports a checkpoint (.pt), a .safetensors export or a diffusers model folder"
        )
    if fmt == "diffusers":
        return check_diffusers_output(source, output, overwrite=overwrite)
    if output.suffix not in FORMAT_SUFFIXES[fmt]:
        raise ValueError(
            f"--format {fmt} needs an --output ending in {' or '.join(FORMAT_SUFFIXES[fmt])}, got {output}"
        )
    outputs = {"--output": output}
    if autoencoder and fmt in DECODER_KINDS:
        outputs[EXPORT_DECODER] = decoder_path(output)
    check_mode_outputs(
        "export", outputs, inputs={"--model_path": as_input(source), "--autoencoder": autoencoder}, fmt=fmt
    )
    return False


KIND_ARTICLES = {"onnx": "an ONNX file", "torchscript": "a TorchScript file", "tensorrt": "a TensorRT engine"}


def diffusers_names(output: Path) -> list[str]:
    """The files a diffusers export writes, as paths inside ``output`` (model_index.json, the folder's marker, last)."""
    return [path.relative_to(output).as_posix() for path in diffusers_folder_files(output).values()]


def check_diffusers_output(source: Path, output: Path, *, overwrite: bool) -> bool:
    """A diffusers --output folder (util/model_folders.check_folder_output): new, or holding only the files an earlier
    export wrote (recorded in its marker, diffusers_io.EXPORT_MARKER: another tool's model under the same names is
    refused), and those replaced only with ``overwrite`` (returns True); never the working folder, an input, a folder
    holding one, nor a folder of the user's files. Each file is then checked as any output is."""
    files = diffusers_folder_files(output)  # refuses an --output that is a file
    inputs = {"--model_path": as_input(source)}
    replace = check_folder_output(
        "--output", output, writes=diffusers_names(output), writer="--format diffusers", inputs=inputs,
        overwrite=overwrite,
    )  # fmt: skip
    check_outputs(files, inputs=inputs)
    check_target(sibling_temporary(output), flag="--output")  # its folder must take the new files first
    return replace


def export_weights(
    model, schedule_config, *, fmt: str, source: Path, output: Path, weights: str, labels: dict, replace: bool = False
) -> list[str]:
    """``--format safetensors`` (the weights and this tool's metadata) or ``diffusers`` (a DDPMPipeline
    folder; with ``replace``, an earlier export's files replaced: written beside ``output``, read back, then moved
    in); each read back and compared with the model it came from before the report says so."""
    from ddpm.backends import artifacts
    from ddpm.formats import safetensors_io

    if fmt == "safetensors":
        metadata = artifact_metadata(
            model_config=model.config, schedule_config=schedule_config, weights=weights, **labels
        )
        safetensors_io.write_safetensors(model, output, metadata=metadata)
        return [
            f"wrote {output} (safetensors, {weights} weights, this tool's configs in its metadata)",
            read_back(model, output),
        ]
    # Written beside --output, then moved in: a failed export leaves neither a folder nor a file of its own.
    with replaced_files(output, diffusers_names(output)) as folder:
        files = artifacts.write_diffusers_folder(model, schedule_config, folder, source=str(source))
        checked = read_back(model, folder)  # before the move: files that differ never replace the old ones
    names = ", ".join(str(f.relative_to(folder)) for f in files)
    written = f"{'replaced' if replace else 'wrote'} {output}/ ({names}; diffusers' DDPMPipeline loads it)"
    if model.config.num_classes:
        classes = model.config.num_classes
        written += f"; num_class_embeds {classes + 1}: classes 0-{classes - 1}, the last the null label"
    return [written, checked]


def read_back(model, path: Path) -> str:
    state = load_model_state(path)
    reference = model.state_dict()
    if not all(torch.equal(state["ema"][k], reference[k].float().cpu()) for k in reference):
        raise RuntimeError(f"{path}: the weights read back differ from the model's")  # a renaming bug; never expected
    return "read back: the same weights, bit for bit"


def export_checkpoint(
    source: str | Path,
    *,
    fmt: str,
    output: str | Path,
    weights: str = "ema",
    device: torch.device,
    opset: int | None = None,
    precision: str = "fp32",
    autoencoder: str | None = None,
    calibration: Calibration | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Export a checkpoint's U-Net (ONNX, TorchScript, safetensors or a diffusers folder), check it against
    PyTorch; returns report lines. A latent model's decoder is exported beside it (:func:`export_decoder`).

    ONNX may be written in mixed precision (``precision`` fp16/bf16); its check is then against
    the same mixed-precision U-Net in PyTorch, and the fp32 U-Net's difference is reported too.
    """
    source, output = Path(source), Path(output)
    # 1. Every flag and path checked before anything is read.
    replace = check_export_request(
        source, output, fmt=fmt, precision=precision, overwrite=overwrite, autoencoder=autoencoder
    )
    opset = default_opset(precision) if opset is None else opset
    if fmt == "onnx":
        device = torch.device("cpu")  # an ONNX graph holds no device; export and compare on the CPU
    # 2. The model, and what travels with it into the file's metadata, opened as every mode opens a model file
    # (load_artifact): a latent model's autoencoder link is resolved there, once, and comes with it.
    artifact = load_artifact(source, device=device, weights=weights, autoencoder=autoencoder)
    model, schedule_config, stage = artifact.model, artifact.schedule_config, artifact.first_stage
    labels = {"class_names": list(artifact.class_names)} if artifact.class_names else {}  # a conditional U-Net's
    if artifact.dataset is not None:  # evaluate judges the file as its training data without --dataset
        labels["dataset"] = artifact.dataset
    # 3. Weights-only formats: written, read back, compared.
    if fmt in ("safetensors", "diffusers"):
        if stage is not None:
            raise ValueError(
                f"--format {fmt} holds a U-Net alone; a latent model needs its autoencoder too: export it as onnx or "
                "torchscript"
            )
        return export_weights(
            model,
            schedule_config,
            fmt=fmt,
            source=source,
            output=output,
            weights=weights,
            labels=labels,
            replace=replace,
        )
    # 4. A latent model's decoder, exported and checked beside the U-Net (written just before it).
    report, write_decoder = [], lambda: None
    if stage is not None:
        check_mode_outputs("export", {"--output": output}, inputs=artifact.inputs, fmt=fmt)  # its autoencoder: an input
        entry, line, write_decoder = export_decoder(
            stage,
            fmt=fmt,
            inputs=artifact.inputs,
            output=output,
            device=device,
            opset=opset,
            precision="fp32" if precision in QUANTIZED else precision,  # not quantized: it runs once per image
        )
        labels["decoder"] = entry
        report.append(line)
    # 5. The U-Net's graph or program, written and compared with PyTorch at several batch sizes.
    export = export_onnx if fmt == "onnx" else export_torchscript
    lines = export(
        model,
        schedule_config,
        output=output,
        weights=weights,
        labels=labels,
        device=device,
        opset=opset,
        precision=precision,
        calibration=calibration,
        write_decoder=write_decoder,
    )
    return [*lines, *report]


def check_export_request(
    source: Path, output: Path, *, fmt: str, precision: str, overwrite: bool, autoencoder: str | None = None
) -> bool:
    """The format's precision and packages, and the paths (:func:`check_export_paths`): True when a diffusers
    --output holds an earlier export to replace."""
    if fmt in ("torchscript", "safetensors", "diffusers") and precision != "fp32":
        raise ValueError(
            f"--format {fmt} holds fp32 weights; --precision fp16/bf16 applies to --format onnx and tensorrt"
        )
    replace = check_export_paths(source, output, fmt, overwrite=overwrite, autoencoder=autoencoder)
    if fmt == "tensorrt":
        raise ValueError("build TensorRT engines with tensorrt_integration.export_engine")
    if fmt == "onnx":
        import_onnx()  # fail before any work if a package is missing
        import_onnxruntime()
    return replace


EXPORT_BATCH_SIZES = (1, 3, 8)  # an exported U-Net is compared with PyTorch at each (dynamic batch)


def export_onnx(
    model,
    schedule_config,
    *,
    output: Path,
    weights: str,
    labels: dict,
    device,
    opset: int,
    precision: str,
    calibration: Calibration | None,
    write_decoder,
) -> list[str]:
    """The U-Net as an ONNX graph (fp32, mixed precision, or quantized: :func:`quantize_export`), run by onnxruntime
    against PyTorch; written after its decoder."""
    io = UNetIO.from_config(model.config)  # with the label input y for a conditional U-Net
    metadata = artifact_metadata(
        model_config=model.config, schedule_config=schedule_config, weights=weights, opset=opset, **labels
    )
    report = []
    if precision in QUANTIZED:  # the fp32 graph, then Q/DQ pairs calibrated on the model's own trajectories
        proto, quality = quantize_export(
            export_onnx_model(model, metadata=metadata, opset=opset),
            model,
            schedule_config,
            calibration=calibration,
            precision=precision,
        )
        report.append(quality)
    else:
        proto = export_onnx_model(model, metadata=metadata, opset=opset, precision=precision)
    data = proto.SerializeToString()
    if precision in QUANTIZED:
        reference, compared = model, f"onnxruntime {precision} vs PyTorch fp32 ({weights} weights)"
    elif precision == "fp32":
        reference, compared = model, f"onnxruntime vs PyTorch ({weights} weights)"
    else:
        from ddpm.util.precision import mixed_precision_unet

        reference = mixed_precision_unet(model, precision)
        compared = f"onnxruntime vs PyTorch's {precision} mixed-precision U-Net ({weights} weights)"
    try:
        runtime = OnnxRuntimeUNet(onnxruntime_session(data, device=device), io=io)
    except ValueError as exc:
        if precision == "fp32":
            raise
        # onnxruntime's CPU provider lacks some low-precision kernels (bf16 convolutions): say so,
        # and compare the mixed-precision U-Net in PyTorch with the fp32 one instead.
        runtime, reference = reference, model
        compared = f"onnxruntime here cannot run it ({_ort_reason(exc)}); instead PyTorch's {precision} U-Net vs fp32"
    write_decoder()
    atomic_write(output, lambda f: f.write(data))
    diff = max_abs_diff(runtime, reference, io=io, batch_sizes=EXPORT_BATCH_SIZES)
    checked = f"{precision}, opset {opset}, dynamic batch, onnx.checker passed"
    return [*compared_lines(output, checked, compared, diff), *report]


def export_torchscript(
    model, schedule_config, *, output: Path, weights: str, labels: dict, device, write_decoder, **_
) -> list[str]:
    """The U-Net traced to TorchScript on ``device``, written after its decoder, loaded back and compared."""
    metadata = artifact_metadata(
        model_config=model.config, schedule_config=schedule_config, weights=weights, traced_on=device.type, **labels
    )
    module = trace_torchscript(model)
    write_decoder()
    save_torchscript(module, output, metadata=metadata)
    loaded, *_ = load_torchscript(output, device=device, trusted=True)  # the file traced just now
    diff = max_abs_diff(loaded, model, io=UNetIO.from_config(model.config), batch_sizes=EXPORT_BATCH_SIZES)
    return compared_lines(output, f"traced on {device.type}", f"TorchScript vs PyTorch ({weights} weights)", diff)


def compared_lines(output: Path, checked: str, compared: str, diff: float) -> list[str]:
    sizes = ", ".join(map(str, EXPORT_BATCH_SIZES))
    return [f"wrote {output} ({checked})", f"{compared}: max abs diff {diff:.3e} at batch sizes {sizes}"]


def calibration_estimate(model, calibration: Calibration, *, steps: int) -> str:
    """The calibration's line before it starts (util/estimates.py), after refusing a batch of trajectories that
    cannot fit (one batch is held at a time; onnxruntime keeps two numbers per tensor and feed)."""
    from ddpm.batch_memory import ALLOCATOR_OVERHEAD, check_batch_fits, estimate_peak_bytes
    from ddpm.util.estimates import phase_line, seconds_per_call
    from ddpm.util.memory import available_bytes

    cpu, batch = torch.device("cpu"), min(calibration.batch_size, calibration.samples)
    check_batch_fits(model.config, batch_size=batch, device=cpu, training=False)
    x = torch.zeros(model.config.sample_shape(batch))
    t = torch.ones(batch, dtype=torch.long)
    labels = (torch.zeros(batch, dtype=torch.long),) if model.config.num_classes else ()
    seconds = seconds_per_call(lambda: model(x, t, *labels), device=cpu)
    batches = -(-calibration.samples // batch)
    return phase_line(
        f"calibration: {calibration.samples:,} {calibration.sampler} trajectories of {steps} steps",
        calls=calibration.samples * steps,
        seconds=seconds * steps * batches,
        held_bytes=int(estimate_peak_bytes(model.config, batch_size=batch, training=False) * ALLOCATOR_OVERHEAD),
        available_bytes=available_bytes(cpu),
    )


def quantize_export(proto, model, schedule_config, *, calibration: Calibration, precision: str) -> tuple[object, str]:
    """The Q/DQ graph of ``proto`` (formats/quantization.py) with its calibration and measured quality in its
    metadata: the PSNR of images its onnxruntime session draws against the fp32 model's from the same noise
    (``calibration``'s sampler and steps, 16 images, a seed the calibration did not use). Returns (graph, report
    line)."""
    import json

    import onnx

    from basic_diffusion import sample
    from ddpm.benchmarks.report import psnr_db
    from ddpm.formats import quantization
    from ddpm.formats.exporters import METADATA_KEY
    from noise_schedule import NoiseSchedule

    plan = NoiseSchedule(schedule_config).make_plan(calibration.sampler, sampling_steps=calibration.sampling_steps)
    print(calibration_estimate(model, calibration, steps=plan.num_steps))
    feeds = quantization.calibration_feeds(
        model, plan, samples=calibration.samples, seed=calibration.seed, batch_size=calibration.batch_size
    )
    try:
        quantized = quantization.quantize_unet(proto, feeds, precision=precision)
    except (RuntimeError, MemoryError) as exc:  # main.py's advice names sampling flags export does not read
        if not is_out_of_memory(exc):
            raise
        raise ValueError(
            f"the machine ran out of memory calibrating on batches of {calibration.batch_size} trajectories; lower "
            "--batch_size (the calibration's batch; --calibration_samples sets how many in all)"
        ) from exc
    onnx.checker.check_model(quantized, full_check=True)
    runtime = OnnxRuntimeUNet(
        onnxruntime_session(quantized.SerializeToString(), device=torch.device("cpu")),
        io=UNetIO.from_config(model.config),
    )
    n, seed = 16, calibration.seed + 1
    guidance = None
    if model.config.num_classes:
        from ddpm.conditioning import Guidance

        guidance = Guidance(
            labels=torch.arange(n) % model.config.num_classes, null_label=model.config.null_label, scale=1.0
        )
    images = [
        sample(
            unet,
            plan,
            shape=model.config.sample_shape(n),
            generator=torch.Generator().manual_seed(seed),
            guidance=guidance,
        )
        for unet in (model, runtime)
    ]
    psnr = psnr_db(images[1], images[0])
    nodes = quantization.quantized_nodes(quantized)
    entry = next(p for p in quantized.metadata_props if p.key == METADATA_KEY)
    meta = json.loads(entry.value)
    meta.update(
        precision=precision,
        quantization={
            "quantizer": "onnxruntime.quantization.quantize_static (QDQ)",
            "weights": "per-channel symmetric",
            "activations": "per-tensor symmetric",
            "quantized_ops": list(quantization.QUANTIZED_OPS),
            "kept_fp32": list(quantization.KEPT_FP32_WEIGHTS),
            "calibration": {
                "sampler": calibration.sampler,
                "steps": plan.num_steps,
                "trajectories": calibration.samples,
                "seed": calibration.seed,
            },
            "quality": {
                "psnr_db_vs_fp32": round(psnr, 2),
                "images": n,
                "sampler": calibration.sampler,
                "steps": plan.num_steps,
                "seed": seed,
            },
        },
    )
    entry.value = json.dumps(meta, sort_keys=True)
    line = (
        f"{precision}: {len([n for n in nodes['int8'] if n])} nodes on quantized inputs, calibrated on "
        f"{calibration.samples} "
        f"{calibration.sampler} trajectories of {plan.num_steps} steps; its images vs fp32's (same noise, {n} images): "
        f"PSNR {psnr:.1f} dB"
    )
    return quantized, line


def export_artifact(
    source: str | Path,
    *,
    fmt: str,
    output: str | Path,
    weights: str,
    device: torch.device,
    precision: str = "fp32",
    opset: int | None = None,
    tensorrt_options=None,
    autoencoder: str | None = None,
    calibration: Calibration | None = None,
    overwrite: bool = False,
) -> list[str]:
    """``--mode export``: ONNX or TorchScript from a checkpoint (:func:`export_checkpoint`), or a TensorRT
    engine from a checkpoint or ONNX file (tensorrt_integration.export_engine); returns report lines."""
    if fmt != "tensorrt":
        return export_checkpoint(
            source,
            fmt=fmt,
            output=output,
            weights=weights,
            device=device,
            opset=opset,
            precision=precision,
            autoencoder=autoencoder,
            calibration=calibration,
            overwrite=overwrite,
        )
    import tensorrt_integration

    source, output = Path(source), Path(output)
    check_export_paths(source, output, "tensorrt", autoencoder=autoencoder)
    options = tensorrt_options or tensorrt_integration.TensorRTOptions(opset=opset)
    if options.backend != "native":
        raise ValueError("--format tensorrt writes native engines; torch_tensorrt compiles when sampling")
    tensorrt_integration.import_tensorrt()  # before anything is loaded: TensorRT and a GPU are needed
    tensorrt_integration.require_cuda(device)
    if artifact_kind(source) not in ("checkpoint", "onnx"):
        raise ValueError(f"engines are built from a checkpoint (.pt) or an ONNX file (.onnx), not {source}")
    artifact = load_artifact(source, device=torch.device("cpu"), weights=weights, autoencoder=autoencoder)
    outputs = {"--output": output, EXPORT_METADATA: metadata_path(output)}
    check_mode_outputs("export", outputs, inputs=artifact.inputs, fmt="tensorrt")
    decoder_output = None
    if artifact.first_stage is not None:  # a latent model: the decoder's engine goes beside the U-Net's
        decoder_output = checked_decoder_target(output, fmt="tensorrt", inputs=artifact.inputs)
    return tensorrt_integration.export_engine(
        artifact.model,
        model_config=artifact.model_config,
        schedule_config=artifact.schedule_config,
        source=source,
        output=output,
        weights=weights,
        device=device,
        precision=precision,
        options=options,
        class_names=artifact.class_names,
        first_stage=artifact.first_stage,
        decoder_output=decoder_output,
        dataset=artifact.dataset,
    )
