"""The schedule module against closed forms: schedules, q(x_t | x_0), the posterior, and the samplers."""

import math

import pytest
import torch

from basic_diffusion import sample
from noise_schedule import (
    COEFFICIENT_NAMES,
    SAMPLERS,
    NoiseSchedule,
    ScheduleConfig,
    _ddim_coefficients,
    make_betas,
    p_step,
    sampling_timesteps,
    xstart_coefficients,
)

F64 = torch.float64


@pytest.fixture(params=["linear", "cosine"])
def schedule(request):
    return NoiseSchedule(ScheduleConfig(kind=request.param))


def alphas_cumprod64(schedule):
    return torch.cumprod(1.0 - make_betas(schedule.config), 0)


def test_alphas_cumprod_is_decreasing_in_unit_interval(schedule):
    ac = schedule.alphas_cumprod
    assert torch.all(ac > 0) and torch.all(ac <= 1)
    assert torch.all(ac[1:] < ac[:-1])
    assert torch.all(schedule.betas > 0) and torch.all(schedule.betas <= 0.999)


def test_linear_schedule_endpoints():
    betas = make_betas(ScheduleConfig(kind="linear"))
    assert betas[0].item() == pytest.approx(1e-4) and betas[-1].item() == pytest.approx(0.02)
    # Other T keep alpha-bar_T near zero by scaling the endpoints by 1000 / T.
    short = NoiseSchedule(ScheduleConfig(num_timesteps=100))
    assert short.alphas_cumprod[-1] < 1e-3


def test_cosine_schedule_matches_closed_form():
    T, s = 1000, 0.008
    ac = alphas_cumprod64(NoiseSchedule(ScheduleConfig(kind="cosine")))
    f = lambda t: math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
    for t in (0, 10, 500, 900):  # far from the beta clip at 0.999
        assert ac[t].item() == pytest.approx(f(t + 1) / f(0), rel=1e-9)


def test_q_sample_is_the_closed_form_gaussian(schedule):
    x_start = torch.full((200_000,), 0.7)
    gen = torch.Generator().manual_seed(0)
    for t_val in (0, 250, 999):
        t = torch.full((200_000,), t_val)
        # Exact: the noise enters linearly.
        assert torch.allclose(
            schedule.q_sample(x_start, t, torch.zeros_like(x_start)), schedule.sqrt_alphas_cumprod[t] * 0.7
        )
        # Statistical: mean sqrt(abar) x0, variance 1 - abar.
        x_t = schedule.q_sample(x_start, t, torch.randn(x_start.shape, generator=gen))
        abar = schedule.alphas_cumprod[t_val].item()
        assert x_t.mean().item() == pytest.approx(math.sqrt(abar) * 0.7, abs=0.01)
        assert x_t.var().item() == pytest.approx(1 - abar, abs=0.01 * max(1 - abar, 1e-2))


def test_posterior_variance_is_gaussian_conditioning(schedule):
    # q(x_{t-1} | x_0) = N(., 1 - abar_{t-1}) and q(x_t | x_{t-1}) = N(sqrt(alpha_t) x_{t-1}, beta_t):
    # the posterior precision is 1 / (1 - abar_{t-1}) + alpha_t / beta_t.
    betas = make_betas(schedule.config)
    ac = torch.cumprod(1 - betas, 0)
    t = torch.arange(1, schedule.num_timesteps)
    expected = 1.0 / (1.0 / (1 - ac[t - 1]) + (1 - betas[t]) / betas[t])
    assert torch.allclose(schedule.posterior_variance[t].double(), expected, rtol=1e-5)
    assert schedule.posterior_variance[0] == 0


def test_posterior_mean_identity(schedule):
    # With x_0 predicted from eps, the posterior mean is DDPM's eq. 11: (x_t - beta_t / sqrt(1 - abar_t) eps) /
    # sqrt(alpha_t).
    gen = torch.Generator().manual_seed(1)
    x_t, eps = torch.randn(8, 1, 4, 4, generator=gen), torch.randn(8, 1, 4, 4, generator=gen)
    t = torch.tensor([1, 5, 50, 200, 500, 800, 990, 999])
    x_start = schedule.predict_xstart(x_t, t, eps)
    coef1, coef2 = (c[t].view(-1, 1, 1, 1) for c in (schedule.posterior_mean_coef1, schedule.posterior_mean_coef2))
    mean = coef1 * x_start + coef2 * x_t  # the mean of q(x_{t-1} | x_t, x_0)
    beta = schedule.betas[t].view(-1, 1, 1, 1)
    expected = (x_t - beta / schedule.sqrt_one_minus_alphas_cumprod[t].view(-1, 1, 1, 1) * eps) / (1 - beta).sqrt()
    assert torch.allclose(mean, expected, atol=1e-4, rtol=1e-4)


