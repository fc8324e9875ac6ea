"""Evaluate mode: its digit metrics on inputs whose answer is known, the sweep's JSON, and the CLI.

Specification: held-out real digits score near the ceiling and noise at the floor; a training
image copied into the samples is flagged as memorised and a new image is not; the Frechet
distance is zero for identical sets and matches the closed form for Gaussians; the sweep writes
one JSON row per (sampler, steps) with the ceiling and floor beside them, and a plot.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import main
from ddpm.evaluation import quality

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def judge() -> quality.DigitJudge:
    return quality.DigitJudge(image_size=16, seed=0)


def test_frechet_distance_is_the_closed_form_for_gaussians():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((20000, 2))
    b = rng.standard_normal((20000, 2)) * 2.0 + np.array([3.0, 0.0])
    # ||mu_a - mu_b||^2 + tr(C_a + C_b - 2 (C_a C_b)^1/2) = 9 + (2 + 8 - 2 * 4) = 11
    assert quality.frechet_distance(a, b) == pytest.approx(11.0, rel=0.03)
    assert quality.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)


def test_real_digits_score_near_the_ceiling_and_noise_at_the_floor(judge):
    ceiling = judge.ceiling(256, seed=0)
    floor = judge.floor(256, seed=0, image_size=16)
    assert ceiling.confident > 0.75 and ceiling.classes == 10
    assert floor.confident == 0.0 and floor.classes == 0
    assert floor.frechet > 20 * ceiling.frechet
    # Real digits the classifier never saw, scored as samples, land near the ceiling.
    held = torch.from_numpy(judge.held_features[:256]).float().view(-1, 1, 8, 8) * 2 - 1
    scores = judge.score(held, name="held-out")
    assert abs(scores.confident - ceiling.confident) < 0.08 and scores.classes == 10


def test_the_ceiling_at_more_samples_than_either_half_holds_uses_all_it_can(judge):
    """evaluate --n_samples 1024: the ceiling draws from both halves without replacement (it raised numpy's
    "Cannot take a larger sample than population" after the samples were drawn)."""
    most = min(len(judge.held_features), len(judge.train_features))
    assert judge.ceiling(1024, seed=0).n == most < 1024


def test_a_copied_training_image_is_flagged_as_memorised_and_a_new_one_is_not(judge):
    copies = judge.real_images[:50]
    assert judge.score(copies, name="copies").memorised == 1.0
    # Each real digit blended with another: new images (a blend of two 7s is a new 7).
    blends = 0.5 * (judge.real_images[100:150] + judge.real_images[150:200])
    assert judge.score(blends, name="blends").memorised == 0.0


def tiny_digits_checkpoint(tmp_path):
    """digits.pt: a 16x16 digits U-Net trained two steps on 20 timesteps."""
    from basic_diffusion import UNetConfig
    from ddpm.data.datasets import load_images
    from ddpm.training.trainer import TrainConfig, Trainer
    from noise_schedule import ScheduleConfig

    ckpt = tmp_path / "digits.pt"
    config = TrainConfig(
        dataset="digits",
        total_steps=2,
        batch_size=8,
        lr=1e-3,
        warmup_steps=0,
        save_every=0,
        sample_every=0,
        checkpoint=str(ckpt),
    )
    model_config = UNetConfig(
        image_size=16,
        in_channels=1,
        model_channels=16,
        channel_mult=(1, 2),
        num_res_blocks=1,
        attention_resolutions=(),
        num_heads=1,
        dropout=0.0,
        norm_groups=8,
    )
    images = load_images("digits", data_dir=tmp_path, image_size=16)
    trainer = Trainer(config, model_config, ScheduleConfig(num_timesteps=20), images=images, device="cpu")
    for _ in range(config.total_steps):
        trainer.train_step()
    trainer.save()
    return ckpt


def test_the_sweep_writes_one_row_per_sampler_and_steps_with_ceiling_and_floor(tmp_path, capsys, judge):
    from basic_diffusion import sample
    from ddpm.backends.artifacts import load_artifact
    from noise_schedule import NoiseSchedule

    ckpt = tiny_digits_checkpoint(tmp_path)
    out_json, out_png = tmp_path / "e.json", tmp_path / "e.png"
    args = [
        "--device",
        "cpu",
        "--mode",
        "evaluate",
        "--model_path",
        str(ckpt),
        "--sampler",
        "ddim,dpm_solver",
        "--sampling_steps",
        "2,4",
        "--n_samples",
        "12",
        "--batch_size",
        "8",
        "--json",
        str(out_json),
        "--chart",
        str(out_png),
    ]
    assert main.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "(ceiling: held-out real digits)" in out and "(floor: uniform noise)" in out
    # --implementation auto (the default) says what it chose for this model, as sample mode does.
    from ddpm.backends.selection import choose
    from optimized_diffusion import DeviceKind

    assert choose(DeviceKind.of(torch.device("cpu")), precision="fp32", dims=2).line in out.splitlines()
    result = json.loads(out_json.read_text())
    assert [(r["sampler"], r["steps"]) for r in result["rows"]] == [
        ("ddim", 2),
        ("ddim", 4),
        ("dpm_solver", 2),
        ("dpm_solver", 4),
    ]
    # Each row against an independent computation: the original loop from the same noise (one generator seeded
    # with --seed 0, batches of 8 then 4), scored by a judge fitted with the same seed.
    artifact = load_artifact(ckpt, device=torch.device("cpu"))
    schedule = NoiseSchedule(artifact.schedule_config)
    for row in result["rows"]:
        plan = schedule.make_plan(row["sampler"], sampling_steps=row["steps"])
        generator = torch.Generator().manual_seed(0)
        images = torch.cat(
            [sample(artifact.model, plan, shape=(size, 1, 16, 16), generator=generator) for size in (8, 4)]
        )
        expected = judge.score(images, name="reference")
        assert row["n"] == 12 and row["seconds"] > 0
        assert (row["confident"], row["classes"], row["memorised"]) == (
            expected.confident,
            expected.classes,
            expected.memorised,
        )
        assert row["frechet"] == pytest.approx(expected.frechet, rel=1e-4)
    for key, scores in (("ceiling", judge.ceiling(12, seed=0)), ("floor", judge.floor(12, seed=0, image_size=16))):
        expected = dataclasses.asdict(scores)
        assert {k: result[key][k] for k in ("n", "confident", "classes")} == {
            k: expected[k] for k in ("n", "confident", "classes")
        }
        assert result[key]["frechet"] == pytest.approx(expected["frechet"], rel=1e-6)
    assert result["ceiling"]["memorised"] is None and result["floor"]["confident"] == 0.0  # NaN: not defined for real
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    # Lists are for evaluate only; other modes name the flag in one line.
    assert main.main(["--device", "cpu", "--mode", "sample", "--model_path", str(ckpt), "--sampler", "ddim,ddpm"]) == 2
    assert "--sampler takes one value" in capsys.readouterr().err
    # A --dataset that contradicts the one the checkpoint records is refused, naming both; so is a sample count
    # whose samples cannot fit in memory (before any is drawn) and one too small for a covariance.
    assert main.main([*args, "--dataset", "mnist"]) == 2
    assert "--dataset mnist contradicts" in (err := capsys.readouterr().err) and "trained on digits" in err
    assert main.main([*args[:-8], "--n_samples", str(10**13)]) == 2
    assert "at most 50,000 samples per row" in capsys.readouterr().err  # time: refused before anything is read
    assert main.main([*args[:-8], "--n_samples", "1"]) == 2
    assert "--n_samples 2 or more" in capsys.readouterr().err
    # Outputs are checked before any work: the JSON may not replace the model.
    assert main.main([*args[:-4], "--json", str(ckpt)]) == 2
    assert "--json" in capsys.readouterr().err


# Slow: an ONNX export (10 s on 2 cores). Evaluate takes the dataset a model file records (a checkpoint's, in the sweep
# above) through the artifact, and tests/backends/test_artifacts.py reads an export's.
@pytest.mark.slow
def test_an_export_records_its_training_data_so_evaluate_judges_it_as_the_checkpoint(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    ckpt = tiny_digits_checkpoint(tmp_path)
    onnx = tmp_path / "digits.onnx"
    assert (
        main.main(
            [
                "--device",
                "cpu",
                "--mode",
                "export",
                "--format",
                "onnx",
                "--model_path",
                str(ckpt),
                "--output",
                str(onnx),
            ]
        )
        == 0
    )
    exported = [
        "--device",
        "cpu",
        "--mode",
        "evaluate",
        "--model_path",
        str(onnx),
        "--implementation",
        "onnxruntime",
        "--sampler",
        "ddim",
        "--sampling_steps",
        "2",
        "--n_samples",
        "12",
        "--batch_size",
        "8",
    ]
    capsys.readouterr()
    assert main.main(exported) == 0, capsys.readouterr().err
    assert "fitting the digit classifier" in capsys.readouterr().out
    assert main.main([*exported, "--dataset", "spheres"]) == 2  # --dataset may not contradict the recorded data
    assert "--dataset spheres contradicts" in capsys.readouterr().err


def test_evaluate_refuses_a_row_of_samples_that_cannot_fit_in_memory_saying_how_many_do(monkeypatch):
    from ddpm.modes import evaluate
    from ddpm.util import memory

    monkeypatch.setattr(memory, "_host_available", lambda: 8 << 30)  # 8 GiB free
    evaluate.check_samples_fit(1_000, (3, 256, 256))  # 750 MiB: fits in half of it
    with pytest.raises(ValueError, match=r"--n_samples 50000: .* at most 5461 fit"):
        evaluate.check_samples_fit(50_000, (3, 256, 256))  # 36.6 GiB


def test_a_model_that_records_no_dataset_asks_for_dataset_instead_of_guessing(tmp_path):
    from helpers import assert_user_error, perturbed_unet, run_here, save_weights_only, tiny_unet_config

    save_weights_only(tmp_path / "m.pt", perturbed_unet(tiny_unet_config()))  # no train_config
    result = run_here("--mode", "evaluate", "--model_path", "m.pt", "--n_samples", "2", cwd=tmp_path)
    assert_user_error(result, "m.pt records no training dataset; name the data to judge it against with --dataset")


def test_a_data_dir_that_the_models_data_never_read_is_refused(tmp_path):
    """A digits model's judge reads scikit-learn's digits: a --data_dir would be ignored, so it is refused."""
    from helpers import assert_user_error, perturbed_unet, run_here, save_weights_only, tiny_unet_config

    save_weights_only(tmp_path / "m.pt", perturbed_unet(tiny_unet_config()))
    evaluate = ("--mode", "evaluate", "--model_path", "m.pt", "--n_samples", "2", "--dataset", "digits")
    result = run_here(*evaluate, "--data_dir", "elsewhere", cwd=tmp_path)
    assert_user_error(result, "--data_dir elsewhere: m.pt is a model of digits, which no folder holds")


# ----- issue 58: a student is evaluated beside its own teacher only, and its row names its file -----------------
@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A folder with two tiny digits models (a.pt; b.pt, another seed) and two 2-step students of a.pt."""
    from helpers import tiny_student, tiny_teacher

    folder = tmp_path_factory.mktemp("teachers")
    a = tiny_teacher(folder, "a.pt", "--timesteps", "10")  # its end-of-run preview costs a step each
    tiny_teacher(folder, "b.pt", "--seed", "1", "--timesteps", "10")
    for name, seed in (("sa.pt", "3"), ("sa2.pt", "4")):
        tiny_student(folder, a, name, "--sampling_steps", "2", "--seed", seed)
    return folder


