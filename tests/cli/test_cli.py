"""The command line end to end: train -> sample -> PNG (sampling in a subprocess: the real entry point), and
one-line errors for bad input (in this process, through ``main.main``: the same code, without the
seconds each new Python process spends importing torch). One sampler draws through the real entry
point; the training, the other samplers and the resumed run run in this process (training through the
real entry point: tests/util/test_safe_files.py's signal tests and tests/training/test_distributed.py)."""

from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, TINY_TRAIN, assert_user_error, run, run_here  # noqa: F401  (ROOT: cwd of runs)
from PIL import Image


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("cli")
    # 10 timesteps (the last --timesteps wins): the end-of-run previews (64 images, a step per timestep up to 100) of
    # this run and of the resumed one take a second, not five.
    result = run_here(*TINY_TRAIN, "--timesteps", "10", "--model_path", "ck/digits.pt", cwd=work)
    assert result.returncode == 0, result.stderr
    assert (work / "ck" / "digits.pt").is_file()
    assert (work / "ck" / "digits_samples" / "step_0000003.png").is_file()
    return work


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "dpm_solver"])
def test_train_then_sample_writes_a_grid_of_the_right_size(trained, sampler):
    out = f"grid_{sampler}.png"
    launch = run if sampler == "ddpm" else run_here  # one through the real entry point is enough
    result = launch(
        "--mode",
        "sample",
        "--model_path",
        "ck/digits.pt",
        "--n_samples",
        "9",
        "--sampler",
        sampler,
        "--sampling_steps",
        "5",
        "--output",
        out,
        "--save_npz",
        f"{sampler}.npz",
        cwd=trained,
    )
    assert result.returncode == 0, result.stderr
    with Image.open(trained / out) as img:
        # torchvision's grid: 3 x 3 tiles of 16 px with 2 px padding, enlarged x4 (tiles of 64 px).
        assert img.size == (4 * (3 * 18 + 2), 4 * (3 * 18 + 2))
    images = np.load(trained / f"{sampler}.npz")["images"]
    assert images.shape == (9, 16, 16, 1) and images.dtype == np.uint8


def test_sampling_is_reproducible_from_the_seed(trained):
    def draw(seed: str, name: str):
        args = ("--mode", "sample", "--model_path", "ck/digits.pt", "--n_samples", "4", "--sampling_steps", "5")
        result = run_here(*args, "--seed", seed, "--output", f"{name}.png", "--save_npz", f"{name}.npz", cwd=trained)
        assert result.returncode == 0, result.stderr
        return np.load(trained / f"{name}.npz")["images"]

    assert np.array_equal(draw("1", "a"), draw("1", "b"))
    assert not np.array_equal(draw("1", "a"), draw("2", "c"))


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "dpm_solver"])
def test_cuda_implementation_draws_the_original_images(trained, sampler):
    # On a CPU "cuda_steps" runs the fused step kernels around the eager U-Net: same seed, the same images bit for
    # bit; "cuda" adds the fused U-Net runner (Winograd convolutions): the same images to float rounding.
    arrays = {}
    for implementation in ("original", "cuda_steps", "cuda"):
        result = run_here(
            "--mode",
            "sample",
            "--model_path",
            "ck/digits.pt",
            "--n_samples",
            "4",
            "--sampler",
            sampler,
            "--sampling_steps",
            "8",
            "--implementation",
            implementation,
            "--output",
            f"{implementation}.png",
            "--save_npz",
            f"{implementation}.npz",
            cwd=trained,
        )
        assert result.returncode == 0, result.stderr
        arrays[implementation] = np.load(trained / f"{implementation}.npz")["images"]
    assert np.array_equal(arrays["original"], arrays["cuda_steps"])
    assert np.abs(arrays["cuda"].astype(int) - arrays["original"]).max() <= 1  # uint8 levels


def test_resume_continues_to_a_longer_run(trained):
    result = run_here("--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--max_steps", "5", cwd=trained)
    assert result.returncode == 0, result.stderr
    assert "resuming ck/digits.pt at step 3 of 5" in result.stdout


