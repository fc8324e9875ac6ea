"""--mode distill (ddpm/training/distill.py, ddpm/modes/distill.py): the teacher's trajectories against the
exact ODE of Gaussian data, the student's target against its closed form, the loop's loss going down, resume
continuing exactly, a student sampled alike by every implementation, and the refusals."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import TINY_DISTILL, TINY_TRAIN, assert_user_error, needs_onnx, run_here
from helpers import distill_here as distill

from ddpm.training.distill import (
    DistillConfig,
    DistillObjective,
    Trajectories,
    student_schedule,
    teacher_grid,
    teacher_trajectories,
)
from noise_schedule import NoiseSchedule, ScheduleConfig, make_betas

F64 = torch.float64


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny digits checkpoint (3 training steps) as the teacher."""
    folder = tmp_path_factory.mktemp("teacher")
    result = run_here(*TINY_TRAIN, "--model_path", "teacher.pt", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / "teacher.pt"


def test_teacher_grid_holds_the_students_timesteps_and_spends_its_steps_between_them():
    config = ScheduleConfig()
    grid = teacher_grid(config, (999, 749, 499, 249), 32)
    assert grid == sorted(set(grid), reverse=True) and grid[0] == 999 and grid[-1] == 0
    assert {999, 749, 499, 249} <= set(grid) and 28 <= len(grid) - 1 <= 32
    ac = torch.cumprod(1 - make_betas(config), 0)
    lam = 0.5 * torch.log(ac / (1 - ac))
    between = [t for t in grid if 499 > t > 249]  # evenly spaced in log-SNR within a segment
    assert torch.diff(lam[[499, *between, 249]]).std() < 0.2 * torch.diff(lam[[499, *between, 249]]).mean().abs()


def test_teacher_trajectories_follow_the_exact_ode_of_gaussian_data():
    # For data N(mu, s^2) the optimal eps is analytic and the ODE maps x_t to mu + s (x_t - sqrt(abar) mu) /
    # sqrt(abar s^2 + 1 - abar): each recorded state must end where the exact map sends it.
    schedule = NoiseSchedule(ScheduleConfig())
    mu, s = 0.3, 0.2

    def optimal_eps(x, t):
        abar = schedule.alphas_cumprod[t].view(-1, 1, 1, 1)
        return (1 - abar).sqrt() * (x - abar.sqrt() * mu) / (abar * s**2 + 1 - abar)

    students = (999, 499)
    config = DistillConfig(teacher="gaussian", sampling_steps=2, samples=16, teacher_steps=40)
    out = teacher_trajectories(
        optimal_eps,
        schedule,
        config=config,
        student_timesteps=students,
        sample_shape=(1, 4, 4),
        clip_denoised=False,
        device=torch.device("cpu"),
        progress=False,
    )
    abar = torch.cumprod(1 - make_betas(schedule.config), 0)
    for k, t in enumerate(students):
        exact = mu + s * (out.x_t[:, k].double() - abar[t].sqrt() * mu) / (abar[t] * s**2 + 1 - abar[t]).sqrt()
        assert torch.allclose(out.x_start.double(), exact, atol=5e-3), t


def test_the_students_target_is_the_v_that_maps_a_state_to_its_trajectorys_end():
    teacher = ScheduleConfig(num_timesteps=100)
    config = DistillConfig(teacher="t", sampling_steps=2, samples=3, teacher_steps=4, spacing="even")
    schedule_config = student_schedule(teacher, config, side=8)
    assert (schedule_config.prediction, schedule_config.student_sampler) == ("v", "consistency")
    assert schedule_config.student_timesteps == (99, 49)
    gen = torch.Generator().manual_seed(0)
    trajectories = Trajectories(
        x_t=torch.randn(3, 2, 1, 2, 2, generator=gen), x_start=torch.rand(3, 1, 2, 2, generator=gen), labels=None
    )
    objective = DistillObjective(
        config, trajectories, schedule_config=schedule_config, class_names=(), device=torch.device("cpu")
    )
    which, step = torch.tensor([2, 0, 1]), torch.tensor([1, 0, 1])
    x_t, t, y, target = objective.examples((which, step), rows=slice(None))
    abar = torch.cumprod(1 - make_betas(teacher), 0)[torch.tensor([49, 99, 49])].view(-1, 1, 1, 1)
    states, ends = trajectories.x_t[which, step].double(), trajectories.x_start[which].double()
    # x_0 = sqrt(abar) x_t - sqrt(1 - abar) v, so v = (sqrt(abar) x_t - x_0) / sqrt(1 - abar).
    by_hand = (abar.sqrt() * states - ends) / (1 - abar).sqrt()
    assert t.tolist() == [49, 99, 49] and y is None
    assert torch.allclose(target.double(), by_hand, atol=1e-5)
    assert torch.allclose(objective.schedule.predict_xstart(x_t, t, target).double(), ends, atol=1e-5)


def test_a_few_distillation_steps_lower_the_students_loss(tmp_path, teacher):
    from ddpm.backends.artifacts import load_artifact
    from ddpm.training.trainer import TrainConfig, Trainer

    device = torch.device("cpu")
    artifact = load_artifact(teacher, device=device)
    config = DistillConfig(teacher=str(teacher), sampling_steps=2, samples=16, teacher_steps=8, spacing="even")
    objective = DistillObjective.build(artifact, config, device=device, clip_denoised=True, progress=False)
    train = TrainConfig(
        dataset="digits",
        total_steps=12,
        batch_size=16,
        lr=1e-3,
        warmup_steps=1,
        checkpoint=str(tmp_path / "student.pt"),
        save_every=0,
        sample_every=0,
        cond_drop=0.0,
    )
    trainer = Trainer(
        train, artifact.model_config, objective.schedule_config, images=None, device=device, objective=objective
    )
    trainer.model.load_state_dict(artifact.model.state_dict())
    every = (torch.arange(16).repeat_interleave(2), torch.arange(2).repeat(16))  # every example once

    def loss() -> float:
        with torch.no_grad():
            return objective.loss(trainer.model.eval(), every, rows=slice(None)).item()

    before = loss()
    trainer.run(progress=False)
    assert loss() < 0.8 * before


def test_resume_continues_a_distillation_exactly(tmp_path, teacher):
    from ddpm.cli import parser, resolve
    from ddpm.modes.distill import new_student

    assert distill(tmp_path, teacher, "--max_steps", "4", output="whole.pt").returncode == 0
    # A run of 4 steps stopped after 2 (as Ctrl-C leaves it), then resumed from the command line.
    flags = ["--mode", "distill", "--model_path", str(teacher), "--output", str(tmp_path / "half.pt"), *TINY_DISTILL]
    trainer, _ = new_student(resolve.request_for(parser.parse_args([*flags, "--max_steps", "4"])))
    trainer.run(until_step=2, progress=False)
    trainer.save()
    resumed = run_here(*flags, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming the distillation" in resumed.stdout + resumed.stderr
    whole, half = (torch.load(tmp_path / name, weights_only=True) for name in ("whole.pt", "half.pt"))
    assert half["step"] == whole["step"] == 4
    for part in ("model", "ema"):
        for key, value in whole[part].items():
            assert torch.equal(half[part][key], value), key  # bit for bit on the CPU


def draw_student_on(tmp_path, runs: list[tuple[str, str]]) -> dict:
    """The images each (implementation, model file) draws of the student with its own sampler and steps."""
    images = {}
    for implementation, path in runs:
        out = f"{implementation}.npz"
        drawn = run_here(
            "--mode",
            "sample",
            "--model_path",
            path,
            "--implementation",
            implementation,
            "--n_samples",
            "4",
            "--no_grid",
            "--save_npz",
            out,
            cwd=tmp_path,
        )
        assert drawn.returncode == 0, drawn.stderr
        assert "consistency, 4 steps" in drawn.stdout, drawn.stdout  # the student's own sampler and steps
        images[implementation] = next(iter(np.load(tmp_path / out).values()))
    for implementation, drawn in images.items():
        np.testing.assert_allclose(drawn, images["original"], atol=1e-4, err_msg=implementation)
    return images


def test_a_student_draws_the_same_images_on_every_implementation(tmp_path, teacher):
    result = distill(tmp_path, teacher, "--max_steps", "2")
    assert result.returncode == 0, result.stderr
    assert "4 U-Net calls per image" in result.stdout + result.stderr
    draw_student_on(tmp_path, [("original", "student.pt"), ("cuda_steps", "student.pt"), ("cuda", "student.pt")])


@pytest.mark.slow  # an ONNX export (10 s on 2 cores); the student's own sampler from its checkpoint: the test above
@needs_onnx
def test_an_exported_student_draws_the_checkpoints_images_through_onnxruntime(tmp_path, teacher):
    assert distill(tmp_path, teacher, "--max_steps", "2").returncode == 0
    exported = run_here("--mode", "export", "--format", "onnx", "--model_path", "student.pt", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    draw_student_on(tmp_path, [("original", "student.pt"), ("onnxruntime", "student.onnx")])


def test_a_student_asked_for_other_steps_says_what_it_was_trained_for(tmp_path, teacher):
    assert distill(tmp_path, teacher, "--max_steps", "1", "--sampling_steps", "2").returncode == 0
    drawn = run_here(
        "--mode", "sample", "--model_path", "student.pt", "--sampling_steps", "3", "--n_samples", "2", cwd=tmp_path
    )
    assert drawn.returncode == 0, drawn.stderr
    warning = [line for line in drawn.stderr.splitlines() if "warning" in line]
    assert warning == [
        "main.py: warning: this student was trained for the consistency sampler in 2 steps (t = 49, 17); "
        "drawing with consistency in 3 steps as asked"
    ]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--output", "teacher.pt"], "--output teacher.pt is the same file as --model_path"),
        (["--output", "teacher.pt", "--overwrite"], "--output teacher.pt is the same file as --model_path"),
        (["--output", "other.pt", "--resume"], "other.pt"),
        (["--sampling_steps", "3"], "invalid choice: 3"),
        (["--sampling_steps", "0"], "invalid choice: 0"),
        (["--guidance_scale", "2"], "applies to class-conditional teachers"),
        (["--teacher_steps", "2"], "--teacher_steps must be between the student's 4 steps"),
        (["--output", "student.onnx"], "--output must name a .pt checkpoint"),
    ],
)
def test_distill_refuses_in_one_line(tmp_path, teacher, args, message):
    (tmp_path / "teacher.pt").write_bytes(teacher.read_bytes())
    before = (tmp_path / "teacher.pt").read_bytes()
    result = run_here("--mode", "distill", "--model_path", "teacher.pt", *TINY_DISTILL, *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "teacher.pt").read_bytes() == before


def test_a_student_of_a_student_is_refused(tmp_path, teacher):
    assert distill(tmp_path, teacher, "--max_steps", "1").returncode == 0
    result = distill(tmp_path, tmp_path / "student.pt", "--max_steps", "1", output="grandchild.pt")
    assert result.returncode == 2 and "is already a distilled student (4 steps)" in result.stderr
    assert not (tmp_path / "grandchild.pt").exists()


def test_a_class_conditional_teacher_distills_with_its_guidance_folded_into_one_call(tmp_path, teacher):
    # 20 timesteps (the last --timesteps wins): the end-of-run preview of 70 guided images samples 20 steps, not 50.
    trained = run_here(*TINY_TRAIN, "--timesteps", "20", "--class_cond", "--model_path", "cond.pt", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    result = run_here(
        "--mode",
        "distill",
        "--model_path",
        "cond.pt",
        "--output",
        "student.pt",
        *TINY_DISTILL,
        "--max_steps",
        "1",
        "--guidance_scale",
        "2.5",
        "--sampling_steps",
        "2",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "guidance 2.5 folded in" in result.stdout + result.stderr
    state = torch.load(tmp_path / "student.pt", weights_only=True)
    assert state["schedule_config"]["folded_guidance"] == 2.5 and state["class_names"]
    assert state["distill_config"]["guidance_scale"] == 2.5
    # Sampled with one conditional call per step (no doubled batch), and another scale on top is refused.
    from ddpm.backends.artifacts import load_artifact
    from ddpm.backends.selection import folded_scale

    assert folded_scale(load_artifact(tmp_path / "student.pt", device=torch.device("cpu")), None) == 1.0
    drawn = run_here("--mode", "sample", "--model_path", "student.pt", "--n_samples", "2", cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    again = run_here(
        "--mode", "sample", "--model_path", "student.pt", "--guidance_scale", "2", "--n_samples", "2", cwd=tmp_path
    )
    assert again.returncode == 2 and "guidance 2.5 folded in" in again.stderr
    # Beside an unconditional teacher in evaluate, it is refused before any row is drawn, in the flags' words.
    (tmp_path / "uncond.pt").write_bytes(teacher.read_bytes())
    evaluated = run_here(
        "--mode", "evaluate", "--model_path", "uncond.pt", "--students", "student.pt", "--n_samples", "2", cwd=tmp_path
    )
    assert_user_error(evaluated, "--students student.pt is a class-conditional model and --model_path uncond.pt is not")
    # Guidance 0 (the unconditional model) cannot be folded into a student that records 0 as "none folded".
    zero = run_here(
        "--mode",
        "distill",
        "--model_path",
        "cond.pt",
        "--output",
        "zero.pt",
        *TINY_DISTILL,
        "--guidance_scale",
        "0",
        "--max_steps",
        "1",
        cwd=tmp_path,
    )
    assert_user_error(zero, "--guidance_scale 0 would teach the student")
    assert not (tmp_path / "zero.pt").exists()


def test_evaluate_puts_students_beside_their_teachers_samplers_against_u_net_calls(tmp_path, teacher):
    import json

    assert distill(tmp_path, teacher, "--max_steps", "1", "--sampling_steps", "2").returncode == 0
    result = run_here(
        "--mode",
        "evaluate",
        "--model_path",
        str(teacher),
        "--sampler",
        "ddim",
        "--sampling_steps",
        "3",
        "--students",
        "student.pt",
        "--n_samples",
        "8",
        "--json",
        "q.json",
        "--chart",
        "q.png",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # The sweep's estimate before the first row: 3 teacher steps and 2 student calls per image, 8 images.
    assert "evaluate: 2 rows of 8 samples: 40 U-Net calls, about " in result.stdout + result.stderr
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert [(r["sampler"], r["steps"], r["calls"]) for r in rows] == [("ddim", 3, 3), ("distilled", 2, 2)]
    assert rows[1]["model_path"].endswith("student.pt")
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = run_here(
        "--mode", "evaluate", "--model_path", str(teacher), "--students", str(teacher), "--n_samples", "8", cwd=tmp_path
    )
    assert refused.returncode == 2 and "is --model_path itself, the teacher" in refused.stderr
    (tmp_path / "copy.pt").write_bytes(teacher.read_bytes())
    refused = run_here(
        "--mode", "evaluate", "--model_path", str(teacher), "--students", "copy.pt", "--n_samples", "8", cwd=tmp_path
    )
    assert refused.returncode == 2 and "--students copy.pt is not a distilled student" in refused.stderr
    for students in ("student.pt,,student.pt", " "):  # an empty item was read as the teacher, an empty list as none
        refused = run_here(
            "--mode", "evaluate", "--model_path", str(teacher), "--students", students, "--n_samples", "8", cwd=tmp_path
        )
        assert_user_error(refused, "--students")
        assert "not a distilled student" not in refused.stderr


# ----- issue 49: a resumed distillation knows its teacher; every refusal comes before the trajectories -------
def test_a_distillation_resumes_from_any_spelling_of_its_teachers_path(tmp_path, teacher):
    (tmp_path / "teacher.pt").write_bytes(teacher.read_bytes())
    flags = ["--mode", "distill", *TINY_DISTILL]
    first = run_here(*flags, "--model_path", "teacher.pt", "--output", "s.pt", "--max_steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run_here(
        *flags, "--model_path", "./teacher.pt", "--output", "s.pt", "--max_steps", "3", "--resume", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    (tmp_path / "sub").mkdir()
    resumed = run_here(
        *flags,
        "--model_path",
        "../teacher.pt",
        "--output",
        "../s.pt",
        "--max_steps",
        "4",
        "--resume",
        cwd=tmp_path / "sub",
    )
    assert resumed.returncode == 0, resumed.stderr
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["step"] == 4 and state["distill_config"]["teacher"] == "teacher.pt"  # the path as first given
    assert len(state["distill_config"]["teacher_sha256"]) == 64


def refuse_trajectories(monkeypatch) -> None:
    from ddpm.training import distill as method

    def drawn(*args, **kwargs):
        pytest.fail("the teacher's trajectories were drawn before the refusal")

    monkeypatch.setattr(method, "teacher_trajectories", drawn)


def test_a_resumed_distillation_refuses_a_changed_teacher_naming_both_hashes(tmp_path, teacher, monkeypatch):
    (tmp_path / "teacher.pt").write_bytes(teacher.read_bytes())
    flags = ["--mode", "distill", "--model_path", "teacher.pt", "--output", "s.pt", *TINY_DISTILL]
    assert run_here(*flags, "--max_steps", "1", cwd=tmp_path).returncode == 0
    recorded = torch.load(tmp_path / "s.pt", weights_only=True)["distill_config"]["teacher_sha256"]
    # The teacher retrained in place: the same configs under the same name, other weights.
    state = torch.load(tmp_path / "teacher.pt", weights_only=True)
    name = next(iter(state["ema"]))
    state["ema"][name] = state["ema"][name] + 0.01
    torch.save(state, tmp_path / "teacher.pt")
    student = (tmp_path / "s.pt").read_bytes()
    refuse_trajectories(monkeypatch)
    result = run_here(*flags, "--max_steps", "2", "--resume", cwd=tmp_path)
    assert_user_error(result, "--model_path teacher.pt is not the teacher s.pt learns from")
    hashes = re.findall(r"\b[0-9a-f]{16}\b", result.stderr)  # the teacher's now, and the one it learns from
    assert len(set(hashes)) == 2 and hashes[1] == recorded[:16], result.stderr
    assert (tmp_path / "s.pt").read_bytes() == student


def test_a_resumed_distillation_refuses_every_changed_recipe_flag_naming_both_values(tmp_path, teacher, monkeypatch):
    """--resume compares every flag that shapes the run with the checkpoint, as --mode train does (one comparison:
    modes/train.resumed_config): the optimizer's, the EMA's, the warm-up's, the trajectories'."""
    flags = ["--mode", "distill", "--model_path", str(teacher), "--output", "s.pt", *TINY_DISTILL]
    assert run_here(*flags, "--max_steps", "1", "--warmup_steps", "0", cwd=tmp_path).returncode == 0
    student = (tmp_path / "s.pt").read_bytes()
    stored = torch.load(tmp_path / "s.pt", weights_only=True)["train_config"]
    refuse_trajectories(monkeypatch)
    for flag, value in (
        ("ema_decay", "0.9"),
        ("grad_clip", "0.5"),
        ("warmup_steps", "1"),
        ("lr", "0.001"),
        ("batch_size", "2"),
        ("teacher_steps", "16"),
    ):
        result = run_here(*flags, "--max_steps", "2", "--resume", f"--{flag}", value, cwd=tmp_path)
        theirs = stored.get(flag, 8)  # --teacher_steps: the distillation's own config (TINY_DISTILL's 8)
        assert_user_error(result, f"--{flag} {float(value) if '.' in value else value} (the checkpoint's {theirs})")
        assert (tmp_path / "s.pt").read_bytes() == student
    monkeypatch.undo()  # the trajectories of a resumed run, drawn again
    same = run_here(*flags, "--max_steps", "2", "--resume", "--ema_decay", str(stored["ema_decay"]), cwd=tmp_path)
    assert same.returncode == 0, same.stderr  # a flag given with the checkpoint's own value is no contradiction


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lr", "0"], "--lr must be a learning rate above 0"),
        (["--precision", "int8"], "--precision int8 is for exported ONNX graphs"),
        (["--log_dir", "a_file"], "--log_dir a_file is a file"),
        (["--ema_decay", "2"], "--ema_decay must be"),
        (["--grad_clip", "-1"], "--grad_clip must be"),
        (["--guidance_scale", "2"], "applies to class-conditional teachers"),
        (["--output", "sub/../teacher.pt"], "is the same file as --model_path"),
        (["--output", ""], "--output is empty"),
    ],
)
def test_distill_refuses_before_the_teachers_trajectories(tmp_path, teacher, monkeypatch, args, message):
    (tmp_path / "teacher.pt").write_bytes(teacher.read_bytes())
    (tmp_path / "a_file").write_text("a file\n")
    (tmp_path / "sub").mkdir()
    refuse_trajectories(monkeypatch)
    result = run_here("--mode", "distill", "--model_path", "teacher.pt", *TINY_DISTILL, *args, cwd=tmp_path)
    assert_user_error(result, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "sub", "teacher.pt"]


def test_a_torchscript_teacher_is_refused_with_advice_distill_accepts(tmp_path):
    (tmp_path / "t.ts").write_bytes(b"PK\x03\x04")
    result = run_here("--mode", "distill", "--model_path", "t.ts", cwd=tmp_path)
    assert_user_error(result, "--model_path t.ts is a TorchScript program; a student starts from its teacher's")
    assert "--trust_torchscript" not in result.stderr  # distill does not read that flag


def test_a_held_distillation_lock_names_the_flag_distill_reads(tmp_path, teacher, monkeypatch):
    from ddpm.util.safe_files import run_lock

    refuse_trajectories(monkeypatch)
    with run_lock(tmp_path / "s.pt", flag="--output"):
        result = run_here(
            "--mode", "distill", "--model_path", str(teacher), "--output", "s.pt", *TINY_DISTILL, cwd=tmp_path
        )
    assert_user_error(result, "choose another --output")


def test_the_trajectories_are_estimated_before_they_start_and_refused_beyond_free_memory(
    tmp_path, teacher, monkeypatch
):
    # 32 teacher steps asked; the 50-timestep teacher's grid holds 31 (the line says what the solver runs).
    result = distill(tmp_path, teacher, "--max_steps", "1", "--teacher_steps", "32")
    assert result.returncode == 0, result.stderr
    line = next(
        line for line in (result.stdout + result.stderr).splitlines() if line.startswith("teacher trajectories:")
    )
    schedule = ScheduleConfig(num_timesteps=50)
    config = DistillConfig(teacher="t", sampling_steps=4, samples=4096, teacher_steps=32)  # the defaults
    timesteps = student_schedule(schedule, config, side=16).student_timesteps
    steps = len(teacher_grid(schedule, timesteps, 32)) - 1
    assert steps == 31 and "8 x 31 solver steps (248 U-Net calls), about " in line and "held for the run" in line
    from ddpm.util import memory

    refuse_trajectories(monkeypatch)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 64 << 20)  # 64 MiB free: a batch fits, not the data
    refused = distill(tmp_path, teacher, "--max_steps", "1", "--distill_samples", "100000", output="big.pt")
    assert_user_error(refused, "--distill_samples 100000 trajectories of 1x16x16 need about")
    assert "use at most" in refused.stderr and not (tmp_path / "big.pt").exists()
