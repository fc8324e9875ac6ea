"""The project's structure as a newcomer relies on it: the design's core modules at the root, everything
else in the ddpm package by concern, imports that flow one way (no circle, few floors, nothing low
importing the modes or the command line), one registry of implementations, one precision policy, and
flags resolved once into typed requests."""

import ast
import re
import subprocess
from pathlib import Path

import pytest
import torch

from ddpm import choices
from ddpm.backends import registry
from ddpm.cli import resolve
from ddpm.cli.parser import build_parser
from ddpm.requests import ModelSource, SampleRequest, SamplingChoice
from ddpm.util.precision import resolve as resolve_precision

ROOT = Path(__file__).resolve().parents[1]
CORE = ("main", "noise_schedule", "basic_diffusion", "optimized_diffusion", "tensorrt_integration")
# The longest chain of imports, every import counted (lazy and annotation-only ones too), is 8 modules, e.g.
# main -> cli/resolve -> backends/selection -> backends/artifacts -> backends/runtimes -> batch_memory ->
# basic_diffusion -> ddpm/choices: the floors.
MAX_FLOORS = 8
# Folders below the modes and the command line: none of them imports ddpm.modes or ddpm.cli.
LOWER = (
    "ddpm.choices",
    "ddpm.requests",
    "ddpm.batch_memory",
    "ddpm.util",
    "ddpm.kernels",
    "ddpm.formats",
    "ddpm.data",
    "ddpm.latent",
    "ddpm.evaluation",
    "ddpm.training",
    "ddpm.backends",
    "ddpm.benchmarks",
    "ddpm.conditioning",
)


