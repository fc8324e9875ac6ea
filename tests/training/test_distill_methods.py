"""--distill_method (training/distill_losses.py): the discriminator on every shape a teacher draws, its step
learning to tell the teacher's ends from the student's x_0 without touching the student, the GAN term's gradient
reaching the student at --adv_weight times the regression's; DMD's gradient against its closed form on Gaussian
data (zero where the fake score is the real one), its fake score learning the student's samples; each method
distilling a student that samples, resuming exactly, and refusing a changed method or a bad value in one line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_DISTILL, TINY_TRAIN, assert_user_error, run_here, tiny_teacher
from torch import nn

from ddpm.training.distill import DistillConfig, DistillObjective
from ddpm.training.distill_losses import (
    Adversarial,
    Discriminator,
    DistributionMatching,
    matching_gradient,
)
from noise_schedule import NoiseSchedule, ScheduleConfig

METHODS = ("adversarial", "dmd")
STATE_KEY = {"adversarial": "discriminator", "dmd": "fake_score"}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny digits checkpoint (3 training steps, 50 timesteps) as the teacher."""
    return tiny_teacher(tmp_path_factory.mktemp("teacher"), "teacher.pt")


def distill(folder, teacher, *args: str, output: str = "student.pt"):
    return run_here(
        "--mode", "distill", "--model_path", str(teacher), "--output", output, *TINY_DISTILL, *args, cwd=folder
    )


# ----- the discriminator ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,classes",
    [((1, 8, 8), 0), ((1, 28, 28), 10), ((3, 28, 28), 0), ((3, 32, 32), 10), ((4, 7, 7), 0), ((1, 8, 8, 8), 0)],
)
def test_the_discriminator_gives_one_logit_a_sample_for_every_shape_a_teacher_draws(shape, classes):
    discriminator = Discriminator(sample_shape=shape, num_classes=classes)
    x = torch.randn(3, *shape)
    y = torch.tensor([0, 1, 2]) if classes else None
    logits = discriminator(x, y)
    assert logits.shape == (3,) and logits.isfinite().all()
    if classes:  # the label changes the logit (projection), and only the label
        assert not torch.allclose(logits, discriminator(x, torch.tensor([2, 0, 1])))
    assert sum(p.numel() for p in discriminator.parameters()) < 0.5e6


def adversarial(weight: float = 0.5, *, lr: float = 1e-3) -> Adversarial:
    torch.manual_seed(0)
    return Adversarial(Discriminator(sample_shape=(1, 8, 8)), weight=weight, lr=lr, device="cpu")


def test_the_discriminators_step_learns_the_teachers_ends_from_the_students_and_leaves_the_student_alone():
    method = adversarial()
    gen = torch.Generator().manual_seed(1)
    real = 0.5 + 0.1 * torch.randn(16, 1, 8, 8, generator=gen)
    fake = -0.5 + 0.1 * torch.randn(16, 1, 8, 8, generator=gen)
    with torch.no_grad():
        before = method.discriminator_loss(real, fake, None).item()
    for _ in range(30):
        out = fake.clone().requires_grad_(True)  # the student's output (x_0 itself here)
        method.loss(out.square().mean(), out=out, x0=out, x_start=real, y=None, draws=())
        assert out.grad is None  # the discriminator's step took no gradient through the student
    with torch.no_grad():
        after = method.discriminator_loss(real, fake, None).item()
        says_real, says_fake = method.discriminator(real).mean(), method.discriminator(fake).mean()
    assert after < 0.5 * before and says_real > 1 and says_fake < -1  # a logit above 0: "a teacher's image"


