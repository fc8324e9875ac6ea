"""What a 1- or 2-call student learns against, beyond the teacher's ODE: the adversarial method's discriminator on the
teacher's training data (--adv_real data, the default where that data is read without a download), with the data's
own labels for a class-conditional teacher; the student's timesteps at choices.STUDENT_NOISE_LEVELS' noise levels on
any schedule; the longer default run for 1 and 2 calls. Each refusal is one line, before the trajectories."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_TRAIN, assert_user_error, run_here, tiny_teacher
from helpers import distill_here as distill

from ddpm.choices import DISTILL_DEFAULTS, DISTILL_MAX_STEPS_BY_STEPS, STUDENT_NOISE_LEVELS
from ddpm.data.datasets import ImageSet
from ddpm.training.distill import DistillConfig, spaced_timesteps, student_schedule
from ddpm.training.distill_losses import Adversarial, Discriminator
from noise_schedule import ScheduleConfig, consistency_timesteps


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny digits checkpoint (16x16, 10 timesteps: its end-of-run preview costs a step each) as the teacher."""
    return tiny_teacher(tmp_path_factory.mktemp("teacher"), "teacher.pt", "--timesteps", "10")


# ----- the student's timesteps ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "schedule",
    [ScheduleConfig(), ScheduleConfig(kind="cosine"), ScheduleConfig(num_timesteps=200)],
    ids=["linear-1000", "cosine-1000", "linear-200"],
)
@pytest.mark.parametrize("side", [8, 28])
def test_a_two_call_students_second_timestep_is_the_one_nearest_its_noise_level_on_any_schedule(schedule, side):
    T = schedule.num_timesteps
    if schedule.kind == "linear":  # float64 by hand: Ho et al.'s betas, scaled to T
        betas = torch.linspace(1e-4 * 1000 / T, 0.02 * 1000 / T, T, dtype=torch.float64)
    else:
        s = torch.arange(T + 1, dtype=torch.float64) / T
        f = torch.cos((s + 0.008) / 1.008 * torch.pi / 2) ** 2
        betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    abar = torch.cumprod(1 - betas, 0)
    sigma = ((1 - abar) / abar).sqrt()
    (level,) = STUDENT_NOISE_LEVELS[2]
    level *= side / 8  # sigma in proportion to the side, the 8x8 digits' level at 8
    expected = (T - 1, int((sigma - level).abs().argmin()))
    assert spaced_timesteps(schedule, steps=2, spacing="noise_levels", side=side) == expected
    assert abs(sigma[expected[1]] - level) < 0.05 * level
    even = tuple(consistency_timesteps(T, 2).tolist())
    assert spaced_timesteps(schedule, steps=2, spacing="even", side=side) == even
    for steps in (1, 4, 8):  # not listed: the even spacing
        assert spaced_timesteps(schedule, steps=steps, spacing="noise_levels", side=side) == tuple(
            consistency_timesteps(T, steps).tolist()
        )


def test_the_linear_1000_schedules_two_call_student_draws_at_t_999_and_224_at_8x8_and_later_when_larger():
    config = DistillConfig(teacher="t", sampling_steps=2, samples=8, teacher_steps=8)
    seconds = [student_schedule(ScheduleConfig(), config, side=side).student_timesteps[1] for side in (8, 16, 28, 32)]
    assert seconds[0] == 224 and seconds == sorted(seconds) and 440 < seconds[2] < 499


def test_an_old_students_config_keeps_the_even_spacing_and_the_teachers_ends():
    old = dict(teacher="t.pt", sampling_steps=2, samples=8, teacher_steps=8, guidance_scale=0.0, seed=0)
    config = DistillConfig.from_dict(old)  # written before --adv_real and the noise levels
    assert (config.spacing, config.adv_real) == ("even", "teacher")
    assert student_schedule(ScheduleConfig(), config, side=8).student_timesteps == (999, 499)
    with pytest.raises(ValueError, match="--adv_real must be one of data, teacher"):
        DistillConfig.from_dict({**old, "adv_real": "both"})


# ----- the discriminator's real images -------------------------------------------------------------------------
def test_the_discriminator_learns_the_training_data_not_the_teachers_ends():
    """Real images from ``data``: the discriminator tells them from the student's x_0 even where the teacher's ends
    (passed as x_start) are the student's own x_0, which it could never tell apart."""
    gen = torch.Generator().manual_seed(1)
    data = ImageSet(name="t", images=torch.full((32, 1, 8, 8), 230, dtype=torch.uint8))  # bright: 0.8 in [-1, 1]
    torch.manual_seed(0)
    method = Adversarial(Discriminator(sample_shape=(1, 8, 8)), weight=0.5, lr=1e-3, device="cpu", data=data)
    fake = -0.5 + 0.1 * torch.randn(16, 1, 8, 8, generator=gen)
    for _ in range(30):
        draws = method.draw(16, generator=gen, device=torch.device("cpu"))
        out = fake.clone().requires_grad_(True)
        method.loss(out.square().mean(), out=out, x0=out, x_start=fake, y=None, draws=draws)
    with torch.no_grad():
        says_real, says_fake = method.discriminator(data.rows(torch.arange(16))[0]).mean(), method.discriminator(fake)
    assert says_real > 1 and says_fake.mean() < -1