def test_eps_and_xstart_predictions_invert_each_other(schedule):
    gen = torch.Generator().manual_seed(2)
    x_t, eps = torch.randn(4, 3, 2, 2, generator=gen), torch.randn(4, 3, 2, 2, generator=gen)
    t = torch.tensor([3, 100, 600, 900])
    x0 = schedule.predict_xstart(x_t, t, eps)
    assert torch.allclose(schedule.predict_eps_from_xstart(x_t, t, x0), eps, atol=1e-4)


@pytest.mark.parametrize("spacing", ["uniform", "logsnr"])
@pytest.mark.parametrize("T", [2, 10, 1000])
def test_respacing_endpoints(T, spacing):
    ac = torch.cumprod(1 - make_betas(ScheduleConfig(num_timesteps=T)), 0)
    for S in sorted({1, 2, 3, 10, 20, 50, T // 3 or 1, T - 1, T} & set(range(1, T + 1))):
        ts = sampling_timesteps(T, S, spacing=spacing, alphas_cumprod=ac)
        assert len(ts) == S and ts[0] == T - 1
        assert torch.all(ts[1:] < ts[:-1]), f"timesteps not distinct for T={T}, S={S}"
        if S >= 2:
            assert ts[-1] == 0
    assert torch.equal(sampling_timesteps(T, T, spacing=spacing, alphas_cumprod=ac), torch.arange(T - 1, -1, -1))
    for bad in (0, T + 1):
        with pytest.raises(ValueError, match="sampling steps"):
            sampling_timesteps(T, bad)


def test_logsnr_spacing_is_even_in_log_snr():
    ac = torch.cumprod(1 - make_betas(ScheduleConfig()), 0)
    lam = 0.5 * torch.log(ac / (1 - ac))
    steps = lam[sampling_timesteps(1000, 10, spacing="logsnr", alphas_cumprod=ac)].diff()
    assert steps.std() / steps.mean() < 0.05


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_last_step_returns_predicted_xstart(schedule, sampler):
    plan = schedule.make_plan(sampler, sampling_steps=10)
    last = dict(zip(COEFFICIENT_NAMES, plan.coefficients[-1].tolist()))
    assert (last["c_xt"], last["c_x0"], last["c_prev"], last["sigma"]) == (0.0, 1.0, 0.0, 0.0)
    assert plan.noise_steps[-1] is False


def test_full_ddpm_plan_is_the_posterior(schedule):
    plan = schedule.make_plan("ddpm")
    t = plan.timesteps
    assert torch.allclose(plan.column("c_x0"), schedule.posterior_mean_coef1[t], rtol=1e-5, atol=1e-7)
    assert torch.allclose(plan.column("c_xt"), schedule.posterior_mean_coef2[t], rtol=1e-5, atol=1e-7)
    assert torch.allclose(plan.column("sigma") ** 2, schedule.posterior_variance[t], rtol=1e-4, atol=1e-9)
    assert plan.noise_steps == (True,) * (len(t) - 1) + (False,)


@pytest.mark.parametrize("num_steps", [10, 37, 1000])
def test_ddim_eta1_equals_ddpm_posterior(schedule, num_steps):
    ddpm = schedule.make_plan("ddpm", sampling_steps=num_steps)
    ddim = schedule.make_plan("ddim", sampling_steps=num_steps, eta=1.0)
    for name in ("c_x0", "c_xt", "sigma"):
        assert torch.allclose(ddim.column(name), ddpm.column(name), rtol=1e-4, atol=1e-6), name


def test_ddim_step_matches_the_paper_form(schedule):
    # Song et al. eq. 12 in float64, with eps re-derived from the clipped x0.
    ac = alphas_cumprod64(schedule)
    eta = 0.5
    plan = schedule.make_plan("ddim", sampling_steps=20, eta=eta)
    gen = torch.Generator().manual_seed(3)
    x_t, eps, z = (torch.randn(2, 1, 8, 8, generator=gen, dtype=F64) for _ in range(3))
    for i in (0, 7, 18, 19):
        t = plan.timesteps[i]
        a_t, a_prev = ac[t], (ac[plan.timesteps[i + 1]] if i + 1 < plan.num_steps else torch.tensor(1.0, dtype=F64))
        x0 = ((x_t - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-1, 1)
        eps_hat = (x_t - a_t.sqrt() * x0) / (1 - a_t).sqrt()
        sigma = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt()
        expected = a_prev.sqrt() * x0 + (1 - a_prev - sigma**2).sqrt() * eps_hat + sigma * z
        got, _ = p_step(plan, i, x_t.float(), eps.float(), noise=z.float())
        assert torch.allclose(got.double(), expected, atol=2e-4), i


def test_dpm_solver_first_order_step_is_ddim(schedule):
    # DPM-Solver++ of order 1 is DDIM (Lu et al. 2022): compare on the same pair of timesteps.
    dpm = schedule.make_plan("dpm_solver", sampling_steps=20)
    ddim = _ddim_coefficients(alphas_cumprod64(schedule), dpm.timesteps, 0.0)
    ddim.update(xstart_coefficients(alphas_cumprod64(schedule)[dpm.timesteps], "eps"))
    ddim_first = torch.tensor([ddim[name][0].item() for name in COEFFICIENT_NAMES])
    assert torch.allclose(dpm.coefficients[0], ddim_first.float(), rtol=1e-5)


def test_dpm_solver_second_order_matches_the_paper_form(schedule):
    # Lu et al. 2022, Algorithm 2 (DPM-Solver++(2M)), written with lambda = log(alpha / sigma).
    ac = alphas_cumprod64(schedule)
    plan = schedule.make_plan("dpm_solver", sampling_steps=20)
    ts = plan.timesteps
    lam = lambda t: 0.5 * torch.log(ac[t] / (1 - ac[t]))  # noqa: E731
    gen = torch.Generator().manual_seed(4)
    x_t, x0, x0_prev = (torch.randn(3, 1, 4, 4, generator=gen, dtype=F64) for _ in range(3))
    for i in (1, 5, 17):
        t, s, t_last = ts[i], ts[i + 1], ts[i - 1]
        h, h_last = lam(s) - lam(t), lam(t) - lam(t_last)
        r = h_last / h
        D = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
        expected = ((1 - ac[s]) / (1 - ac[t])).sqrt() * x_t - ac[s].sqrt() * torch.expm1(-h) * D
        c = dict(zip(COEFFICIENT_NAMES, plan.coefficients[i].double()))
        got = c["c_xt"] * x_t + c["c_x0"] * x0 + c["c_prev"] * x0_prev
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), i


def test_sde_dpm_solver_first_order_step_is_the_ddpm_posterior(schedule):
    # SDE-DPM-Solver++ of order 1 between two timesteps is the posterior q(x_s | x_t, x0) (DDIM with eta = 1).
    sde = schedule.make_plan("dpm_solver_sde", sampling_steps=20)
    ddim = _ddim_coefficients(alphas_cumprod64(schedule), sde.timesteps, 1.0)
    ddim.update(xstart_coefficients(alphas_cumprod64(schedule)[sde.timesteps], "eps"))
    ddim_first = torch.tensor([ddim[name][0].item() for name in COEFFICIENT_NAMES])
    assert torch.allclose(sde.coefficients[0], ddim_first.float(), rtol=1e-5)
    assert sde.noise_steps == (True,) * 19 + (False,)


def test_sde_dpm_solver_second_order_matches_the_paper_form(schedule):
    # SDE-DPM-Solver++(2M) (Lu et al. 2022; diffusers' "sde-dpmsolver++", midpoint form) in float64:
    #   x_s = (sigma_s / sigma_t) e^-h x_t + alpha_s (1 - e^-2h) D + sigma_s sqrt(1 - e^-2h) z.
    ac = alphas_cumprod64(schedule)
    plan = schedule.make_plan("dpm_solver_sde", sampling_steps=20)
    ts = plan.timesteps
    lam = lambda t: 0.5 * torch.log(ac[t] / (1 - ac[t]))  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    x_t, x0, x0_prev, z = (torch.randn(3, 1, 4, 4, generator=gen, dtype=F64) for _ in range(4))
    for i in (1, 5, 17):
        t, s, t_last = ts[i], ts[i + 1], ts[i - 1]
        h, h_last = lam(s) - lam(t), lam(t) - lam(t_last)
        r = h_last / h
        D = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
        alpha_s, sigma_s, sigma_t = ac[s].sqrt(), (1 - ac[s]).sqrt(), (1 - ac[t]).sqrt()
        expected = sigma_s / sigma_t * torch.exp(-h) * x_t + alpha_s * (1 - torch.exp(-2 * h)) * D
        expected = expected + sigma_s * (1 - torch.exp(-2 * h)).sqrt() * z
        c = dict(zip(COEFFICIENT_NAMES, plan.coefficients[i].double()))
        got = c["c_xt"] * x_t + c["c_x0"] * x0 + c["c_prev"] * x0_prev + c["sigma"] * z
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), i


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("num_steps", [5, 50])
def test_samplers_recover_a_point_mass(schedule, sampler, num_steps):
    # For data that is a single image x*, the optimal eps model is (x_t - sqrt(abar) x*) / sqrt(1 - abar);
    # every sampler must land exactly on x*.
    x_star = torch.linspace(-0.9, 0.9, 64).view(1, 1, 8, 8)

    def perfect_model(x, t):
        n = x.ndim
        return (
            x - schedule.sqrt_alphas_cumprod[t].view(-1, *[1] * (n - 1)) * x_star
        ) / schedule.sqrt_one_minus_alphas_cumprod[t].view(-1, *[1] * (n - 1))

    plan = schedule.make_plan(sampler, sampling_steps=num_steps, clip_denoised=False)
    out = sample(perfect_model, plan, shape=(4, 1, 8, 8), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out, x_star.expand_as(out), atol=1e-3)


# Tolerances on the std are the samplers' discretization error at these step counts (measured, and
# shrinking with more steps); a wrong coefficient anywhere moves the std by far more.
@pytest.mark.parametrize(
    "sampler,num_steps,std_tol",
    [
        ("ddpm", 1000, 0.03),
        ("ddpm", 250, 0.08),
        ("ddim", 200, 0.04),
        ("ddim", 1000, 0.01),
        ("dpm_solver", 10, 0.03),
        ("dpm_solver", 20, 0.03),
        ("dpm_solver_sde", 20, 0.03),
        ("dpm_solver_sde", 50, 0.01),
    ],
)
def test_samplers_draw_the_right_gaussian(sampler, num_steps, std_tol):
    # Data N(mu, s^2) per pixel has the analytic optimal denoiser; the samples must have mean mu and std s.
    schedule = NoiseSchedule()
    mu, s = 0.3, 0.2

    def optimal_model(x, t):
        abar = schedule.alphas_cumprod[t].view(-1, 1, 1, 1)
        return (1 - abar).sqrt() * (x - abar.sqrt() * mu) / (abar * s**2 + 1 - abar)

    plan = schedule.make_plan(sampler, sampling_steps=num_steps, clip_denoised=False)
    out = sample(optimal_model, plan, shape=(16, 1, 32, 32), generator=torch.Generator().manual_seed(0))
    assert out.mean().item() == pytest.approx(mu, abs=0.01)
    assert out.std().item() == pytest.approx(s, rel=std_tol)


def test_ddim_eta0_is_deterministic():
    schedule = NoiseSchedule()
    plan = schedule.make_plan("ddim", sampling_steps=10, eta=0.0)
    assert not any(plan.noise_steps)
    gen = torch.Generator().manual_seed(5)
    x_t, eps = torch.randn(2, 1, 4, 4, generator=gen), torch.randn(2, 1, 4, 4, generator=gen)
    # Noise given to a deterministic step is multiplied by sigma = 0.
    a, _ = p_step(plan, 3, x_t, eps)
    b, _ = p_step(plan, 3, x_t, eps, noise=torch.randn(2, 1, 4, 4, generator=gen))
    assert torch.equal(a, b)


def test_clipping_keeps_predicted_xstart_in_range():
    plan = NoiseSchedule().make_plan("ddpm", sampling_steps=10, clip_denoised=True)
    x_t = torch.randn(1, 1, 16, 16) * 5
    _, x0 = p_step(plan, 2, x_t, -x_t)
    assert x0.abs().max() <= 1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sampler="euler"), "unknown sampler"),
        (dict(sampler="ddim", eta=-1.0), "eta"),
        (dict(sampler="ddpm", eta=0.5), "eta only applies"),
        (dict(sampler="ddpm", variance_type="learned"), "variance type"),
        (dict(sampler="ddim", sampling_steps=1001), "sampling steps must be between 1 and 1000"),
        (dict(sampler="ddpm", sampling_steps=0), "sampling steps must be between 1 and 1000"),
        (dict(sampler="consistency", sampling_steps=-2), "sampling steps must be between 1 and 1000"),
    ],
)
def test_bad_plans_raise_value_errors(kwargs, match):
    sampler = kwargs.pop("sampler")
    with pytest.raises(ValueError, match=match):
        NoiseSchedule().make_plan(sampler, **kwargs)