def test_the_gan_terms_gradient_reaches_the_student_at_adv_weight_times_the_regressions():
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=50, prediction="v"))
    gen = torch.Generator().manual_seed(2)
    x_t, target = torch.randn(6, 1, 8, 8, generator=gen), torch.randn(6, 1, 8, 8, generator=gen)
    t = torch.tensor([49, 30, 10, 49, 30, 10])
    for weight in (0.5, 2.0):
        method = adversarial(weight)
        out = torch.randn(6, 1, 8, 8, generator=gen).requires_grad_(True)  # the student's v
        x0 = schedule.predict_xstart(x_t, t, out)
        regression = F.mse_loss(out, target)
        total = method.loss(regression, out=out, x0=x0, x_start=torch.rand(6, 1, 8, 8, generator=gen), y=None, draws=())
        (g_total,) = torch.autograd.grad(total, out, retain_graph=True)
        (g_regression,) = torch.autograd.grad(regression, out, retain_graph=True)
        g_gan = g_total - g_regression
        assert g_gan.norm() > 0
        torch.testing.assert_close(g_gan.norm(), weight * g_regression.norm(), rtol=1e-4, atol=0)
        total.backward()
        assert all(p.grad is None for p in method.discriminator.parameters())  # the student's term trains no D


# ----- distribution matching -----------------------------------------------------------------------------------
class GaussianEps(nn.Module):
    """The exact eps of data N(mu, s^2) (per pixel) under ``schedule``, with a learnable mean."""

    def __init__(self, schedule: NoiseSchedule, mu: float, s: float) -> None:
        super().__init__()
        self.schedule, self.s = schedule, s
        self.mu = nn.Parameter(torch.tensor(mu))

    def forward(self, x_t, t):
        abar = self.schedule.alphas_cumprod[t].float().view(-1, 1, 1, 1)
        return (1 - abar).sqrt() * (x_t - abar.sqrt() * self.mu) / (abar * self.s**2 + 1 - abar)


def gaussian_method(schedule, *, real_mu: float, fake_mu: float, s: float = 0.5, lr: float = 0.02):
    real = GaussianEps(schedule, real_mu, s).requires_grad_(False)
    return DistributionMatching(
        real,
        GaussianEps(schedule, fake_mu, s),
        schedule,
        sample_shape=(1, 2, 2),
        weight=1.0,
        guidance_scale=0.0,
        null_label=0,
        lr=lr,
        fp16=False,
        device="cpu",
    )


def test_the_matching_gradient_is_its_closed_form_on_gaussian_data_and_zero_where_the_scores_agree():
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100))
    gen = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(8, 1, 2, 2, generator=gen), torch.randn(8, 1, 2, 2, generator=gen)
    t = torch.tensor([2, 10, 30, 50, 70, 90, 97, 60])
    s, real_mu, fake_mu = 0.5, 0.3, -0.2
    grad = gaussian_method(schedule, real_mu=real_mu, fake_mu=fake_mu, s=s).gradient(x0, t=t, noise=noise, y=None)
    # Tweedie's x_0 of N(mu, s^2) data: mu + s^2 sqrt(abar) (x_t - sqrt(abar) mu) / (abar s^2 + 1 - abar).
    abar = schedule.alphas_cumprod[t].double().view(-1, 1, 1, 1)
    x_t = abar.sqrt() * x0.double() + (1 - abar).sqrt() * noise.double()

    def denoised(mu):
        return mu + s**2 * abar.sqrt() * (x_t - abar.sqrt() * mu) / (abar * s**2 + 1 - abar)

    scale = (x0.double() - denoised(real_mu)).abs().mean(dim=(1, 2, 3), keepdim=True)
    torch.testing.assert_close(grad.double(), (denoised(fake_mu) - denoised(real_mu)) / scale, rtol=1e-4, atol=1e-6)
    assert ((-grad) * (real_mu - fake_mu) > 0).all()  # descending it moves every x_0 toward the real mean
    same = gaussian_method(schedule, real_mu=real_mu, fake_mu=real_mu).gradient(x0, t=t, noise=noise, y=None)
    assert torch.equal(same, torch.zeros_like(same))
    assert torch.equal(matching_gradient(x0, real=x0 + 1, fake=x0 + 1), torch.zeros_like(x0))