def test_evaluate_refuses_a_student_of_another_teacher_before_drawing_a_row(teachers):
    from helpers import assert_user_error, run_here

    result = run_here(
        "--mode", "evaluate", "--model_path", "b.pt", "--students", "sa.pt", "--n_samples", "8", cwd=teachers
    )  # fmt: skip
    assert_user_error(result, "--students sa.pt is a student of another model (a.pt, whose weights and configs hash")
    assert "not of --model_path b.pt" in result.stderr
    assert "evaluate: " not in result.stdout and "drawing" not in result.stdout  # before the estimate and any row


def test_each_students_row_in_the_table_names_its_file(teachers):
    from helpers import run_here

    # --no_ema draws a.pt's raw weights: it is still the students' teacher, known by its EMA weights.
    result = run_here(
        "--mode", "evaluate", "--model_path", "a.pt", "--no_ema", "--students", "sa.pt,sa2.pt", "--sampler", "ddim",
        "--sampling_steps", "2", "--n_samples", "8", "--json", "q.json", cwd=teachers,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    labels = [line.split("  ")[0] for line in result.stdout.split("\nsampler ")[1].splitlines()[1:4]]
    assert labels == ["ddim", "distilled sa.pt", "distilled sa2.pt"]  # two 2-step students, two files
    rows = json.loads((teachers / "q.json").read_text())["rows"]
    assert [(r["sampler"], r["steps"], r.get("model_path")) for r in rows] == [
        ("ddim", 2, None),
        ("distilled", 2, "sa.pt"),
        ("distilled", 2, "sa2.pt"),
    ]


def test_a_student_whose_teacher_cannot_be_compared_is_said_in_one_line(teachers, tmp_path, capsys):
    """An older run records its teacher by path, an exported teacher has no weights to hash: evaluate says it does not
    check them rather than passing them over in silence."""
    from types import SimpleNamespace

    from ddpm.formats.checkpoints import save_checkpoint
    from ddpm.modes.evaluate import check_teacher

    state = torch.load(teachers / "sa.pt", weights_only=True)
    state["distill_config"].update(teacher="elsewhere/a0.pt", teacher_sha256="")  # written before the hash
    save_checkpoint(tmp_path / "old.pt", state)
    student = SimpleNamespace(artifact=SimpleNamespace(kind="checkpoint"))
    like = SimpleNamespace(artifact=SimpleNamespace(path=teachers / "a.pt"))
    check_teacher(str(tmp_path / "old.pt"), student, like=like, identity=lambda: pytest.fail("hashed"))
    assert "records its teacher by path only (a0.pt): not checked" in capsys.readouterr().out
    check_teacher(str(teachers / "sa.pt"), student, like=like, identity=lambda: None)  # like: an ONNX export, say
    assert "holds no PyTorch weights to compare with its teacher's: not checked" in capsys.readouterr().out


# ----- issue 67: an exported student draws its row, with one line saying its teacher cannot be checked ---------
@pytest.mark.parametrize("fmt,name", [("safetensors", "sa.safetensors"), ("diffusers", "sa_diffusers")])
def test_an_exported_student_draws_its_row_and_says_its_teacher_cannot_be_checked(teachers, tmp_path, fmt, name):
    from helpers import run_here

    exported = run_here(
        "--mode", "export", "--model_path", str(teachers / "sa.pt"), "--format", fmt, "--output", name, cwd=tmp_path
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    result = run_here(
        "--mode", "evaluate", "--model_path", str(teachers / "a.pt"), "--students", name, "--sampler", "ddim",
        "--sampling_steps", "2", "--n_samples", "8", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith(f"--students {name}")]
    assert notes == [f"--students {name} records no teacher (an export of a student): its teacher cannot be checked"]
    assert f"distilled {name}" in result.stdout.split("\nsampler ")[1]