def test_bad_schedule_configs_raise_value_errors():
    with pytest.raises(ValueError, match="beta schedule"):
        ScheduleConfig(kind="quadratic")
    with pytest.raises(ValueError, match="timesteps"):
        ScheduleConfig(num_timesteps=1)


def test_predicted_xstart_keeps_float32_accuracy_where_alpha_bar_is_tiny():
    # At t = T - 1 on the cosine schedule 1/sqrt(abar) is about 2e4: x0 must be computed as
    # a * (x_t - s * eps), not a * x_t - (a * s) * eps, whose two large products cancel.
    schedule = NoiseSchedule(ScheduleConfig(kind="cosine"))
    plan = schedule.make_plan("ddim", sampling_steps=10, clip_denoised=False)
    ac64 = alphas_cumprod64(schedule)[plan.timesteps[0]]
    assert (1.0 / ac64.sqrt()).item() > 1e4
    g = torch.Generator().manual_seed(0)
    x_start = torch.rand(4096, generator=g, dtype=F64) * 2 - 1
    eps = torch.randn(4096, generator=g, dtype=F64)
    x_t64 = ac64.sqrt() * x_start + (1 - ac64).sqrt() * eps
    x_t, eps32 = x_t64.float(), eps.float()
    exact = (x_t.double() - (1 - ac64).sqrt() * eps32.double()) / ac64.sqrt()  # float64, from the float32 inputs
    _, pred = p_step(plan, 0, x_t, eps32)
    a = (1.0 / ac64.sqrt()).float()
    expanded = a * x_t - (a * (1 - ac64).sqrt().float()) * eps32
    error, expanded_error = (pred.double() - exact).abs().max().item(), (expanded.double() - exact).abs().max().item()
    assert error < 2e-4 and expanded_error > 10 * error, (error, expanded_error)  # measured: 9.6e-5 and 6.3e-3
    # The schedule's own conversion (predict_xstart, what training and the original loop use) has the same form.
    t = plan.timesteps[:1].expand(4096)
    helper = schedule.predict_xstart(x_t, t, eps32)
    assert (helper.double() - exact).abs().max().item() < 2e-4