def test_the_students_dmd_term_descends_the_matching_gradient_then_the_fake_score_steps():
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100))
    method = gaussian_method(schedule, real_mu=0.3, fake_mu=-0.2)
    method.weight = 2.0
    gen = torch.Generator().manual_seed(6)
    x0 = torch.randn(4, 1, 2, 2, generator=gen).requires_grad_(True)  # the student's x_0
    draws = method.draw(4, generator=gen, device=torch.device("cpu"))
    expected = method.gradient(x0.detach(), t=draws[0], noise=draws[1], y=None)  # with the fake score before its step
    total = method.loss(torch.zeros(()), out=None, x0=x0, x_start=None, y=None, draws=draws)
    (g,) = torch.autograd.grad(total, x0)
    torch.testing.assert_close(g, 2.0 * expected / x0.numel())  # 0.5 |x_0 - (x_0 - grad)|^2, averaged: grad
    assert method.fake.mu.item() != pytest.approx(-0.2)  # then the fake score took its step


def test_the_fake_score_learns_the_students_samples():
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100))
    method = gaussian_method(schedule, real_mu=0.3, fake_mu=-0.2, lr=0.02)
    samples = torch.full((64, 1, 2, 2), 0.7)  # the student draws 0.7 everywhere: the denoising loss's best mean
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        _, _, t, noise = method.draw(64, generator=gen, device=torch.device("cpu"))
        method.step(method.fake_loss(samples, t=t, noise=noise, y=None))
    assert abs(method.fake.mu.item() - 0.7) < 0.05
    assert method.real.mu.item() == pytest.approx(0.3)  # the teacher is only read


def objectives(teacher, method: str):
    """(the method's objective, the regression's on the same trajectories, a student: the teacher's U-Net, without
    dropout)."""
    from ddpm.backends.artifacts import load_artifact

    artifact = load_artifact(teacher, device=torch.device("cpu"))
    config = DistillConfig(teacher=str(teacher), sampling_steps=2, samples=8, teacher_steps=8, method=method)
    objective = DistillObjective.build(artifact, config, device=torch.device("cpu"), clip_denoised=True, progress=False)
    regression = DistillObjective(
        config,
        objective.trajectories,
        schedule_config=objective.schedule_config,
        class_names=(),
        device=torch.device("cpu"),
    )
    return objective, regression, copy.deepcopy(artifact.model).eval().requires_grad_(True), artifact


def test_dmd_starts_as_the_regression_and_its_fake_score_moves_off_the_teacher(teacher):
    objective, regression, student, artifact = objectives(teacher, "dmd")
    batch = objective.batch(8, generator=torch.Generator().manual_seed(5), device=torch.device("cpu"))
    first = objective.loss(student, batch, rows=slice(None))  # the fake score is the teacher: no matching gradient
    assert torch.equal(first, regression.loss(student, batch[:2], rows=slice(None)))
    fake = objective.method.fake.state_dict()
    assert any(not torch.equal(fake[k], v) for k, v in artifact.model.state_dict().items())  # stepped once
    second = objective.loss(student, batch, rows=slice(None))
    assert second > regression.loss(student, batch[:2], rows=slice(None))  # now they differ: a term, a gradient
    second.backward()
    assert all(p.grad is not None for p in student.parameters())


