"""Class-conditional models and classifier-free guidance.

Specification: guidance scale 1 is the conditional model (one pass), scale 0 its unconditional eps
(the null label); the cuda implementation's guided sampler (the combine inside the fused step)
draws the original's images bit for bit on the CPU and, on a GPU, inside the CUDA graph; training
replaces labels by the null label at --cond_drop's rate; labels come from each dataset; a model
trained briefly on the digits draws the requested digit far more often than chance; user mistakes
end in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_user_error, perturbed_unet, run, run_here
from PIL import Image

import optimized_diffusion as od
from basic_diffusion import UNetConfig, sample
from ddpm.conditioning import Guidance, class_labels, grid_columns, labels_for
from ddpm.data.datasets import ImageSet, load_images
from ddpm.kernels import ops
from ddpm.kernels.build import BUILD_COMMAND
from ddpm.util.precision import backend_policy
from noise_schedule import NoiseSchedule, ScheduleConfig

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SCHEDULE = NoiseSchedule(ScheduleConfig(num_timesteps=100))
CONFIG = UNetConfig(
    image_size=8,
    in_channels=1,
    model_channels=16,
    channel_mult=(1, 2),
    num_res_blocks=1,
    attention_resolutions=(),
    num_heads=2,
    dropout=0.0,
    norm_groups=8,
    num_classes=10,
)  # norm groups of 2 and 4 channels: the label reaches the output
SHAPE = (4, 1, 8, 8)
LABELS = torch.tensor([3, 7, 0, 9])
SAMPLERS = {"ddpm": dict(sampler="ddpm"), "ddim": dict(sampler="ddim"), "dpm_solver": dict(sampler="dpm_solver")}


@pytest.fixture(scope="module")
def model():
    return perturbed_unet(CONFIG)


def draw(model, case: str, guidance: Guidance | None, *, device: str = "cpu", fused: bool = False) -> torch.Tensor:
    plan = SCHEDULE.to(device).make_plan(**SAMPLERS[case], sampling_steps=6, device=device)
    g = torch.Generator(device).manual_seed(5)
    if fused:
        return od.sample(model, plan, shape=SHAPE, generator=g, guidance=guidance)
    return sample(model, plan, shape=SHAPE, generator=g, guidance=guidance)


def test_guidance_scale_1_is_the_conditional_model_and_0_its_unconditional_eps(model):
    null = CONFIG.null_label
    conditional = draw(model, "ddim", Guidance(LABELS, null_label=null, scale=1.0))
    unconditional = draw(model, "ddim", Guidance(torch.full_like(LABELS, null), null_label=null, scale=1.0))
    # Scale 0 runs the doubled batch and combines: eps_u + 0 * (eps_c - eps_u) is eps_u exactly.
    torch.testing.assert_close(
        draw(model, "ddim", Guidance(LABELS, null_label=null, scale=0.0)), unconditional, rtol=1e-5, atol=1e-5
    )
    guided = draw(model, "ddim", Guidance(LABELS, null_label=null, scale=4.0))
    assert not torch.allclose(conditional, unconditional) and not torch.allclose(guided, conditional)
    # The labels matter per image: swapping two labels swaps those images' conditional eps.
    swapped = draw(model, "ddim", Guidance(LABELS[[1, 0, 2, 3]], null_label=null, scale=1.0))
    assert not torch.allclose(swapped[:2], conditional[:2]) and torch.allclose(swapped[2:], conditional[2:], atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("case", SAMPLERS)
def test_the_cuda_implementation_draws_the_originals_guided_images_bit_for_bit_cpu(model, case, scale):
    ops.load_extension()
    guidance = Guidance(LABELS, null_label=CONFIG.null_label, scale=scale)
    torch.testing.assert_close(draw(model, case, guidance, fused=True), draw(model, case, guidance), rtol=0, atol=0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", SAMPLERS)
def test_the_guided_cuda_graph_draws_the_originals_images_cuda(case):
    if not ops.has_cuda_kernels():
        pytest.fail(f"the extension was built without CUDA kernels; rebuild it: {BUILD_COMMAND}")
    gpu_model = perturbed_unet(CONFIG, device="cuda")
    guidance = Guidance(LABELS, null_label=CONFIG.null_label, scale=3.0)
    plan = SCHEDULE.to("cuda").make_plan(**SAMPLERS[case], sampling_steps=6, device="cuda")
    # As sampling runs fp32 (ddpm.util.precision.backend_policy): without TF32, whose rounding differs between
    # the doubled batch's cuDNN algorithms (0.02 apart after six guided steps on an H200).
    with backend_policy("fp32"):
        sampler = od.FusedSampler(gpu_model, plan, shape=SHAPE, guidance=guidance)
        assert sampler.captured
        actual = sampler(generator=torch.Generator("cuda").manual_seed(5), guidance=guidance)
        expected = draw(gpu_model, case, guidance, device="cuda")
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        # New labels for the same captured graph: the label buffer is read at every replay.
        other = Guidance(LABELS.flip(0), null_label=CONFIG.null_label, scale=3.0)
        replayed = sampler(generator=torch.Generator("cuda").manual_seed(5), guidance=other)
        torch.testing.assert_close(replayed, draw(gpu_model, case, other, device="cuda"), rtol=1e-4, atol=1e-4)


def test_a_conditional_sampler_refuses_a_call_without_labels(model):
    ops.load_extension()
    plan = SCHEDULE.make_plan("ddim", sampling_steps=3)
    sampler = od.FusedSampler(model, plan, shape=SHAPE, guidance=Guidance(LABELS, null_label=10, scale=2.0))
    with pytest.raises(ValueError, match="pass the labels"):
        sampler(generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="fixed when the sampler is built"):
        sampler(generator=torch.Generator().manual_seed(0), guidance=Guidance(LABELS, null_label=10, scale=5.0))


def test_training_replaces_labels_by_the_null_label_at_the_configured_rate():
    from ddpm.training.trainer import TrainConfig, Trainer

    images = load_images("digits", data_dir=".", image_size=8)
    config = TrainConfig(dataset="digits", total_steps=40, batch_size=64, cond_drop=0.25, save_every=0, sample_every=0)
    trainer = Trainer(config, CONFIG, ScheduleConfig(num_timesteps=100), images=images, device="cpu")
    seen = []
    model = trainer.forward
    trainer.forward = lambda x, t, y: (seen.append(y.clone()), model(x, t, y))[1]
    for _ in range(40):
        trainer.train_step()
    labels = torch.cat(seen)
    share = (labels == CONFIG.null_label).double().mean().item()
    assert abs(share - 0.25) < 0.04, share  # 2,560 draws: 3 standard deviations is 0.026
    assert set(labels[labels != CONFIG.null_label].tolist()) == set(range(10))


def test_each_dataset_brings_its_labels(tmp_path):
    digits = load_images("digits", data_dir=".", image_size=8)
    from sklearn.datasets import load_digits

    assert torch.equal(digits.labels, torch.from_numpy(load_digits().target).long())
    assert digits.class_names == tuple("0123456789")
    x, y = digits.batch_with_labels(3, batch_size=16, seed=1)
    assert torch.equal(x, digits.batch(3, batch_size=16, seed=1)) and y.shape == (16,)
    for name, value in (("cat", 0), ("dog", 255)):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.new("L", (8, 8), value).save(tmp_path / name / f"{i}.png")
    folder = load_images("folder", data_dir=tmp_path, image_size=8, channels=1)
    assert folder.class_names == ("cat", "dog") and folder.labels.tolist() == [0, 0, 1, 1]
    assert folder.images[folder.labels == 1].min() == 255  # each image carries its own folder's label
    Image.new("L", (8, 8), 0).save(tmp_path / "loose.png")  # an image outside any class folder: no classes
    assert load_images("folder", data_dir=tmp_path, image_size=8, channels=1).labels is None


def test_class_labels_take_indices_names_lists_and_all():
    names = ("cat", "dog", "bird")
    assert class_labels(None, class_names=names) == [0, 1, 2] == class_labels("all", class_names=names)
    assert class_labels("dog, 0", class_names=names) == [1, 0]
    for text, message in (("3", "out of range"), ("fish", "not a class"), ("-1", "out of range")):
        with pytest.raises(ValueError, match=message):
            class_labels(text, class_names=names)
    assert labels_for([4, 7], n=5).tolist() == [4, 4, 4, 7, 7]
    assert grid_columns([4, 7], n=6) == 3 and grid_columns([4, 7], n=5) is None


# 32 channels: with 16, every level normalizes groups of one channel, which cancels the label (refused).
TRAIN_CONDITIONAL = [
    "--mode",
    "train",
    "--dataset",
    "digits",
    "--model_channels",
    "32",
    "--num_res_blocks",
    "1",
    "--lr",
    "2e-3",
    "--batch_size",
    "32",
    "--sample_every",
    "0",
    "--class_cond",
    "--model_path",
    "c.pt",
]


@pytest.fixture(scope="module")
def conditional_run(tmp_path_factory):
    """A small conditional digits model trained for 300 steps (about 20 s on 2 cores)."""
    work = tmp_path_factory.mktemp("conditional")
    result = run(*TRAIN_CONDITIONAL, "--max_steps", "300", cwd=work)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "conditioned on 10 classes" in result.stdout
    return work


@pytest.fixture(scope="module")
def tiny_conditional(tmp_path_factory):
    """A conditional model after 30 steps on 20 timesteps, trained in this process (no torch import): enough for
    the command line's refusals, and for its labels to change its images (a mean 38 levels apart, measured).
    20 timesteps: its end-of-run preview (70 guided images) samples 20 steps, not 100."""
    work = tmp_path_factory.mktemp("tiny_conditional")
    result = run_here(*TRAIN_CONDITIONAL, "--max_steps", "30", "--timesteps", "20", cwd=work)
    assert result.returncode == 0, result.stderr[-2000:]
    return work


@pytest.mark.slow  # 300 training steps and 200 samples of 50 steps: half a minute on 2 cores
def test_a_briefly_trained_conditional_model_draws_the_requested_digits(conditional_run):
    from ddpm.evaluation.quality import DigitJudge

    result = run(
        "--mode",
        "sample",
        "--model_path",
        "c.pt",
        "--class_label",
        "all",
        "--n_samples",
        "200",
        "--sampler",
        "ddpm",
        "--sampling_steps",
        "50",
        "--guidance_scale",
        "3",
        "--save_npz",
        "all.npz",
        "--output",
        "all.png",
        cwd=conditional_run,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    images = torch.from_numpy(np.load(conditional_run / "all.npz")["images"]).permute(
        0, 3, 1, 2
    )  # (200, 1, 8, 8) uint8
    asked = labels_for(list(range(10)), n=200)
    scores = DigitJudge(image_size=8).score(images.float() / 127.5 - 1, name="guided", requested=asked)
    accuracy = scores.on_label  # the share the judge reads as the digit asked for
    assert accuracy > 0.8, accuracy  # chance: 0.1 (measured: 0.995 on this recipe)
    grid = Image.open(conditional_run / "all.png")
    assert grid.size == ((20 * (8 + 2) + 2) * 8, (10 * (8 + 2) + 2) * 8)  # one row per digit, 20 columns, x8


@pytest.mark.parametrize(
    "args, match",
    [
        (["--mode", "sample", "--model_path", "c.pt", "--class_label", "eleven"], "not a class of this model"),
        (["--mode", "sample", "--model_path", "c.pt", "--class_label", "10"], "out of range"),
        (["--mode", "sample", "--model_path", "c.pt", "--guidance_scale", "-1"], "--guidance_scale must be between"),
        (["--mode", "train", "--resume", "--model_path", "c.pt", "--class_cond"], "--class_cond makes a new model"),
        (
            ["--mode", "train", "--dataset", "digits", "--class_cond", "--cond_drop", "1.5", "--model_path", "n.pt"],
            "--cond_drop",
        ),
    ],
)
def test_conditional_user_errors_end_in_one_line(tiny_conditional, args, match):
    assert_user_error(run_here(*args, cwd=tiny_conditional), match)


def test_labels_for_an_unconditional_model_are_refused(tmp_path):
    result = run_here(
        "--mode",
        "train",
        "--dataset",
        "digits",
        "--model_channels",
        "16",
        "--num_res_blocks",
        "1",
        "--timesteps",
        "20",
        "--max_steps",
        "1",
        "--batch_size",
        "8",
        "--sample_every",
        "0",
        "--model_path",
        "u.pt",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert_user_error(
        run_here("--mode", "sample", "--model_path", "u.pt", "--class_label", "3", cwd=tmp_path), "is unconditional"
    )
    folder = tmp_path / "flat"
    folder.mkdir()
    Image.new("L", (8, 8), 0).save(folder / "a.png")
    args = [
        "--mode",
        "train",
        "--dataset",
        "folder",
        "--data_dir",
        str(folder),
        "--img_size",
        "8",
        "--channels",
        "1",
        "--class_cond",
        "--batch_size",
        "1",
        "--model_path",
        "f.pt",
    ]
    assert_user_error(run_here(*args, cwd=tmp_path), "--class_cond needs labels")


def test_a_conditional_unet_whose_norm_groups_would_cancel_the_label_is_refused():
    # The older "add" conditioning, with groups of one channel everywhere, would cancel the label.
    narrow = dict(
        image_size=8, model_channels=16, channel_mult=(1, 2), num_classes=10, attention_resolutions=(), norm_groups=32
    )
    with pytest.raises(ValueError, match="model_channels 32 or more"):
        UNetConfig(**narrow, time_conditioning="add")
    # Scale-shift conditioning (the default) reaches the output through such groups: accepted, and the label counts.
    model = perturbed_unet(UNetConfig(**narrow, in_channels=1, num_heads=1))
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([400, 400])
    assert (model(x, t, torch.tensor([3, 3])) - model(x, t, torch.tensor([10, 10]))).abs().max() > 1e-3
    # The same widths with norm groups of two channels: the label changes eps.
    model = perturbed_unet(CONFIG)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([400, 400])
    assert (model(x, t, torch.tensor([3, 3])) - model(x, t, torch.tensor([10, 10]))).abs().max() > 1e-3


def test_image_set_without_labels_cannot_train_a_conditional_model():
    from ddpm.training.trainer import TrainConfig, Trainer

    images = ImageSet("random", torch.zeros(8, 1, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no classes"):
        Trainer(
            TrainConfig(dataset="random", batch_size=4),
            CONFIG,
            ScheduleConfig(num_timesteps=10),
            images=images,
            device="cpu",
        )


@pytest.mark.parametrize(
    "names",
    [
        "original,cuda_steps",
        # Slow: the onnxruntime row exports the U-Net (10 s on 2 cores); guided onnxruntime sampling from an export
        # is checked by test_exported_conditional_unets_take_labels_and_draw_the_originals_images.
        pytest.param("original,cuda_steps,onnxruntime", marks=pytest.mark.slow),
    ],
)
def test_the_benchmark_times_guided_sampling_on_the_rows_that_run_conditional_models(
    tiny_conditional, monkeypatch, names
):
    import json

    from ddpm.benchmarks import sampling_bench

    # The machine's peaks (large matmuls before and after the rows: seconds) are not what this checks.
    monkeypatch.setattr(sampling_bench, "measure_peaks", lambda *a, **k: {"fp32": {"fake": 1.0}})

    args = [
        "--mode",
        "benchmark",
        "--model_path",
        "c.pt",
        "--rows",
        names,
        "--n_samples",
        "4",
        "--sampler",
        "ddim",
        "--sampling_steps",
        "3",
        "--repeats",
        "1",
        "--guidance_scale",
        "3",
        "--json",
        "b.json",
    ]
    result = run_here(*args, cwd=tiny_conditional)
    assert result.returncode == 0, result.stderr
    report = json.loads((tiny_conditional / "b.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert report["environment"]["guidance_scale"] == 3.0
    assert rows["original"]["status"] == rows["cuda_steps"]["status"] == "ok"
    # the fused combine, bit for bit (cuda_steps: the step kernels with the plain U-Net)
    assert rows["cuda_steps"]["parity"] == "pass" and rows["cuda_steps"]["max_abs_diff"] == 0.0
    if "onnxruntime" in names:
        assert rows["onnxruntime"]["status"] == "ok" and rows["onnxruntime"]["parity"] == "pass"


def test_exported_conditional_unets_take_labels_and_draw_the_originals_images(tiny_conditional):
    """ONNX (through onnxruntime) and TorchScript (through the cuda implementation) exports carry the
    label input and the class names: guided sampling from them draws the checkpoint's images, for two
    label sets the trained model draws differently (so an export that dropped the labels would fail)."""
    work = tiny_conditional
    for fmt in ("onnx", "torchscript"):
        result = run_here("--mode", "export", "--model_path", "c.pt", "--format", fmt, cwd=work)
        assert result.returncode == 0, result.stderr
    runs = {
        "original": ["--model_path", "c.pt"],
        "onnx": ["--model_path", "c.onnx", "--implementation", "onnxruntime"],
        "torchscript": ["--model_path", "c.ts", "--trust_torchscript", "--implementation", "cuda"],
    }
    images = {}
    for labels in ("3,7", "1,0"):
        draw_args = [
            "--mode",
            "sample",
            "--class_label",
            labels,
            "--n_samples",
            "4",
            "--sampler",
            "ddim",
            "--sampling_steps",
            "4",
        ]
        for name, args in runs.items():
            result = run_here(*draw_args, *args, "--save_npz", f"{name}.npz", "--output", f"{name}.png", cwd=work)
            assert result.returncode == 0, result.stderr
            images[name, labels] = np.load(work / f"{name}.npz")["images"].astype(int)
        assert np.abs(images["onnx", labels] - images["original", labels]).max() <= 1  # uint8: float rounding at most
        assert np.abs(images["torchscript", labels] - images["original", labels]).max() <= 1
    # Same noise, other labels: the trained model's images differ far beyond rounding.
    assert np.abs(images["original", "3,7"] - images["original", "1,0"]).mean() > 10
    result = run_here(
        *draw_args, "--model_path", "c.onnx", "--implementation", "onnxruntime", "--class_label", "11", cwd=work
    )
    assert_user_error(result, "out of range")  # the class names came along with the file


def test_class_names_a_checkpoint_could_not_hold_are_refused_before_training():
    from ddpm.training.trainer import TrainConfig, Trainer

    names = tuple("x" * 101 if i == 3 else str(i) for i in range(10))  # a folder's 101-character sub-folder name
    images = ImageSet(
        "folder", torch.zeros(8, 1, 8, 8, dtype=torch.uint8), labels=torch.arange(8) % 10, class_names=names
    )
    with pytest.raises(ValueError, match="class names must be 1 to 100 characters"):
        Trainer(
            TrainConfig(dataset="folder", batch_size=4),
            CONFIG,
            ScheduleConfig(num_timesteps=10),
            images=images,
            device="cpu",
        )


def test_class_names_a_model_file_repeats_are_refused():
    from ddpm.conditioning import read_class_names

    assert read_class_names({"class_names": ["cat", "dog"]}, num_classes=2, source="m.pt") == ("cat", "dog")
    with pytest.raises(ValueError, match="m.pt: its class names hold 'cat' twice"):
        read_class_names({"class_names": ["cat", "dog", "cat"]}, num_classes=3, source="m.pt")