def gaussian_flow_error(kind: str, num_steps: int, *, lambda_min) -> float:
    """Max |DPM-Solver++ sample - the exact probability-flow map| for Gaussian data N(mu, s^2),
    whose optimal denoiser and ODE solution are closed forms, from the same x_T."""
    import noise_schedule

    schedule = NoiseSchedule(ScheduleConfig(kind=kind))
    mu, s = 0.3, 0.2
    ac = alphas_cumprod64(schedule)
    timesteps = sampling_timesteps(1000, num_steps, spacing="logsnr", alphas_cumprod=ac, lambda_min=lambda_min)
    plan = schedule.make_plan("dpm_solver", sampling_steps=num_steps, clip_denoised=False)
    # The same coefficient builder make_plan uses, on this grid.
    columns = noise_schedule._dpm_solver_coefficients(ac, timesteps)
    columns.update(xstart_coefficients(ac[timesteps], "eps"))
    coefficients = torch.stack([columns[name] for name in COEFFICIENT_NAMES], dim=1).float()
    plan = type(plan)(
        sampler=plan.sampler,
        timesteps=timesteps,
        coefficients=coefficients,
        clip_denoised=False,
        noise_steps=(False,) * num_steps,
    )

    def optimal_model(x, t):
        abar = schedule.alphas_cumprod[t].view(-1, 1, 1, 1)
        return (1 - abar).sqrt() * (x - abar.sqrt() * mu) / (abar * s**2 + 1 - abar)

    out = sample(optimal_model, plan, shape=(4, 1, 16, 16), generator=torch.Generator().manual_seed(0))
    x_T = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(0)).double()
    a_T = ac[-1]
    exact = mu + s / (a_T * s**2 + 1 - a_T).sqrt() * (x_T - a_T.sqrt() * mu)
    return (out.double() - exact).abs().max().item()


