"""--distill_method (training/distill_losses.py): the discriminator on every shape a teacher draws, its step
learning to tell the teacher's ends from the student's x_0 without touching the student, the GAN term's gradient
reaching the student at --adv_weight times the regression's; DMD's gradient against its closed form on Gaussian
data (zero where the fake score is the real one), its fake score learning the student's samples; consistency
distillation's trajectories holding every solver state bit for bit, its target (the next state's x_0 under the
target network, the end at the boundary), its target network the student's EMA, its loss still where the student
is the exact consistency function of Gaussian data; each method distilling a student that samples, resuming
exactly, and refusing a changed method or a bad value in one line."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_DISTILL, TINY_TRAIN, assert_user_error, run_here, tiny_teacher
from helpers import distill_here as distill
from torch import nn

from ddpm.training.distill import (
    MAX_PAIR_BYTES,
    DistillConfig,
    DistillObjective,
    Trajectories,
    recorded_timesteps,
    student_schedule,
    teacher_grid,
    teacher_trajectories,
    trajectory_budget,
)
from ddpm.training.distill_losses import (
    TARGET_EMA,
    Adversarial,
    Consistency,
    Discriminator,
    DistributionMatching,
    matching_gradient,
    unwrapped,
)
from noise_schedule import NoiseSchedule, ScheduleConfig, p_step

METHODS = ("adversarial", "dmd", "consistency")
STATE_KEY = {"adversarial": "discriminator", "dmd": "fake_score", "consistency": "target"}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny digits checkpoint (3 training steps, 10 timesteps: its end-of-run preview costs a step each) as the
    teacher."""
    return tiny_teacher(tmp_path_factory.mktemp("teacher"), "teacher.pt", "--timesteps", "10")


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


# ----- consistency distillation --------------------------------------------------------------------------------
CPU = torch.device("cpu")


def test_the_consistency_trajectories_hold_every_solver_state_bit_for_bit():
    # The Gaussian teacher's exact eps, solved by hand with the same DPM-Solver++ plan: every state the solver
    # visits above t = 0 is recorded, and at the student's timesteps they are the default recording's.
    teacher_schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100))
    teacher = GaussianEps(teacher_schedule, 0.3, 0.5).requires_grad_(False)
    config = DistillConfig(
        teacher="gaussian", sampling_steps=2, samples=5, teacher_steps=8, spacing="even", method="consistency"
    )
    students = student_schedule(teacher_schedule.config, config, side=8).student_timesteps
    grid = teacher_grid(teacher_schedule.config, students, config.teacher_steps)
    record = recorded_timesteps(teacher_schedule.config, student_timesteps=students, config=config)
    assert record == tuple(grid[:-1]) and grid[-1] == 0 and set(students) < set(record)
    solve = dict(config=config, student_timesteps=students, sample_shape=(1, 2, 2), device=CPU, progress=False)
    every = teacher_trajectories(teacher, teacher_schedule, record=record, **solve)
    default = teacher_trajectories(teacher, teacher_schedule, **solve)
    assert every.timesteps == record and default.timesteps == students
    assert every.x_t.shape == (5, len(grid) - 1, 1, 2, 2)
    plan = teacher_schedule.make_plan("dpm_solver", timesteps=grid, clip_denoised=True)
    x, prev = torch.randn((5, 1, 2, 2), generator=torch.Generator().manual_seed(config.seed)), None
    for i in range(plan.num_steps):
        if i < len(record):
            assert torch.equal(every.x_t[:, i], x), grid[i]
        x, prev = p_step(plan, i, x, teacher(x, plan.timesteps[i].expand(5)), prev_xstart=prev)
    assert torch.equal(every.x_start, x) and torch.equal(default.x_start, x)
    for k, t in enumerate(students):
        assert torch.equal(default.x_t[:, k], every.x_t[:, record.index(t)]), t
    with pytest.raises(ValueError, match="points of the teacher's grid"):
        teacher_trajectories(teacher, teacher_schedule, record=(grid[0], grid[1] + 1), **solve)