@pytest.mark.parametrize(
    "args,match",
    [
        (["--mode", "sample", "--model_path", "missing.pt"], "does not exist"),
        (["--mode", "sample", "--model_path", "corrupt.pt"], "corrupt"),
        (["--mode", "sample", "--model_path", "ck/digits.pt", "--n_samples", "0"], "--n_samples must be a positive"),
        (["--mode", "sample", "--model_path", "ck/digits.pt", "--sampling_steps", "11"], "between 1 and 10"),
        (["--mode", "sample", "--model_path", "ck/digits.pt", "--sampling_steps", "0"], "must be positive"),
        (["--mode", "sample", "--model_path", "ck/digits.pt", "--sampler", "ddpm", "--eta", "1"], "eta only applies"),
        (["--mode", "sample", "--model_path", "ck/digits.pt", "--save_npz", "x.txt"], ".npz"),
        (["--mode", "sample", "--model_path", "ck/digits.pt", "--output", "ck"], "is a folder"),
        (["--mode", "sample", "--model_path", "ck/digits.pt", "--implementation", "tensorrt"], "tensorrt"),
        (["--mode", "train", "--dataset", "digits", "--img_size", "30"], "cannot be downsampled"),
        (["--mode", "train", "--dataset", "digits", "--max_steps", "0"], "--max_steps must be a positive"),
        (["--mode", "train", "--dataset", "digits", "--batch_size", "-4"], "--batch_size must be a positive"),
        (["--mode", "train", "--dataset", "digits", "--channels", "3"], "channel"),
        (["--mode", "train", "--dataset", "folder", "--data_dir", "empty"], "holds no images"),
        (["--mode", "train", "--resume", "--model_path", "missing.pt"], "does not exist"),
        (["--mode", "train", "--dataset", "digits", "--model_path", "run.pth"], "must name a .pt checkpoint"),
        (["--mode", "train", "--dataset", "digits", "--model_path", "ck"], "must name a .pt checkpoint"),
        (["--mode", "train", "--dataset", "digits", "--model_channels", "25"], "num_heads"),
        (["--mode", "benchmark", "--rows", "original,warp"], "unknown benchmark rows"),
        (["--mode", "train", "--dataset", "digits", "--profile", "corrupt.pt"], "is a file"),
        (
            ["--mode", "evaluate", "--model_path", "ck/digits.pt", "--profile", "prof"],
            "--profile is read by --mode train, sample, benchmark and distill, not evaluate",
        ),
        (["--mode", "train", "--dataset", "digits", "--timestep_sampling", "best"], "invalid choice"),
        (
            ["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--timestep_sampling", "topk"],
            "trains with --timestep_sampling uniform, and a resumed run keeps it",
        ),
        (["--mode", "train", "--dataset", "digits", "--profile", "/proc/prof"], "cannot write into /proc"),
        # --resume keeps what the run learns with; a flag that contradicts the checkpoint names both values.
        (
            ["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--model_channels", "32"],
            "--model_channels 32 (the checkpoint's 16)",
        ),
        (
            ["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--img_size", "8"],
            "--img_size 8 (the checkpoint's 16)",
        ),
        (["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--lr", "0.5"], "--lr 0.5 (the checkpoint's"),
        (
            ["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--dataset", "mnist"],
            "--dataset mnist (the checkpoint's digits)",
        ),
        (
            ["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--model_preset", "small"],
            "--model_preset makes a new model",
        ),
        (["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--n_epochs", "2"], "--n_epochs"),
        (["--mode", "evaluate", "--model_path", "ck/digits.pt", "--n_samples", "1"], "--n_samples 2 or more"),
        # A flag the mode does not read is refused, naming the modes that read it (cli/flags.READ_BY).
        (
            ["--mode", "sample", "--model_path", "ck/digits.pt", "--timesteps", "10"],
            "--timesteps describes a new model",
        ),
        (
            ["--mode", "evaluate", "--model_path", "ck/digits.pt", "--img_size", "12"],
            "--img_size describes a new model",
        ),
        (["--mode", "export", "--model_path", "ck/digits.pt", "--class_cond"], "--class_cond describes a new model"),
        (
            ["--mode", "evaluate", "--model_path", "ck/digits.pt", "--output", "e.png"],
            "--output is read by --mode sample, export and distill, not evaluate",
        ),
        (
            [
                "--mode",
                "evaluate",
                "--model_path",
                "ck/digits.pt",
                "--sampler",
                "ddim",
                "--sampling_steps",
                "2,500",
                "--n_samples",
                "4",
            ],
            "sampling steps must be between 1 and 10",
        ),  # before the first row is drawn
        (
            ["--mode", "train", "--dataset", "digits", "--model_path", "x.pt", "--class_label", "3"],
            "--class_label is read by --mode sample and evaluate, not train",
        ),
        (
            ["--mode", "train", "--dataset", "digits", "--model_path", "x.pt", "--kl_weight", "0.1"],
            "--kl_weight is read by --mode train_autoencoder, not train",
        ),
        (
            ["--mode", "train", "--dataset", "digits", "--model_path", "x.pt", "--cond_drop", "0.2"],
            "add --class_cond or drop it",
        ),
        (
            ["--mode", "train", "--resume", "--model_path", "ck/digits.pt", "--max_steps", "2"],
            "of 2; to train on, pass --max_steps above",
        ),
        (
            ["--mode", "train", "--dataset", "digits", "--model_path", "x.pt", "--max_steps", str(10**10)],
            "at most 1,000,000,000",
        ),
        (["--mode", "benchmark", "--repeats", "5000"], "--repeats must be at most 1,000"),
    ],
)
def test_user_errors_end_in_one_line_and_exit_code_2(trained, args, match):
    (trained / "corrupt.pt").write_bytes(b"PK\x03\x04 truncated zip")
    (trained / "empty").mkdir(exist_ok=True)
    assert_user_error(run_here(*args, cwd=trained), match)