@pytest.mark.parametrize("num_steps,gain", [(10, 5.0), (20, 1.5)])
def test_clipping_the_log_snr_grid_cuts_dpm_solvers_error_on_the_cosine_schedule(num_steps, gain):
    # Unclipped, the cosine schedule's grid spends its first steps on t = 999..994 (log-SNR -9.9 to -6.5).
    from noise_schedule import DPM_SOLVER_LAMBDA_MIN

    clipped = gaussian_flow_error("cosine", num_steps, lambda_min=DPM_SOLVER_LAMBDA_MIN)
    unclipped = gaussian_flow_error("cosine", num_steps, lambda_min=None)
    assert clipped * gain < unclipped, (clipped, unclipped)  # measured: 0.005 vs 0.099, 0.012 vs 0.022
    plan = NoiseSchedule(ScheduleConfig(kind="cosine")).make_plan("dpm_solver", sampling_steps=num_steps)
    ac = alphas_cumprod64(NoiseSchedule(ScheduleConfig(kind="cosine")))
    expected = sampling_timesteps(
        1000, num_steps, spacing="logsnr", alphas_cumprod=ac, lambda_min=DPM_SOLVER_LAMBDA_MIN
    )
    assert torch.equal(plan.timesteps, expected)  # make_plan uses the clipped grid