def test_a_class_conditional_discriminator_gets_the_datas_own_labels_for_the_real_rows():
    labels = torch.arange(10).repeat(2)
    data = ImageSet(name="t", images=torch.zeros((20, 1, 8, 8), dtype=torch.uint8), labels=labels)
    method = Adversarial(Discriminator(sample_shape=(1, 8, 8), num_classes=10), weight=0.5, lr=1e-3, device="cpu")
    method.data = data
    seen = []
    forward = method.discriminator.forward
    method.discriminator.forward = lambda x, y=None: seen.append(y) or forward(x, y)
    index = torch.tensor([3, 14, 7])
    out = torch.zeros(3, 1, 8, 8, requires_grad=True)
    y = torch.tensor([9, 9, 9])  # the student's rows: the trajectories' classes
    method.loss(out.square().mean() + 1, out=out, x0=out, x_start=out, y=y, draws=(index,))
    assert torch.equal(seen[0], labels[index]) and torch.equal(seen[1], y)  # real rows, then the student's


# ----- the runs ------------------------------------------------------------------------------------------------
def test_an_adversarial_student_of_the_digits_learns_against_the_digits_by_default(tmp_path, teacher):
    result = distill(tmp_path, teacher, "--max_steps", "2", "--sampling_steps", "2")
    assert result.returncode == 0, result.stderr
    assert "GAN term against the digits training images" in result.stdout + result.stderr
    state = torch.load(tmp_path / "student.pt", weights_only=True)
    config = state["distill_config"]
    assert (config["method"], config["adv_real"], config["spacing"]) == ("adversarial", "data", "noise_levels")
    teacher_T = torch.load(teacher, weights_only=True)["schedule_config"]["num_timesteps"]
    assert tuple(state["schedule_config"]["student_timesteps"]) == spaced_timesteps(
        ScheduleConfig(num_timesteps=teacher_T), steps=2, spacing="noise_levels", side=16
    )
    ends = distill(
        tmp_path, teacher, "--max_steps", "2", "--sampling_steps", "2", "--adv_real", "teacher", output="e.pt"
    )
    assert ends.returncode == 0 and "GAN term against the teacher's ODE ends" in ends.stdout + ends.stderr


def test_a_resumed_run_refuses_a_changed_adv_real(tmp_path, teacher, monkeypatch):
    from ddpm.training import distill as method_module

    assert distill(tmp_path, teacher, "--max_steps", "1", "--sampling_steps", "1").returncode == 0
    before = (tmp_path / "student.pt").read_bytes()
    monkeypatch.setattr(method_module, "teacher_trajectories", lambda *a, **k: pytest.fail("trajectories drawn"))
    result = distill(
        tmp_path, teacher, "--max_steps", "2", "--sampling_steps", "1", "--resume", "--adv_real", "teacher"
    )
    assert_user_error(result, "--adv_real teacher (the checkpoint's data)")
    assert (tmp_path / "student.pt").read_bytes() == before