def test_a_user_error_from_the_real_entry_point_is_one_line(trained):
    (trained / "corrupt.pt").write_bytes(b"PK\x03\x04 truncated zip")
    assert_user_error(run("--mode", "sample", "--model_path", "corrupt.pt", cwd=trained), "corrupt")


def test_help_lists_the_modes_and_each_modes_help_its_flags(tmp_path):
    overview = run_here("--help", cwd=tmp_path)
    assert overview.returncode == 0
    assert all(word in overview.stdout for word in ("train", "sample", "evaluate", "--mode", "--precision"))
    for mode, flags in (
        ("train", ("--dataset", "--n_epochs", "--img_size", "--channels", "--batch_size", "--resume")),
        ("sample", ("--implementation", "--n_samples", "--model_path", "--sampler", "--precision")),
    ):
        result = run_here("--mode", mode, "--help", cwd=tmp_path)
        assert result.returncode == 0 and all(flag in result.stdout for flag in flags)


def test_profile_writes_a_trace_where_tensorboard_looks(trained):
    """--profile DIR: DIR/<run>/plugins/profile/<timestamp>/*.pt.trace.json, with the profiled steps and phases."""
    import json

    train = [*TINY_TRAIN, "--timesteps", "10"]  # the last --timesteps wins: a cheap end-of-run preview
    result = run_here(*train, "--model_path", "prof.pt", "--max_steps", "5", "--profile", "prof", cwd=trained)
    assert result.returncode == 0, result.stderr
    traces = list((trained / "prof" / "train" / "plugins" / "profile").glob("*/*.pt.trace.json"))
    assert len(traces) == 1
    names = {event.get("name") for event in json.loads(traces[0].read_text())["traceEvents"]}
    assert {
        "ProfilerStep#2",
        "ProfilerStep#3",
        "ProfilerStep#4",
    } <= names and "ProfilerStep#1" not in names  # wait, warm-up
    assert {"data", "forward", "backward", "optimizer"} <= names  # the phases of a training step
    summary = (traces[0].parent / "summary.txt").read_text()
    assert "aten::convolution" in summary or "diffusion_kernels::conv3x3" in summary  # whichever kernels run them
    sampled = run_here(
        "--mode",
        "sample",
        "--model_path",
        "prof.pt",
        "--n_samples",
        "2",
        "--sampler",
        "ddim",
        "--sampling_steps",
        "3",
        "--profile",
        "prof",
        "--output",
        "p.png",
        "--implementation",
        "original",  # the profile's folder is named after the implementation
        cwd=trained,
    )
    assert sampled.returncode == 0, sampled.stderr
    trace = next((trained / "prof" / "sample-original" / "plugins" / "profile").glob("*/*.pt.trace.json"))
    events = [event.get("name") for event in json.loads(trace.read_text())["traceEvents"]]
    assert events.count("unet") == 3 and events.count("step") == 3  # one per sampling step