def test_the_clip_leaves_the_linear_schedules_grid_unchanged():
    from noise_schedule import DPM_SOLVER_LAMBDA_MIN

    ac = torch.cumprod(1 - make_betas(ScheduleConfig()), 0)
    for num_steps in (5, 10, 20, 50):
        assert torch.equal(
            sampling_timesteps(1000, num_steps, spacing="logsnr", alphas_cumprod=ac, lambda_min=DPM_SOLVER_LAMBDA_MIN),
            sampling_timesteps(1000, num_steps, spacing="logsnr", alphas_cumprod=ac),
        )


def outputs_of(schedule, x_t, t, eps):
    """The same underlying prediction as each model type would output it (float64 closed forms)."""
    abar = torch.cumprod(1.0 - make_betas(schedule.config), 0)[t].view(-1, *[1] * (x_t.ndim - 1))
    x0 = (x_t - (1 - abar).sqrt() * eps) / abar.sqrt()
    return {"eps": eps, "v": abar.sqrt() * eps - (1 - abar).sqrt() * x0, "x0": x0}


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("prediction", ["v", "x0"])
def test_every_prediction_type_takes_the_same_step(schedule, sampler, prediction):
    # A v or x0 model whose output means the same x_0 as an eps model's moves x_t to the same place.
    kind = schedule.config.kind
    typed = NoiseSchedule(ScheduleConfig(kind=kind, prediction=prediction))
    plans = {
        p: s.make_plan(sampler, sampling_steps=8, clip_denoised=False)
        for p, s in (("eps", schedule), (prediction, typed))
    }
    gen = torch.Generator().manual_seed(0)
    for i in range(8):
        t = plans["eps"].timesteps[i].repeat(4)
        x_t, eps, noise, prev = (torch.randn(4, 1, 8, 8, generator=gen, dtype=F64) for _ in range(4))
        outputs = outputs_of(schedule, x_t, t, eps)
        noise = noise if plans["eps"].noise_steps[i] else None
        prev = prev if plans["eps"].uses_prev_xstart else None
        want = p_step(plans["eps"], i, x_t, outputs["eps"], noise=noise, prev_xstart=prev)
        got = p_step(plans[prediction], i, x_t, outputs[prediction], noise=noise, prev_xstart=prev)
        for w, g in zip(want, got):  # x_prev, pred_xstart
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-4 * (1 + w.abs().max().item())), (i, prediction)
        assert torch.allclose(typed.predict_xstart(x_t.float(), t, outputs[prediction].float()), got[1], atol=1e-5)


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_training_targets_are_the_closed_forms_and_invert_to_x0(schedule, prediction):
    typed = NoiseSchedule(ScheduleConfig(kind=schedule.config.kind, prediction=prediction))
    gen = torch.Generator().manual_seed(1)
    x0, noise = torch.rand(6, 1, 4, 4, generator=gen) * 2 - 1, torch.randn(6, 1, 4, 4, generator=gen)
    t = torch.tensor([0, 10, 100, 500, 900, 999])
    abar = alphas_cumprod64(typed)[t].view(-1, 1, 1, 1)
    v = abar.sqrt() * noise.double() - (1 - abar).sqrt() * x0.double()
    expected = {"eps": noise.double(), "v": v, "x0": x0.double()}[prediction]
    target = typed.training_target(x0, noise, t)
    assert torch.allclose(target.double(), expected, atol=1e-6)
    if prediction != "eps":  # from eps, x_0 at t = 999 is ill-conditioned (the point of v and x_0)
        assert torch.allclose(typed.predict_xstart(typed.q_sample(x0, t, noise), t, target), x0, atol=1e-5)