# ----- the runs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_each_method_distills_a_student_that_samples_as_a_normal_model_file(tmp_path, teacher, method):
    result = distill(tmp_path, teacher, "--max_steps", "2", "--distill_method", method)
    assert result.returncode == 0, result.stderr
    assert {"adversarial": "GAN term", "dmd": "distribution matching"}[method] in result.stdout + result.stderr
    state = torch.load(tmp_path / "student.pt", weights_only=True)
    assert state["distill_config"]["method"] == method and list(state["objective_state"]) == [STATE_KEY[method]]
    drawn = run_here("--mode", "sample", "--model_path", "student.pt", "--n_samples", "2", cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert "consistency, 4 steps" in drawn.stdout


def test_each_method_distills_a_class_conditional_teacher(tmp_path):
    trained = run_here(*TINY_TRAIN, "--timesteps", "20", "--class_cond", "--model_path", "cond.pt", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    for method in METHODS:  # the discriminator's projection; DMD's real score guided at 2.5
        result = distill(
            tmp_path, "cond.pt", "--max_steps", "2", "--guidance_scale", "2.5", "--sampling_steps", "2",
            "--distill_method", method, output=f"{method}.pt",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("method", METHODS)
def test_resume_continues_each_method_exactly(tmp_path, teacher, method):
    """The method's network, its optimizer and its draws are the checkpoint's: a run stopped after 2 steps and
    resumed ends where the run of 4 steps does, bit for bit on the CPU, its network too."""
    from ddpm.cli import parser, resolve
    from ddpm.modes.distill import new_student

    flags = ["--mode", "distill", "--model_path", str(teacher), *TINY_DISTILL, "--distill_method", method]
    assert run_here(*flags, "--output", "whole.pt", "--max_steps", "4", cwd=tmp_path).returncode == 0
    half = ["--output", str(tmp_path / "half.pt")]
    trainer, _ = new_student(resolve.request_for(parser.parse_args([*flags, *half, "--max_steps", "4"])))
    trainer.run(until_step=2, progress=False)
    trainer.save()
    resumed = run_here(*flags, *half, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    whole, half = (torch.load(tmp_path / name, weights_only=True) for name in ("whole.pt", "half.pt"))
    assert half["step"] == whole["step"] == 4
    network = STATE_KEY[method]
    parts = {
        "model": (whole["model"], half["model"]),
        "ema": (whole["ema"], half["ema"]),
        network: (whole["objective_state"][network]["network"], half["objective_state"][network]["network"]),
    }
    for part, (a, b) in parts.items():
        for key, value in a.items():
            assert torch.equal(b[key], value), (part, key)


def test_a_resumed_distillation_refuses_a_changed_method_or_weight(tmp_path, teacher, monkeypatch):
    from ddpm.training import distill as method_module

    flags = ["--mode", "distill", "--model_path", str(teacher), *TINY_DISTILL]
    assert run_here(*flags, "--output", "r.pt", "--max_steps", "1", cwd=tmp_path).returncode == 0
    adversarial = run_here(
        *flags, "--output", "a.pt", "--max_steps", "1", "--distill_method", "adversarial", cwd=tmp_path
    )
    assert adversarial.returncode == 0, adversarial.stderr
    before = {name: (tmp_path / name).read_bytes() for name in ("r.pt", "a.pt")}
    monkeypatch.setattr(method_module, "teacher_trajectories", lambda *a, **k: pytest.fail("trajectories drawn"))
    for output, args, line in (
        ("r.pt", ["--distill_method", "dmd"], "--distill_method dmd (the checkpoint's regression)"),
        ("a.pt", ["--distill_method", "regression"], "--distill_method regression (the checkpoint's adversarial)"),
        ("a.pt", ["--distill_method", "adversarial", "--adv_weight", "0.25"], "--adv_weight 0.25 (the checkpoint's"),
    ):
        result = run_here(*flags, "--output", output, "--max_steps", "2", "--resume", *args, cwd=tmp_path)
        assert_user_error(result, line)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_an_old_students_config_reads_as_the_regression_and_a_damaged_method_is_refused():
    old = dict(teacher="t.pt", sampling_steps=4, samples=8, teacher_steps=8, guidance_scale=0.0, seed=0)
    config = DistillConfig.from_dict(old)  # written before --distill_method (and before the teacher's hash)
    assert (config.method, config.teacher_sha256) == ("regression", "")
    with pytest.raises(ValueError, match="distillation settings are damaged .*--distill_method must be one of"):
        DistillConfig.from_dict({**old, "method": "gan"})
    with pytest.raises(ValueError, match="--dmd_weight must be above 0"):
        DistillConfig.from_dict({**old, "method": "dmd", "dmd_weight": -1.0})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--distill_method", "gan"], "invalid choice: 'gan'"),
        (["--distill_method", "adversarial", "--adv_weight", "0"], "--adv_weight must be above 0 and at most 100"),
        (["--distill_method", "dmd", "--dmd_weight", "nan"], "--dmd_weight"),
        (["--distill_method", "dmd", "--dmd_weight", "1000"], "--dmd_weight must be above 0 and at most 100"),
        (["--adv_weight", "0.3"], "--adv_weight is read by --mode distill with --distill_method adversarial"),
        (["--distill_method", "adversarial", "--dmd_weight", "2"], "--dmd_weight is read by --mode distill with"),
    ],
)
def test_a_bad_method_flag_is_refused_in_one_line_before_anything_is_read(tmp_path, args, message):
    result = run_here("--mode", "distill", "--model_path", "missing.pt", *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