def test_the_consistency_objective_holds_the_grid_and_its_budget_counts_it(teacher):
    consistency, _, _, artifact = objectives(teacher, "consistency")
    regression, _, _, _ = objectives(teacher, "regression")
    students = regression.trajectories.timesteps
    grid = teacher_grid(artifact.schedule_config, students, 8)
    assert consistency.trajectories.timesteps == tuple(grid[:-1]) and consistency.timesteps.tolist() == grid[:-1]
    assert torch.equal(consistency.trajectories.x_start, regression.trajectories.x_start)
    for k, t in enumerate(students):  # the same ODE, drawn from the same seed
        assert torch.equal(regression.trajectories.x_t[:, k], consistency.trajectories.x_t[:, grid.index(t)])
    budget = dict(
        student_timesteps=students, model_config=artifact.model_config, device=CPU, guided=False, record=grid[:-1]
    )
    schedule = NoiseSchedule(artifact.schedule_config)
    held = trajectory_budget(artifact.model, schedule, config=consistency.config, **budget).held_bytes
    assert held == consistency.trajectories.x_t.nbytes + consistency.trajectories.x_start.nbytes
    per_sample = held // consistency.config.samples
    too_many = replace(consistency.config, samples=MAX_PAIR_BYTES // per_sample + 1)
    with pytest.raises(ValueError, match=rf"would hold .* GiB; use at most {MAX_PAIR_BYTES // per_sample}$"):
        trajectory_budget(artifact.model, schedule, config=too_many, **budget)


class GaussianConsistency(nn.Module):
    """A v-predicting student whose x_0 is the exact consistency function of data N(mu, s^2) (per pixel) under the
    probability-flow ODE: x_0 = mu + s (x_t - sqrt(abar) mu) / sqrt(abar s^2 + 1 - abar), for learnable mu and s."""

    def __init__(self, schedule: NoiseSchedule, mu: float, s: float) -> None:
        super().__init__()
        self.schedule = schedule
        self.mu, self.s = nn.Parameter(torch.tensor(mu)), nn.Parameter(torch.tensor(s))

    def forward(self, x_t, t):
        abar = self.schedule.alphas_cumprod[t].float().view(-1, 1, 1, 1)
        x0 = self.mu + self.s * (x_t - abar.sqrt() * self.mu) / (abar * self.s**2 + 1 - abar).sqrt()
        return (abar.sqrt() * x_t - x0) / (1 - abar).sqrt()  # v: x_0 = sqrt(abar) x_t - sqrt(1 - abar) v


GRID = (99, 80, 49, 20, 5)  # a consistency objective's recorded timesteps (the grid above t = 0)


def consistency_objective(trajectories: Trajectories, student: nn.Module, *, clip: bool = False):
    """A consistency objective of a 100-timestep student on ``trajectories``, its target network a copy of
    ``student`` moved elsewhere first (the first loss call must copy the student)."""
    config = DistillConfig(
        teacher="t", sampling_steps=2, samples=len(trajectories.x_start), teacher_steps=8, method="consistency"
    )
    schedule_config = student_schedule(ScheduleConfig(num_timesteps=100), config, side=8)
    target = copy.deepcopy(student)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(7.0)
    method = Consistency(target, clip=clip)
    return DistillObjective(
        config, trajectories, schedule_config=schedule_config, class_names=(), device=CPU, method=method
    )


def v_target(schedule: NoiseSchedule, x_t, t, x0):
    """The v that maps x_t at t to x0, in float64."""
    abar = schedule.alphas_cumprod[t].double().view(-1, 1, 1, 1)
    return (abar.sqrt() * x_t.double() - x0.double()) / (1 - abar).sqrt()


def test_the_consistency_target_is_the_target_networks_x0_at_the_next_state_and_the_end_at_the_boundary():
    gen = torch.Generator().manual_seed(7)
    trajectories = Trajectories(
        x_t=2 * torch.randn(4, len(GRID), 1, 2, 2, generator=gen),
        x_start=torch.rand(4, 1, 2, 2, generator=gen) * 2 - 1,
        labels=None,
        timesteps=GRID,
    )
    which, step = torch.tensor([0, 1, 2, 3, 0, 1, 2]), torch.tensor([4, 0, 1, 4, 3, 2, 0])
    for clip in (True, False):
        schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100, prediction="v"))
        student = GaussianConsistency(schedule, 0.1, 3.0)  # its x_0 reaches beyond [-1, 1]
        objective = consistency_objective(trajectories, student, clip=clip)
        ends = objective.consistency_ends(student, (which, step), rows=slice(None))
        boundary = step == len(GRID) - 1
        assert torch.equal(ends[boundary], trajectories.x_start[which[boundary]])  # f(x, 0) = x
        following = (step + 1).clamp(max=len(GRID) - 1)  # the next state (the boundary rows: any; not compared)
        x_next, t_next = trajectories.x_t[which, following], torch.tensor(GRID)[following]
        abar = schedule.alphas_cumprod[t_next].double().view(-1, 1, 1, 1)
        exact = 0.1 + 3.0 * (x_next.double() - abar.sqrt() * 0.1) / (abar * 9.0 + 1 - abar).sqrt()
        assert exact.abs().max() > 1.5
        exact = exact.clamp(-1, 1) if clip else exact
        torch.testing.assert_close(ends[~boundary].double(), exact[~boundary], rtol=1e-5, atol=1e-5)
        # The loss: the regression's, with each state's end replaced by that target.
        loss = objective.loss(student, (which, step), rows=slice(None))
        t = torch.tensor(GRID)[step]
        x_t = trajectories.x_t[which, step]
        expected = (student(x_t, t).double() - v_target(schedule, x_t, t, ends)).square().mean()
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
        loss.backward()
        assert all(p.grad is None for p in objective.method.target.parameters())  # no autograd through theta^-
        assert not objective.method.target.training and all(p.grad is not None for p in student.parameters())