@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_consistency_sampler_with_the_exact_ode_map_draws_the_right_gaussian(num_steps):
    # For data N(mu, s^2) the probability-flow ODE maps x_t to mu + s (x_t - sqrt(abar) mu) / sqrt(abar s^2 + 1 - abar):
    # a model predicting that x_0 is a perfect consistency model, exact at any step count.
    schedule = NoiseSchedule(ScheduleConfig(prediction="x0"))
    mu, s = 0.3, 0.2

    def ode_endpoint(x, t):
        abar = schedule.alphas_cumprod[t].view(-1, 1, 1, 1)
        return mu + s * (x - abar.sqrt() * mu) / (abar * s**2 + 1 - abar).sqrt()

    plan = schedule.make_plan("consistency", sampling_steps=num_steps, clip_denoised=False)
    assert plan.timesteps.tolist() == [1000 * (num_steps - i) // num_steps - 1 for i in range(num_steps)]
    out = sample(ode_endpoint, plan, shape=(16, 1, 32, 32), generator=torch.Generator().manual_seed(0))
    assert out.mean().item() == pytest.approx(mu, abs=0.01)
    assert out.std().item() == pytest.approx(s, rel=0.03)


def test_explicit_timesteps_replace_the_samplers_spacing():
    schedule = NoiseSchedule()
    own = schedule.make_plan("ddim", sampling_steps=10)
    given = schedule.make_plan("ddim", timesteps=own.timesteps.tolist())
    assert torch.equal(given.timesteps, own.timesteps) and torch.equal(given.coefficients, own.coefficients)
    assert schedule.make_plan("consistency", timesteps=[999, 500, 100]).num_steps == 3
    for bad, match in [
        ([], "non-empty"),
        ([5, 5], "distinct"),
        ([1, 2], "descending"),
        ([1000], "between 0"),
        ([3.0], "integers"),
        ([True], "integers"),
    ]:
        with pytest.raises(ValueError, match=match):
            schedule.make_plan("consistency", timesteps=bad)
    with pytest.raises(ValueError, match="4 sampling steps but 3 timesteps"):
        schedule.make_plan("consistency", sampling_steps=4, timesteps=[999, 500, 100])


def test_unknown_prediction_types_are_refused():
    with pytest.raises(ValueError, match="unknown prediction type 'sample'"):
        ScheduleConfig(prediction="sample")
    assert (
        ScheduleConfig.from_dict(
            {"kind": "linear", "num_timesteps": 10, "beta_start": 1e-4, "beta_end": 0.02, "cosine_s": 0.008}
        ).prediction
        == "eps"
    )  # files written before it


def test_a_plan_lives_where_its_schedule_was_moved_unless_told_otherwise():
    """A schedule moved to a device makes its plans there (a preview plan once stayed on the CPU beside a model
    on cuda); the meta device stands in for a GPU."""
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=20)).to("meta")
    assert schedule.make_plan("ddim", sampling_steps=4).coefficients.device.type == "meta"
    assert schedule.make_plan("ddim", sampling_steps=4, device="cpu").timesteps.device.type == "cpu"