@pytest.fixture(scope="module")
def folder_teacher(tmp_path_factory):
    """(a teacher of your own images, --dataset folder: 8 grey 16x16 PNGs, the folder it was trained on)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("folder_teacher")
    images = root / "images"
    images.mkdir()
    for i in range(8):
        Image.new("L", (16, 16), color=30 * i).save(images / f"{i}.png")
    flags = list(TINY_TRAIN)
    flags[flags.index("digits")] = "folder"
    flags += ["--data_dir", str(images), "--channels", "1", "--batch_size", "4", "--model_path", "f.pt"]
    flags += ["--timesteps", "10"]  # the end-of-run preview costs a step each
    trained = run_here(*flags, cwd=root)
    assert trained.returncode == 0, trained.stderr
    return root / "f.pt", images


def test_a_folder_teachers_discriminator_reads_the_folder_only_when_asked(tmp_path, folder_teacher):
    teacher, images = folder_teacher
    one_call = ("--max_steps", "1", "--sampling_steps", "1")
    default = distill(tmp_path, teacher, *one_call, output="d.pt")
    assert default.returncode == 0 and "the teacher's ODE ends" in default.stdout + default.stderr
    asked = distill(tmp_path, teacher, *one_call, "--adv_real", "data", "--data_dir", str(images), output="a.pt")
    assert asked.returncode == 0 and "the folder training images" in asked.stdout + asked.stderr


def test_data_that_cannot_be_read_is_refused_in_one_line_before_the_trajectories(tmp_path, folder_teacher, monkeypatch):
    from ddpm.training import distill as method_module

    monkeypatch.setattr(method_module, "teacher_trajectories", lambda *a, **k: pytest.fail("trajectories drawn"))
    args = ("--max_steps", "1", "--sampling_steps", "1", "--adv_real", "data", "--data_dir", str(tmp_path / "gone"))
    assert_user_error(distill(tmp_path, folder_teacher[0], *args, output="x.pt"), "use --adv_real teacher")
    assert not (tmp_path / "x.pt").exists()


def test_the_student_may_not_be_written_into_the_data_it_reads(tmp_path, folder_teacher):
    teacher, images = folder_teacher
    listing = sorted(p.name for p in images.iterdir())
    args = ("--max_steps", "1", "--sampling_steps", "1", "--adv_real", "data", "--data_dir", str(images))
    result = distill(tmp_path, teacher, *args, output=str(images / "student.pt"))
    assert_user_error(result, "--output")
    assert sorted(p.name for p in images.iterdir()) == listing


@pytest.mark.parametrize(
    "args,message",
    [
        (["--adv_real", "data"], "--adv_real is read by --mode distill with --distill_method adversarial"),
        (["--sampling_steps", "1", "--adv_real", "real"], "invalid choice: 'real'"),
        (["--data_dir", "d"], "--data_dir is read by --mode distill with --distill_method adversarial"),
    ],
)
def test_a_bad_adv_real_flag_is_refused_in_one_line_before_anything_is_read(tmp_path, args, message):
    result = run_here("--mode", "distill", "--model_path", "missing.pt", *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_the_default_length_is_longer_for_one_and_two_calls_and_a_given_max_steps_wins(steps):
    from ddpm.cli import parser, resolve

    flags = ["--mode", "distill", "--model_path", "t.pt", "--sampling_steps", str(steps)]
    request = resolve.request_for(parser.parse_args(flags))
    assert request.max_steps == DISTILL_MAX_STEPS_BY_STEPS.get(steps, DISTILL_DEFAULTS["max_steps"])
    assert resolve.request_for(parser.parse_args([*flags, "--max_steps", "7"])).max_steps == 7


# ----- issue 67: the discriminator's data, checked against the teacher like a model file ---------------------------
def _image_folder(root, classes: tuple[str, ...] = (), *, per_class: int = 2, shade: int = 0):
    """root: grey 16x16 PNGs, ``per_class`` in each of the sub-folders ``classes`` (none: in root itself)."""
    from PIL import Image

    for i, name in enumerate(classes or ("",)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            Image.new("L", (16, 16), color=shade + 60 * i + 20 * j).save(root / name / f"{j}.png")
    return root


@pytest.fixture(scope="module")
def class_teacher(tmp_path_factory):
    """(a class-conditional teacher of a folder with two classes, a/ and b/, the folder it was trained on)."""
    root = tmp_path_factory.mktemp("class_teacher")
    images = _image_folder(root / "images", ("a", "b"))
    flags = list(TINY_TRAIN)
    flags[flags.index("digits")] = "folder"
    flags += ["--data_dir", str(images), "--channels", "1", "--batch_size", "4", "--class_cond", "--model_path", "c.pt"]
    flags += ["--timesteps", "10"]
    trained = run_here(*flags, cwd=root)
    assert trained.returncode == 0, trained.stderr
    return root / "c.pt", images


@pytest.mark.parametrize(
    "classes,message",
    [
        ((), "its images have no classes (no class folders)"),
        (("a",), "holds fewer classes than the teacher (1: a)"),
        (("a", "b", "c"), "holds more classes than the teacher (3: a, b, c)"),
        (("a", "c"), "holds other classes than the teacher (2: a, c)"),
    ],
    ids=["none", "fewer", "more", "other"],
)
def test_a_class_conditional_teachers_real_images_hold_its_classes_or_are_refused_before_the_trajectories(
    tmp_path, class_teacher, monkeypatch, classes, message
):
    from ddpm.training import distill as method_module

    teacher, _ = class_teacher
    data = _image_folder(tmp_path / "data", classes)
    monkeypatch.setattr(method_module, "teacher_trajectories", lambda *a, **k: pytest.fail("trajectories drawn"))
    args = ("--max_steps", "1", "--sampling_steps", "1", "--adv_real", "data", "--data_dir", str(data))
    result = distill(tmp_path, teacher, *args, output="s.pt")
    assert_user_error(result, message)
    assert "c.pt draws 2 classes (a, b)" in result.stderr
    assert "give the folder of the teacher's classes, or use --adv_real teacher" in result.stderr
    assert not (tmp_path / "s.pt").exists()


def test_a_class_conditional_teacher_learns_against_a_folder_of_its_own_classes(tmp_path, class_teacher):
    teacher, images = class_teacher
    args = ("--max_steps", "1", "--sampling_steps", "1", "--adv_real", "data", "--data_dir", str(images))
    result = distill(tmp_path, teacher, *args)
    assert result.returncode == 0, result.stderr


def test_the_profile_may_not_be_written_into_the_data_it_reads(tmp_path, folder_teacher):
    teacher, images = folder_teacher
    listing = sorted(p.name for p in images.iterdir())
    args = ("--max_steps", "1", "--sampling_steps", "1", "--adv_real", "data", "--data_dir", str(images))
    result = distill(tmp_path, teacher, *args, "--profile", str(images / "trace"))
    assert_user_error(result, f"--profile {images / 'trace'} is inside the folder --data_dir reads")
    assert sorted(p.name for p in images.iterdir()) == listing and not (tmp_path / "student.pt").exists()


def test_a_data_dir_nothing_reads_is_refused(tmp_path, teacher, folder_teacher):
    one_call = ("--max_steps", "1", "--sampling_steps", "1", "--data_dir", str(tmp_path))
    digits = distill(tmp_path, teacher, *one_call)  # the digits come from scikit-learn
    assert_user_error(digits, f"--data_dir {tmp_path}: {teacher}'s training data (digits) is not read from a folder")
    ends = distill(tmp_path, folder_teacher[0], *one_call)  # a folder teacher's default: its ODE ends
    assert_user_error(ends, "(--adv_real teacher) and reads no data; pass --adv_real data to read it")
    assert not (tmp_path / "student.pt").exists()


def test_a_resumed_run_reads_the_data_it_started_with_however_it_is_spelled(tmp_path, folder_teacher, monkeypatch):
    import shutil

    from ddpm.training import distill as method_module

    teacher, images = folder_teacher
    adversarial = ("--sampling_steps", "1", "--adv_real", "data")
    assert distill(tmp_path, teacher, *adversarial, "--max_steps", "1", "--data_dir", str(images)).returncode == 0
    recorded = torch.load(tmp_path / "student.pt", weights_only=True)["distill_config"]
    assert recorded["data_dir"] == str(images) and len(recorded["data_sha256"]) == 64
    other = shutil.copytree(images, tmp_path / "other")
    _image_folder(other, per_class=1, shade=7)  # one image changed
    before = (tmp_path / "student.pt").read_bytes()
    with monkeypatch.context() as patched:
        patched.setattr(method_module, "teacher_trajectories", lambda *a, **k: pytest.fail("trajectories drawn"))
        result = distill(tmp_path, teacher, *adversarial, "--max_steps", "2", "--resume", "--data_dir", str(other))
    assert_user_error(result, f"--data_dir {other} is not the data student.pt learns from")
    assert f"those of --data_dir {images} it started with" in result.stderr
    assert (tmp_path / "student.pt").read_bytes() == before
    copy = shutil.copytree(images, tmp_path / "copy")  # the same images elsewhere: the same data
    resumed = distill(tmp_path, teacher, *adversarial, "--max_steps", "2", "--resume", "--data_dir", str(copy))
    assert resumed.returncode == 0, resumed.stderr
    assert torch.load(tmp_path / "student.pt", weights_only=True)["step"] == 2


def test_a_resumed_runs_refusals_name_its_own_method_not_the_default(tmp_path, teacher, monkeypatch):
    from ddpm.training import distill as method_module

    four = ("--sampling_steps", "4")  # the default method at 4 calls: regression
    assert (
        distill(tmp_path, teacher, *four, "--max_steps", "1", "--distill_method", "dmd", output="d.pt").returncode == 0
    )
    gan = ("--distill_method", "adversarial", "--adv_real", "teacher")
    assert distill(tmp_path, teacher, *four, *gan, "--max_steps", "1", output="a.pt").returncode == 0
    monkeypatch.setattr(method_module, "teacher_trajectories", lambda *a, **k: pytest.fail("trajectories drawn"))
    resume = (*four, "--max_steps", "2", "--resume", "--adv_weight", "0.3")
    assert_user_error(
        distill(tmp_path, teacher, *resume, output="d.pt"),
        "--adv_weight is read by --distill_method adversarial, and d.pt continues a --distill_method dmd run",
    )
    assert_user_error(distill(tmp_path, teacher, *resume, output="a.pt"), "--adv_weight 0.3 (the checkpoint's 0.5)")