class Wrapped(nn.Module):
    """torch.compile's wrapper as the loss sees it: the student under ``_orig_mod``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args):
        return self._orig_mod(*args)


def test_the_target_network_is_the_students_ema_with_mu_095_after_each_step():
    assert TARGET_EMA == 0.95
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100, prediction="v"))
    student = GaussianConsistency(schedule, 0.1, 0.5)
    assert unwrapped(torch.compile(student)) is student and unwrapped(Wrapped(student)) is student
    trajectories = Trajectories(
        x_t=torch.randn(2, len(GRID), 1, 2, 2), x_start=torch.zeros(2, 1, 2, 2), labels=None, timesteps=GRID
    )
    objective = consistency_objective(trajectories, student)
    batch = (torch.tensor([0, 1]), torch.tensor([1, 4]))
    expected = None
    for step in range(3):  # each loss call moves theta^- toward the student of the last optimizer step
        weights = torch.stack([student.mu.detach(), student.s.detach()]).double()
        expected = weights if expected is None else TARGET_EMA * expected + (1 - TARGET_EMA) * weights
        objective.loss(Wrapped(student), batch, rows=slice(None))
        target = objective.method.target
        torch.testing.assert_close(torch.stack([target.mu, target.s]).double(), expected, rtol=1e-6, atol=0)
        if step == 0:
            assert torch.equal(target.mu, student.mu) and torch.equal(target.s, student.s)  # the first call copies
        with torch.no_grad():  # an optimizer step
            student.mu.add_(0.3 * (step + 1))
            student.s.mul_(1.5)
    state = objective.method.state_dict()
    resumed = consistency_objective(trajectories, student)
    resumed.load_state_dict(copy.deepcopy(state))
    objective.loss(student, batch, rows=slice(None))
    resumed.loss(student, batch, rows=slice(None))  # a resumed target moves on from where it was: no copy
    assert torch.equal(resumed.method.target.mu, objective.method.target.mu)
    assert not torch.equal(resumed.method.target.mu, student.mu)


def test_the_consistency_loss_is_still_where_the_student_is_the_exact_consistency_function():
    # Gaussian data N(mu, s^2): the ODE keeps z = (x_0 - mu) / s along each trajectory, so its exact states are
    # x_t = sqrt(abar) mu + sqrt(abar s^2 + 1 - abar) z. A student (and its target) that is the exact consistency
    # function maps every state to the same end: no gradient. Another student is pulled toward it.
    mu, s = 0.3, 0.5
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=100, prediction="v"))
    z = torch.randn(4, 1, 1, 2, 2, generator=torch.Generator().manual_seed(8))
    abar = schedule.alphas_cumprod[torch.tensor(GRID)].view(1, -1, 1, 1, 1)
    trajectories = Trajectories(
        x_t=abar.sqrt() * mu + (abar * s**2 + 1 - abar).sqrt() * z,
        x_start=(mu + s * z)[:, 0],
        labels=None,
        timesteps=GRID,
    )
    batch = (torch.arange(4).repeat_interleave(len(GRID)), torch.arange(len(GRID)).repeat(4))  # every state once

    def gradient(student_mu: float, student_s: float) -> torch.Tensor:
        student = GaussianConsistency(schedule, student_mu, student_s)
        loss = consistency_objective(trajectories, student).loss(student, batch, rows=slice(None))
        return torch.stack(torch.autograd.grad(loss, [student.mu, student.s]))

    assert gradient(mu, s).abs().max() < 1e-4
    for other in ((0.0, s), (mu, 0.8), (0.5, 0.3)):
        assert gradient(*other).abs().max() > 1e-2, other


# ----- the runs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_each_method_distills_a_student_that_samples_as_a_normal_model_file(tmp_path, teacher, method):
    result = distill(tmp_path, teacher, "--max_steps", "2", "--distill_method", method)
    assert result.returncode == 0, result.stderr
    words = {"adversarial": "GAN term", "dmd": "distribution matching", "consistency": "consistency distillation"}
    assert words[method] in result.stdout + result.stderr
    state = torch.load(tmp_path / "student.pt", weights_only=True)
    assert state["distill_config"]["method"] == method and list(state["objective_state"]) == [STATE_KEY[method]]
    drawn = run_here("--mode", "sample", "--model_path", "student.pt", "--n_samples", "2", cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert "consistency, 4 steps" in drawn.stdout


def test_each_method_distills_a_class_conditional_teacher(tmp_path):
    trained = run_here(*TINY_TRAIN, "--timesteps", "10", "--class_cond", "--model_path", "cond.pt", cwd=tmp_path)
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
        (["--distill_method", "consistency", "--adv_weight", "2"], "--adv_weight is read by --mode distill with"),
    ],
)
def test_a_bad_method_flag_is_refused_in_one_line_before_anything_is_read(tmp_path, args, message):
    result = run_here("--mode", "distill", "--model_path", "missing.pt", *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