def module_files() -> dict[str, Path]:
    """Every module of the project by its import name: the root's (setup.py aside) and the package's."""
    files = {p.stem: p for p in ROOT.glob("*.py") if p.name != "setup.py"}
    for path in (ROOT / "ddpm").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(tree: ast.AST, *, package: list[str]) -> set[str]:
    """What a module imports, as dotted names: every import statement counts, at the top, inside a function (a
    lazy import still runs, later) or under ``if TYPE_CHECKING:`` (an annotation still names what the module
    depends on), so a module cannot hide an import that runs back up the tower."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def module_imports() -> dict[str, set[str]]:
    """Each module's imports of the project's other modules (a package's __init__ counts as nothing: they are empty)."""
    files = module_files()
    modules = {name for name, path in files.items() if path.name != "__init__.py"}
    graph = {}
    for name in modules:
        package = name.split(".")[:-1]
        deps = set()
        for imported in imports_of(ast.parse(files[name].read_text()), package=package):
            parts = imported.split(".")
            longest = next(
                (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None
            )
            if longest:
                deps.add(longest)
        graph[name] = deps - {name}
    return graph


def test_module_imports_form_no_circle():
    graph, state, path = module_imports(), {}, []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                pytest.fail("import circle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_no_import_runs_back_up_between_folders():
    """Folders (and the root's modules) form no circle either: a folder is one floor of the tower, so if a module
    of A imports B, nothing in B imports A (backends/ once imported tensorrt_integration, which imported
    backends/engine_cache.py)."""
    graph = module_imports()

    def place(name: str) -> str:  # ddpm/formats/exporters.py -> ddpm.formats; root and package-root modules: themselves
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[0] == "ddpm" else name

    places: dict[str, dict[str, str]] = {}  # place -> {place it imports: one module import that does it}
    for name, deps in graph.items():
        for dep in sorted(deps):
            if place(dep) != place(name):
                places.setdefault(place(name), {}).setdefault(place(dep), f"{name} -> {dep}")

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(places.get(here, {}))
        return False

    back = sorted(how for low, highs in places.items() for high, how in highs.items() if reaches(high, low))
    assert back == []


def test_imports_stand_at_most_max_floors_tall():
    """Floor 1 imports nothing of the project's; every other module stands one floor above the highest it imports."""
    graph, floors = module_imports(), {}

    def floor(name: str) -> int:
        if name not in floors:
            floors[name] = 1 + max((floor(dep) for dep in graph[name]), default=0)
        return floors[name]

    tallest = max(graph, key=floor)
    chain = [tallest]
    while graph[chain[-1]]:
        chain.append(max(graph[chain[-1]], key=floor))
    assert floor(tallest) <= MAX_FLOORS, " -> ".join(chain)
    assert floor("main") == max(floors.values())  # the entry point is the top floor


def test_nothing_below_the_modes_imports_the_modes_or_the_command_line():
    graph = module_imports()
    low = [name for name in graph if name.startswith(LOWER) or name in CORE[1:]]
    offenders = sorted(
        f"{name} -> {dep}" for name in low for dep in graph[name] if dep.startswith(("ddpm.modes", "ddpm.cli"))
    )
    assert offenders == []


def test_only_main_imports_the_command_line():
    """The command line sits above the modes: it builds their requests (ddpm/requests.py); they never import it."""
    graph = module_imports()
    offenders = sorted(
        f"{name} -> {dep}"
        for name in graph
        for dep in graph[name]
        if dep.startswith("ddpm.cli") and not name.startswith("ddpm.cli") and name != "main"
    )
    assert offenders == []


def test_utilities_import_only_utilities():
    """util/ is the bottom floor: it imports only itself and ddpm/choices.py, which imports nothing."""
    graph = module_imports()
    assert graph["ddpm.choices"] == set()
    offenders = sorted(
        f"{name} -> {dep}"
        for name in graph
        if name.startswith("ddpm.util")
        for dep in graph[name]
        if not dep.startswith("ddpm.util") and dep != "ddpm.choices"
    )
    assert offenders == []


def test_the_parser_imports_only_what_it_needs_to_parse():
    """The parser reads its choice lists from light modules, never from the engines (--help never loads torch:
    tests/cli/test_flags.py runs it)."""
    graph, reached, todo = module_imports(), set(), ["ddpm.cli.parser"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    light = {
        *("ddpm.cli.flags", "ddpm.cli.training_flags", "ddpm.cli.reads"),
        *("ddpm.choices", "ddpm.conditioning", "ddpm.data.catalog"),
    }
    assert reached == {"ddpm.cli.parser", *light}


def test_the_core_modules_stay_at_the_root_and_are_no_shims():
    """The design's core files are the real homes of their parts: each defines what it owns."""
    for name in CORE:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        defined = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
        assert len(defined) >= 2, f"{name}.py defines {len(defined)} functions or classes"
    assert len((ROOT / "main.py").read_text().splitlines()) <= 150  # the entry point only


# Module length, a rule a reviewer can act on: a module over MAX_MODULE_LINES is split by concern, unless it is
# one of the design's core modules, the homes whose parts belong together (noise_schedule: every sampler's
# math, the reference; optimized_diffusion and tensorrt_integration: an implementation each), which stay
# under MAX_CORE_LINES.
MAX_MODULE_LINES = 700
MAX_CORE_LINES = 1000


def test_only_the_core_modules_may_grow_past_700_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in module_files().items()}
    too_long = sorted(
        f"{name}: {lines} lines"
        for name, lines in lengths.items()
        if lines > (MAX_CORE_LINES if name in CORE else MAX_MODULE_LINES)
    )
    assert too_long == []


# setup.py and the kernels' sources: code of the tool's own outside its modules.
KERNEL_FILES = (
    "setup.py",
    "diffusion_kernels.cu",
    "diffusion_kernels.h",
    "diffusion_ops.cpp",
    "diffusion_winograd.cpp",
    "diffusion_thin_conv.cpp",
    "diffusion_cpu.h",
)


def code_files() -> list[Path]:
    """The project's code: its modules, the kernels, setup.py, the scripts and the tests."""
    return sorted(
        {
            *module_files().values(),
            *(ROOT / name for name in KERNEL_FILES),
            *ROOT.glob("scripts/*.py"),
        }
        | set((ROOT / "tests").rglob("*.py"))
    )


def library_files() -> list[Path]:
    """The tool's own code: its modules (the root's and the package's), setup.py and the kernels' sources."""
    return sorted({*module_files().values(), *(ROOT / name for name in KERNEL_FILES)})


def test_scripts_and_tests_carry_no_bare_date():
    """Scripts and tests say why, not when (measured figures live in BENCHMARKS.md with their dates); a script that
    made a measurement may name the results folder it wrote, date and all."""
    dated = sorted(
        f"{path.relative_to(ROOT)}:{number}"
        for path in set(code_files()) - set(library_files())
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(?<![-\w])20\d\d-\d\d-\d\d(?![-\w])", line)
    )
    assert dated == []


# What a measurement looks like in a line of code, a comment, a docstring or a message: a date (a bare one or inside
# a name), where raw results lie, a time, a rate, a measured ratio (decimal, approximate, a range, a speed-up) or one
# figure against another. A Winograd operation count ("2.25x fewer multiply-adds") is arithmetic, not a measurement.
MEASUREMENT = re.compile(
    r"20\d\d-\d\d-\d\d"
    r"|\bresults/"
    r"|\d ?(ns|µs|us|ms)\b|\d ?(s|min|h|seconds?|minutes?|hours?) (a|an|per|each)\b"
    r"|\d ?([kMGTP]i?)?(img|images|steps|it|samples|FLOP|B)/s\b"
    r"|\d\.\d+ ?[x×](?!\d)(?! ?fewer multiply-adds)"
    r"|~ ?\d+(\.\d+)? ?[x×]|\d+-\d+ ?[x×]|\d ?([x×]|times) (faster|slower|quicker|more|less)"
    r"|\d(\.\d+)?%? against \d"
)
# Names other projects chose, which the code must spell as they are: torch-fidelity's Inception weights file.
THIRD_PARTY_NAMES = ("weights-inception-2015-12-05-6726825d.pth",)


def measurements_in(text: str) -> list[tuple[int, str]]:
    """The lines of ``text`` that carry a measurement (third-party names aside): (line number, line)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        bare = line
        for name in THIRD_PARTY_NAMES:
            bare = bare.replace(name, "")
        if MEASUREMENT.search(bare):
            found.append((number, line.strip()))
    return found


def test_library_code_carries_no_measurement():
    """The tool's own code (its modules, setup.py, the kernels' sources) says why in words and may name the
    BENCHMARKS.md section by its heading; the numbers, with their machine and date, and the raw results' folders
    live there (scripts that made a measurement may name it)."""
    measured = sorted(
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in library_files()
        for number, line in measurements_in(path.read_text())
    )
    assert measured == []


@pytest.mark.parametrize(
    "line",
    [
        "# cuDNN adds the bias in 0.32 ms a forward",
        "# a step costs 3.2 against 13.7 ms",
        '# 1.58x faster than fp32 (BENCHMARKS.md, "bf16")',
        '    """Faster here: 1.31× the fp32 rate."""',
        "// 14-38x faster than torch's dropout",
        "# the noise floor is ~30x the ceiling",
        "# the preset costs 6x more per image",
        "# 74% against 75% of samples read confidently",
        "# 2,602 img/s at batch 128",
        "# 245 TFLOP/s on an H200",
        "# training took 4 min a run",
        "# measured on " + "-".join(("2026", "11", "25")),
        "# see results/cpu-2026-11-25-winograd/HISTORY.md",
        "# the rows of cpu-2026-11-25-winograd",
        'f"a faster path is described in results/HISTORY.md"',
    ],
)
def test_the_measurement_rule_catches_what_a_lab_notebook_writes(line):
    assert measurements_in(line)


@pytest.mark.parametrize(
    "line",
    [
        "# Winograd's F(2x2, 3x3): 2.25x fewer multiply-adds than a direct convolution",
        "# nearest 2x upsampling of a 28x28 image, 3x3 kernels",
        '# (BENCHMARKS.md, "Real digits at 28×28")',
        'WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"',
        "# linear warm-up over 5% of the run, at most 500 steps",
        "    \"\"\"'45 s', '3 min 20 s', '1 h 05 min'.\"\"\"",
    ],
)
def test_the_measurement_rule_lets_arithmetic_and_names_through(line):
    assert measurements_in(line) == []


def test_comments_cite_sections_benchmarks_md_has():
    """A comment that cites a figure's section (BENCHMARKS.md or results/HISTORY.md, then the quoted title) names
    part of a heading there, and a file or folder under results/ that a comment names exists."""
    headings = {
        document: [
            line.lstrip("#").strip() for line in (ROOT / document).read_text().splitlines() if line.startswith("#")
        ]
        for document in ("BENCHMARKS.md", "results/HISTORY.md")
    }
    cited = {
        (path.relative_to(ROOT).as_posix(), document, " ".join(title.split()))
        for path in code_files()
        for document, title in re.findall(
            r'(BENCHMARKS\.md|results/HISTORY\.md),\s*(?:#|//)?\s*"([^"]+)"', path.read_text()
        )
    }
    assert "BENCHMARKS.md" in {document for _, document, _ in cited}  # the pattern still finds the citations
    assert (
        sorted(
            f"{path}: {document}, {title}"
            for path, document, title in cited
            if not any(title in heading for heading in headings[document])
        )
        == []
    )
    named = {
        (path.relative_to(ROOT).as_posix(), name)
        for path in code_files()
        for name in re.findall(r"(?<![\w./-])results/[\w./-]*\w(?![\w\\])", path.read_text())
    }
    assert named  # the pattern still finds them
    assert sorted(f"{path}: {name}" for path, name in named if not (ROOT / name).exists()) == []


def test_only_the_cli_reads_an_argparse_namespace():
    """Flags are resolved once, in ddpm/cli/, into typed requests: no other module takes a Namespace."""
    readers = sorted(
        name
        for name, path in module_files().items()
        if not name.startswith("ddpm.cli") and "Namespace" in path.read_text()
    )
    assert readers == []


def test_flags_resolve_once_into_a_typed_request():
    mode, request = resolve.parse(
        [
            "--mode",
            "sample",
            "--device",
            "cpu",
            "--dataset",
            "digits",
            "--sampler",
            "ddim",
            "--sampling_steps",
            "10",
            "--no_ema",
            "--compile",
            "--implementation",
            "cuda",
            "--save_npz",
            "out.npz",
        ]
    )
    assert mode == "sample" and isinstance(request, SampleRequest)
    assert request.device == torch.device("cpu") and request.precision == "fp32"  # auto, resolved for sampling
    assert request.source == ModelSource(path="checkpoints/digits.pt", weights="model")
    assert request.implementation == "cuda" and request.compile  # --compile: cuda's U-Net compiled in the graph
    assert request.sampling == SamplingChoice(sampler="ddim", sampling_steps=10, eta=0.0, clip_denoised=True)
    assert (request.grid, request.npz) == ("samples.png", "out.npz")
    _, train = resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", "digits", "--channels", "1"])
    assert (train.model.image_size, train.model.channels, train.checkpoint) == (8, 1, "checkpoints/digits.pt")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--mode", "sample", "--sampler", "ddpm,ddim"], "lists are for --mode evaluate"),
        (["--mode", "sample", "--compile"], "--compile applies to"),
        (["--mode", "train", "--resume", "--overwrite"], "choose one"),
        (["--mode", "evaluate", "--chart", "quality.jpg"], "ending in .png"),
        (["--mode", "train", "--dataset", "digits", "--channels", "3"], "does not fit"),
        (["--mode", "train", "--img_size", "0"], "--img_size must be a positive integer"),  # 0 is not "the default"
        (["--mode", "sample", "--max_batch", "0"], "--max_batch must be a positive integer"),  # before any file is read
        (["--mode", "sample", "--grid_scale", "0"], "--grid_scale must be a positive integer, got 0"),
        (["--mode", "sample", "--sampler", "ddim", "--eta", "1e10"], "--eta must be between 0"),  # saturated images
        (["--mode", "sample", "--model_path", "m.onnx", "--implementation", "cuda"], "cannot run ONNX files"),
        (["--mode", "benchmark", "--model_path", "m.onnx"], "measures a checkpoint"),
    ],
)
def test_flag_mistakes_are_refused_while_resolving(flags, message):
    with pytest.raises(ValueError, match=message):
        resolve.parse([*flags, "--device", "cpu"])


def test_the_parser_refuses_an_optimization_level_outside_0_to_5(capsys):
    with pytest.raises(SystemExit) as exit_:
        resolve.parse(["--mode", "sample", "--trt_opt_level", "9"])
    assert exit_.value.code == 2 and "--trt_opt_level: invalid choice: 9" in capsys.readouterr().err


def test_the_cli_offers_exactly_the_registrys_sample_implementations():
    action = next(a for a in build_parser("sample")._actions if a.dest == "implementation")
    assert choices.SAMPLE_IMPLEMENTATIONS == registry.SAMPLE_IMPLEMENTATIONS
    assert set(registry.SAMPLE_IMPLEMENTATIONS) <= set(action.choices)
    assert set(registry.SAMPLE_IMPLEMENTATIONS) == {"original", "cuda", "cuda_steps", "onnxruntime", "tensorrt"}
    assert action.default == "auto" and "auto" in action.choices  # backends/selection.py


def test_the_choice_lists_agree_with_the_modules_that_keep_their_own():
    import noise_schedule

    assert (choices.SAMPLERS, choices.SCHEDULES) == (noise_schedule.SAMPLERS, noise_schedule.SCHEDULES)


@pytest.mark.parametrize(
    "kind,runs",
    [
        ("checkpoint", ("original", "cuda", "cuda_steps", "onnxruntime", "tensorrt")),
        ("torchscript", ("original", "cuda", "cuda_steps")),  # cuda needs a PyTorch module
        ("onnx", ("original", "onnxruntime", "tensorrt")),  # an ONNX graph
        ("tensorrt", ("original", "tensorrt")),  # an engine runs only in TensorRT (or under the original loop)
    ],
)
def test_which_implementation_runs_which_file(kind, runs):
    assert registry.implementations_for(kind) == runs
    for name in registry.SAMPLE_IMPLEMENTATIONS:
        impl = registry.get(name)
        if name in runs:
            impl.check(kind=kind)
        else:
            with pytest.raises(ValueError, match=f"use --implementation {' or '.join(runs)}"):
                impl.check(kind=kind)


def test_precision_and_device_refusals_are_one_line_and_name_the_way_out():
    with pytest.raises(ValueError, match="fp32 baseline; use --implementation cuda"):
        registry.get("original").check(precision="bf16")
    with pytest.raises(ValueError, match="runs in fp32 or int8; drop --precision fp16"):
        registry.get("onnxruntime").check(precision="fp16")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        registry.get("tensorrt").check(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown implementation 'warp'"):
        registry.get("warp")


def test_auto_precision_is_bf16_for_training_and_sampling_on_a_bf16_gpu_and_fp32_elsewhere(monkeypatch):
    """... and bf16 for sampling on a CPU that computes it (tests/backends/test_auto.py: only through the runner)."""
    from ddpm.util import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    cpu = torch.device("cpu")
    gpu = torch.device("cuda")  # a device name only: nothing is allocated on it
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert resolve_precision("auto", purpose="training", device=gpu) == "bf16"
    assert resolve_precision("auto", purpose="sampling", device=gpu) == "bf16"
    assert resolve_precision("auto", purpose="export", device=gpu) == "fp32"  # a graph is lowered only when asked
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert resolve_precision("auto", purpose="sampling", device=gpu) == "fp32"
    assert resolve_precision("auto", purpose="training", device=cpu) == "fp32"
    assert resolve_precision("auto", purpose="sampling", device=cpu) == "fp32"
    assert resolve_precision("fp16", purpose="sampling", device=cpu) == "fp16"
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_precision("fp9", purpose="training", device=cpu)
    with pytest.raises(
        ValueError, match="training runs in fp32, bf16 or fp16"
    ):  # quantized graphs are exported, not trained
        resolve_precision("int8", purpose="training", device=cpu)
    assert resolve_precision("int8", purpose="export", device=cpu) == "int8"


def test_every_implementation_draws_the_originals_images_through_the_registry():
    from helpers import perturbed_unet

    from basic_diffusion import UNetConfig
    from noise_schedule import NoiseSchedule, ScheduleConfig

    model = perturbed_unet(
        UNetConfig(
            image_size=8,
            in_channels=1,
            model_channels=16,
            channel_mult=(1, 2),
            num_res_blocks=1,
            attention_resolutions=(),
            num_heads=1,
            dropout=0.0,
        )
    )
    plan = NoiseSchedule(ScheduleConfig(num_timesteps=20)).make_plan(
        "ddpm", sampling_steps=4, device=torch.device("cpu")
    )
    options = registry.SamplerOptions()
    images = {}
    for name, implementation in (
        ("original", "original"),
        ("cuda", "cuda"),
        ("torchscript", registry.PEERS["torchscript"]),
    ):
        draw = registry.make_drawer(implementation, model, plan, options=options)
        images[name] = draw((2, 1, 8, 8), torch.Generator().manual_seed(3), False)
    assert torch.allclose(images["cuda"], images["original"], atol=1e-5)
    assert torch.allclose(images["torchscript"], images["original"], atol=1e-5)


def test_the_tests_mirror_the_layout():
    """A test file per core module at the top of tests/, a test folder per package folder: a reader finds
    a module's tests by its path (test folders name package folders; top-level test files name modules)."""
    tests = ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders <= {p.name for p in (ROOT / "ddpm").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = set(module_files()) | {
        "diffusion_kernels",
        "structure",
    }  # the kernels are C++; this file tests the layout
    top = {p.stem.removeprefix("test_") for p in tests.glob("test_*.py")}
    assert sorted(name for name in top if name not in modules and f"ddpm.{name}" not in modules) == []
    assert {f"test_{name}.py" for name in CORE[1:]} <= {p.name for p in tests.glob("test_*.py")}


@pytest.mark.parametrize(
    ("implementation", "path", "expected"),
    [
        ("auto", "model.pt", "bf16"),  # the fused runner's precision on a GPU
        ("cuda", "model.pt", "bf16"),
        ("original", "model.pt", "fp32"),  # the fp32 baseline: auto never asks it for bf16
        ("onnxruntime", "model.pt", "fp32"),
        ("auto", "model.onnx", "fp32"),  # a graph runs in the precision it was exported in
    ],
)
def test_drawing_on_a_gpu_defaults_to_bf16_where_the_implementation_runs_it(
    monkeypatch, implementation, path, expected
):
    from types import SimpleNamespace

    from helpers import tiny_unet_config

    from basic_diffusion import UNet
    from ddpm.backends.selection import check_request, select
    from optimized_diffusion import DeviceKind

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    gpu = DeviceKind("cuda", extension=True)
    kind = "onnx" if path.endswith(".onnx") else "checkpoint"
    config = tiny_unet_config()
    opened = SimpleNamespace(kind=kind, model=UNet(config), model_config=config, first_stage=None)
    auto = resolve_precision("auto", purpose="sampling", device=torch.device("cuda"))
    request = SimpleNamespace(implementation=implementation, precision=auto, precision_auto=True, compile=False)
    assert select(gpu, opened, request).precision == expected
    fp16 = dict(implementation=implementation, precision="fp16", precision_auto=False, compile=False)
    if implementation in ("auto", "cuda"):  # a precision named is drawn as named where the implementation runs it
        assert select(gpu, opened, SimpleNamespace(**fp16)).precision == "fp16"
    else:  # and refused before the file is read where it does not
        with pytest.raises(ValueError, match="drop --precision fp16|fp32 baseline"):
            check_request(kind=kind, **fp16)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def root_outputs() -> set[str]:
    """The files that the README's, the docs' and the Makefile's commands write at the root: every bare file name
    given to an output flag, and sample's default grid."""
    texts = [(ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()]
    texts += [path.read_text() for path in (ROOT / "docs").glob("*.md")]
    named = {
        name
        for text in texts
        for name in re.findall(r"--(?:output|json|chart|save_npz) ([\w.-]+\.\w+)\b", text)
        if "/" not in name
    }
    return named | {"samples.png"}


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_git_ignores_what_the_documented_commands_write_at_the_root():
    outputs = root_outputs()
    assert {"digits_samples.png", "grid.png", "eval.json", "bench.json", "samples.png"} <= outputs
    ignored = set(git("check-ignore", "--no-index", *sorted(outputs)).split())
    assert sorted(outputs - ignored) == []


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_no_build_artifact_is_tracked():
    """Wheels, compiled extensions and build folders are made by `make install`, never committed (ruff comes from
    requirements-lock.txt like every other package)."""
    tracked = git("ls-files").splitlines()
    artifacts = [p for p in tracked if re.search(r"\.(whl|so|pyd|egg-info)$|^(build|dist)/", p)]
    assert artifacts == []
    assert re.search(r"^ruff==", (ROOT / "requirements-lock.txt").read_text(), re.M)


def test_sampling_steps_keep_one_name_from_the_flag_to_make_plan():
    """A reader follows --sampling_steps by its name: the requests' fields, own_sampling and make_plan all call
    it sampling_steps, and the count is range-checked in one place, where it meets the model's timesteps."""
    import dataclasses
    import inspect

    from ddpm.requests import Calibration, EvaluateRequest, own_sampling
    from noise_schedule import NoiseSchedule

    for request in (SamplingChoice, EvaluateRequest, Calibration):
        names = {field.name for field in dataclasses.fields(request)}
        assert "sampling_steps" in names and not names & {"steps", "num_steps"}, request.__name__
    for function in (own_sampling, NoiseSchedule.make_plan):
        assert "sampling_steps" in inspect.signature(function).parameters, function.__name__
    checks = sorted(
        f"{name}: {message}"
        for name, path in module_files().items()
        for message in re.findall(
            r"(--sampling_steps must be a positive|sampling steps must be between)", path.read_text()
        )
    )
    assert checks == ["noise_schedule: sampling steps must be between"]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_links_resolve():
    """Every relative link in the README, BENCHMARKS.md, docs/ and results/ reaches a file or folder that exists,
    and a #anchor into a Markdown file reaches one of its headings (BENCHMARKS.md's sections move; the links
    into them must follow)."""
    pages = [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "results").rglob("*.md"),
    ]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            linked = (page.parent / name) if name else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md":
                lines = linked.read_text().splitlines()
                if anchor not in {github_anchor(line.lstrip("#")) for line in lines if line.startswith("#")}:
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


# Flags of other programs the docs and docstrings show (torchrun, SLURM, TensorBoard, pip, nvidia-smi, setup.py, nvcc,
# ruff) and the placeholder --name.
OTHER_PROGRAMS_FLAGS = {
    *("nproc_per_node", "nnodes", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "nodes", "ntasks", "cpus", "gpus"),
    *("logdir", "no", "local", "query", "inplace", "use_fast_math", "threads", "check", "name"),
}


def test_the_docs_and_docstrings_name_only_flags_the_tool_has():
    """A flag a reader copies from the README, docs/ or a module's docstring exists (quality.py once showed
    --plot for --chart)."""
    from ddpm.cli.flags import FLAGS

    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *module_files().values()]
    unknown = sorted(
        f"{path.relative_to(ROOT)}: --{name}"
        for path in files
        for name in set(re.findall(r"(?<![\w-])--([a-z][a-z0-9_]*)", path.read_text()))
        if name not in FLAGS and name != "help" and name not in OTHER_PROGRAMS_FLAGS
    )
    assert unknown == []
