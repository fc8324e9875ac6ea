"""The project's structure as a newcomer relies on it: one registry of implementations, one
precision policy, and module imports that never form a circle."""

import ast
from pathlib import Path

import pytest
import torch

import cli
import implementations
from precision import resolve

ROOT = Path(__file__).resolve().parents[1]


def module_imports() -> dict[str, set[str]]:
    """Each top-level module's imports of other top-level modules (at any depth in the file)."""
    names = {p.stem for p in ROOT.glob("*.py")}
    graph = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
        graph[name] = (found & names) - {name}
    return graph


def test_module_imports_form_no_circle():
    graph, state, path = module_imports(), {}, []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                pytest.fail("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_only_the_cli_reads_an_argparse_namespace():
    """Flags are resolved once, in cli.py, into typed requests: no other module takes a Namespace."""
    readers = sorted(p.name for p in ROOT.glob("*.py") if p.name != "cli.py" and "Namespace" in p.read_text())
    assert readers == []


def test_flags_resolve_once_into_a_typed_request():
    mode, request = cli.parse(
        ["--mode", "sample", "--device", "cpu", "--dataset", "digits", "--sampler", "ddim", "--sampling_steps", "10",
         "--no_ema", "--compile", "--implementation", "cuda", "--save_npz", "out.npz"]
    )  # fmt: skip
    assert mode == "sample" and isinstance(request, cli.SampleRequest)
    assert request.device == torch.device("cpu") and request.precision == "fp32"  # auto, resolved for sampling
    assert request.source == cli.ModelSource(path="checkpoints/digits.pt", weights="model")
    assert request.implementation == "cuda_compile"  # --compile with cuda is its own registry entry
    assert request.sampling == cli.SamplingChoice(sampler="ddim", steps=10, eta=0.0, clip_denoised=True)
    assert (request.grid, request.npz) == ("samples.png", "out.npz")
    _, train = cli.parse(["--mode", "train", "--device", "cpu", "--dataset", "digits", "--channels", "1"])
    assert (train.model.image_size, train.model.channels, train.checkpoint) == (8, 1, "checkpoints/digits.pt")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--mode", "sample", "--sampler", "ddpm,ddim"], "lists are for --mode evaluate"),
        (["--mode", "sample", "--compile"], "--compile applies to"),
        (["--mode", "train", "--resume", "--overwrite"], "choose one"),
        (["--mode", "evaluate", "--chart", "quality.jpg"], "ending in .png"),
        (["--mode", "train", "--dataset", "digits", "--channels", "3"], "does not fit"),
    ],
)
def test_flag_mistakes_are_refused_while_resolving(flags, message):
    with pytest.raises(ValueError, match=message):
        cli.parse([*flags, "--device", "cpu"])


def test_the_cli_offers_exactly_the_registrys_sample_implementations():
    action = next(a for a in cli.build_parser()._actions if a.dest == "implementation")
    assert tuple(action.choices) == implementations.SAMPLE_IMPLEMENTATIONS
    assert set(implementations.SAMPLE_IMPLEMENTATIONS) == {"original", "cuda", "onnxruntime", "tensorrt"}


@pytest.mark.parametrize(
    "kind,runs",
    [
        ("checkpoint", ("original", "cuda", "onnxruntime", "tensorrt")),
        ("torchscript", ("original", "cuda")),  # cuda needs a PyTorch module
        ("onnx", ("original", "onnxruntime", "tensorrt")),  # an ONNX graph
        ("tensorrt", ("original", "tensorrt")),  # an engine runs only in TensorRT (or under the original loop)
    ],
)
def test_which_implementation_runs_which_file(kind, runs):
    assert implementations.implementations_for(kind) == runs
    for name in implementations.SAMPLE_IMPLEMENTATIONS:
        impl = implementations.get(name)
        if name in runs:
            impl.check(kind=kind)
        else:
            with pytest.raises(ValueError, match=f"use --implementation {' or '.join(runs)}"):
                impl.check(kind=kind)


def test_precision_and_device_refusals_are_one_line_and_name_the_way_out():
    with pytest.raises(ValueError, match="fp32 baseline; use --implementation cuda"):
        implementations.get("original").check(precision="bf16")
    with pytest.raises(ValueError, match="runs in fp32; drop --precision fp16"):
        implementations.get("onnxruntime").check(precision="fp16")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        implementations.get("tensorrt").check(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown implementation 'warp'"):
        implementations.get("warp")


def test_auto_precision_is_bf16_only_for_training_on_a_bf16_gpu():
    cpu = torch.device("cpu")
    assert resolve("auto", purpose="training", device=cpu) == "fp32"
    assert resolve("auto", purpose="sampling", device=cpu) == "fp32"
    assert resolve("fp16", purpose="sampling", device=cpu) == "fp16"
    with pytest.raises(ValueError, match="unknown precision"):
        resolve("fp8", purpose="training", device=cpu)


def test_every_implementation_draws_the_originals_images_through_the_registry():
    from basic_diffusion import UNetConfig
    from conftest import perturbed_unet
    from noise_schedule import NoiseSchedule, ScheduleConfig

    model = perturbed_unet(UNetConfig(image_size=8, in_channels=1, model_channels=16, channel_mult=(1, 2),
                                      num_res_blocks=1, attention_resolutions=(), num_heads=1, dropout=0.0))  # fmt: skip
    plan = NoiseSchedule(ScheduleConfig(num_timesteps=20)).make_plan("ddpm", num_steps=4, device=torch.device("cpu"))
    options = implementations.SamplerOptions()
    images = {}
    for name in ("original", "cuda", "torchscript"):
        draw = implementations.make_drawer(name, model, plan, options=options)
        images[name] = draw((2, 1, 8, 8), torch.Generator().manual_seed(3), False)
    assert torch.allclose(images["cuda"], images["original"], atol=1e-5)
    assert torch.allclose(images["torchscript"], images["original"], atol=1e-5)