def test_the_largest_seed_works_in_training_sampling_and_evaluation(tmp_path):
    """--seed takes 0 .. 2^63 - 1; every generator derived from it stays in torch's and scikit-learn's range."""
    seed = str(2**63 - 1)
    steps = [
        [*TINY_TRAIN, "--timesteps", "10", "--model_path", "m.pt", "--seed", seed],  # 10: a cheap end-of-run preview
        [
            "--mode",
            "sample",
            "--model_path",
            "m.pt",
            "--n_samples",
            "4",
            "--batch_size",
            "2",
            "--sampling_steps",
            "2",
            "--sampler",
            "dpm_solver_sde",
            "--seed",
            seed,
        ],
        [
            "--mode",
            "evaluate",
            "--model_path",
            "m.pt",
            "--n_samples",
            "4",
            "--sampling_steps",
            "2",
            "--sampler",
            "ddim",
            "--seed",
            seed,
        ],
    ]
    for args in steps:
        result = run_here(*args, "--device", "cpu", cwd=tmp_path)
        assert result.returncode == 0, result.stderr


def test_a_librarys_warning_is_one_line_once_and_python_shows_warnings_as_before_after(tmp_path, monkeypatch):
    import warnings

    from ddpm.modes import sample

    def warns(request) -> None:  # a library warning twice, with a second line, as onnx or torch might
        for _ in range(2):
            warnings.warn("TracerWarning: a library says\n  something on a second line", UserWarning)

    monkeypatch.setattr(sample, "run_sample", warns)
    result = run_here("--mode", "sample", "--model_path", "m.pt", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "main.py: warning: TracerWarning: a library says\n"
    with pytest.warns(UserWarning, match="after the run"):  # the handler was the run's only
        warnings.warn("after the run", UserWarning)


@pytest.mark.parametrize("wrapper", [AttributeError, ValueError, RuntimeError])
def test_a_library_error_raised_because_of_ctrl_c_ends_as_the_interrupt(tmp_path, monkeypatch, wrapper):
    """Ctrl-C inside torch.export's lazy imports surfaced as AttributeError / TorchExportError tracebacks with
    exit 1 (ValueError when our exporter wraps it): the interrupt in the chain decides, 130 and one line."""
    import signal

    from ddpm.modes import sample
    from ddpm.util import messages

    def interrupted_inside_a_library(request) -> None:
        try:
            raise messages.Interrupted(signal.SIGINT)
        except KeyboardInterrupt as exc:
            raise wrapper("module 'torch._dynamo' has no attribute 'exc'") from exc

    monkeypatch.setattr(sample, "run_sample", interrupted_inside_a_library)
    result = run_here("--mode", "sample", "--model_path", "m.pt", cwd=tmp_path)
    assert result.returncode == 130 and result.stderr.strip() == "main.py: Ctrl-C: stopped"


def test_a_repeated_row_is_refused_before_any_work(tmp_path):
    result = run_here("--mode", "benchmark", "--rows", "original,cuda, original", "--interleave", cwd=tmp_path)
    assert_user_error(result, "--rows names original twice")
    assert list(tmp_path.iterdir()) == []
