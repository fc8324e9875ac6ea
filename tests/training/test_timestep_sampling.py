"""Timestep samplers: uniform draws like diffusion_loss, importance/topk weights keep the objective
unbiased (closed form and Monte Carlo), SpeeD suppresses the converged tail, and a sampler's state
resumes its draws exactly. Synthetic losses only: no model is trained here."""

import io
from collections import deque

import pytest
import torch

from ddpm.training.timestep_sampling import TIMESTEP_SAMPLERS, make_timestep_sampler, top_k_timesteps


def close(actual, expected, *, rel=0.0, abs_=1e-12):
    """Same dtype and shape, and |actual - expected| <= abs_ + rel |expected| everywhere."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    return bool(((actual - expected).abs() <= abs_ + rel * expected.abs()).all())


def feed(sampler, losses_of_t, *, rounds):
    """Show the sampler every timestep ``rounds`` times, with loss ``losses_of_t`` (T,)."""
    t = torch.arange(sampler.num_timesteps)
    for _ in range(rounds):
        sampler.update(t, losses_of_t)


def test_uniform_draws_exactly_what_diffusion_loss_draws():
    sampler = make_timestep_sampler("uniform", num_timesteps=50)
    g, reference = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(3):
        t, w = sampler.sample(16, generator=g, device="cpu")
        assert torch.equal(t, torch.randint(0, 50, (16,), generator=reference))
        assert t.dtype == torch.int64 and w.dtype == torch.float32 and torch.equal(w, torch.ones(16))
        sampler.update(t, torch.rand(16))  # a no-op
    assert torch.equal(g.get_state(), reference.get_state())  # nothing else was drawn
    assert torch.equal(sampler.probabilities(), torch.full((50,), 1 / 50, dtype=torch.float64))


@pytest.mark.parametrize("name", ["importance", "topk", "speed"])
def test_during_warm_up_every_sampler_draws_like_uniform(name):
    sampler = make_timestep_sampler(name, num_timesteps=20)
    feed(sampler, torch.rand(20), rounds=1)  # not enough for any warm-up
    g, reference = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    t, w = sampler.sample(8, generator=g, device="cpu")
    assert torch.equal(t, torch.randint(0, 20, (8,), generator=reference)) and torch.equal(w, torch.ones(8))


def test_importance_probabilities_follow_the_rms_of_the_history_with_a_uniform_floor():
    T, u = 8, 0.05
    sampler = make_timestep_sampler("importance", num_timesteps=T, history=3, uniform_prob=u)
    loss = (torch.arange(T, dtype=torch.float64) + 1) ** 2  # L_t = (t+1)^2
    feed(sampler, loss, rounds=2)
    assert not sampler.ready() and close(sampler.probabilities(), torch.full((T,), 1 / T, dtype=torch.float64))
    feed(sampler, loss, rounds=1)
    assert sampler.ready()
    expected = (1 - u) * loss / loss.sum() + u / T  # RMS of a constant history is the constant
    assert close(sampler.probabilities(), expected)
    assert close(sampler.timestep_weights(), 1 / (T * expected), rel=1e-12, abs_=0)


def test_importance_weighted_loss_is_unbiased_exactly_and_by_monte_carlo():
    T = 10
    sampler = make_timestep_sampler("importance", num_timesteps=T, history=4)
    g = torch.Generator().manual_seed(1)

    def noisy(t):  # L_t = (t+1) (1 + 0.5 N(0, 1)): mean t+1
        return (t.double() + 1) * (1 + 0.5 * torch.randn(t.shape, generator=g, dtype=torch.float64))

    for _ in range(4):
        t = torch.arange(T)
        sampler.update(t, noisy(t))
    mean_loss = torch.arange(T, dtype=torch.float64) + 1  # E[L_t]
    p, w = sampler.probabilities(), sampler.timestep_weights()
    assert sampler.ready() and sampler.unbiased
    assert abs(float((p * w * mean_loss).sum()) - float(mean_loss.mean())) < 1e-12
    t, wt = sampler.sample(200_000, generator=g, device="cpu")
    estimate = wt.double() * noisy(t)
    standard_error = estimate.std() / estimate.numel() ** 0.5
    assert abs(float(estimate.mean()) - float(mean_loss.mean())) < 4 * float(standard_error)


def test_importance_history_keeps_the_last_losses_of_each_timestep_like_a_deque():
    T, H = 5, 3
    sampler = make_timestep_sampler("importance", num_timesteps=T, history=H)
    queues = [deque(maxlen=H) for _ in range(T)]
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        t, losses = torch.randint(0, T, (12,), generator=g), torch.rand(12, generator=g, dtype=torch.float64)
        sampler.update(t, losses)
        for ti, li in zip(t.tolist(), losses.tolist()):
            queues[ti].append(li)
    for ti in range(T):
        assert sorted(sampler.losses[ti, : len(queues[ti])].tolist()) == sorted(queues[ti])


def test_top_k_timesteps_picks_the_peak_of_a_gradient_profile():
    t = torch.arange(40, dtype=torch.float64)
    bump = torch.exp(-((t - 25) ** 2) / 8) + 0.01 * torch.exp(-((t - 5) ** 2))  # a main and a tiny bump
    assert top_k_timesteps(bump, 5).tolist() == [23, 24, 25, 26, 27]
    assert top_k_timesteps(torch.zeros(6), 2).tolist() == [0, 1]  # ties go to the smaller t


def test_topk_draws_only_from_the_top_k_and_stays_unbiased_with_its_floor():
    T, K = 20, 5
    bump = torch.exp(-((torch.arange(T, dtype=torch.float64) - 12) ** 2) / 4)
    strict = make_timestep_sampler("topk", num_timesteps=T, k=K, uniform_prob=0.0, warmup=2)
    feed(strict, bump, rounds=2)
    t, w = strict.sample(1000, generator=torch.Generator().manual_seed(0), device="cpu")
    assert set(t.tolist()) == {10, 11, 12, 13, 14} and torch.all(w == K / T)

    u = 0.1
    floored = make_timestep_sampler("topk", num_timesteps=T, k=K, uniform_prob=u, warmup=2)
    feed(floored, bump, rounds=2)
    top = torch.zeros(T, dtype=torch.float64)
    top[10:15] = 1 / K
    p, w = floored.probabilities(), floored.timestep_weights()
    assert close(p, (1 - u) * top + u / T)
    loss = torch.rand(T, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert abs(float((p * w * loss).sum()) - float(loss.mean())) < 1e-12


def speed_sampler_after_the_noisy_half_converged(**options):
    """T = 100 in 10 bins; the loss of t < 50 keeps falling, that of t >= 50 is flat."""
    T = 100
    sampler = make_timestep_sampler("speed", num_timesteps=T, bins=10, horizon=20, **options)
    t = torch.arange(T)
    for step in range(60):
        sampler.update(t, torch.where(t < 50, 1.0 + torch.exp(torch.tensor(-step / 30.0)), 0.5))
    return sampler


def test_speed_suppresses_the_converged_tail_and_keeps_the_loss_scale():
    s, lam = 0.2, 0.5
    sampler = speed_sampler_after_the_noisy_half_converged(suppress=s, change_weight=lam)
    assert sampler.ready() and sampler.threshold_timestep() == 50 and not sampler.unbiased
    p, w = sampler.probabilities(), sampler.timestep_weights()
    expected = torch.tensor([1.0] * 50 + [s] * 50, dtype=torch.float64) / (50 + 50 * s)
    assert close(p, expected)
    assert abs(float(p.sum()) - 1) < 1e-12 and float(p[50:].sum()) < 0.5  # less than uniform's half
    assert abs(float((p * w).sum()) - 1) < 1e-12  # mean weight under p is 1
    # Change-aware: the still-changing half weighs more; the flat half has r = 0, so w ∝ 1 - lambda.
    assert float(w[:50].min()) > float(w[50:].max())
    assert close(w[50:], w[99].expand(50), rel=1e-12, abs_=0)
    t, wt = sampler.sample(4000, generator=torch.Generator().manual_seed(0), device="cpu")
    assert (t >= 50).double().mean() < 0.25  # expected 1/6
    assert torch.equal(wt, w[t].float())


def test_speed_takes_the_noise_of_a_flat_loss_for_no_change():
    sampler = make_timestep_sampler("speed", num_timesteps=100, bins=10, horizon=20, threshold=0.0)
    g, t = torch.Generator().manual_seed(0), torch.arange(100).repeat(10)
    for step in range(100):  # t < 50: falling mean; t >= 50: flat mean; both with 30% noise
        mean = torch.where(t < 50, 1 + 2 * torch.exp(torch.tensor(-step / 100.0)), 0.5)
        sampler.update(t, mean * (1 + 0.3 * torch.randn(1000, generator=g, dtype=torch.float64)))
    rates = sampler.change_rates()
    assert bool((rates[:5] > 0).all()) and int((rates[5:] == 0).sum()) >= 4
    assert 50 <= sampler.threshold_timestep() <= 60  # the best split: one noisy bin does not move it far


def test_speed_on_a_flat_loss_is_uniform():
    sampler = make_timestep_sampler("speed", num_timesteps=30, bins=3, horizon=10)
    feed(sampler, torch.ones(30), rounds=10)  # flat everywhere: r = 0, tau = 0, nothing to favour
    assert close(sampler.probabilities(), torch.full((30,), 1 / 30, dtype=torch.float64))
    assert close(sampler.timestep_weights(), torch.ones(30, dtype=torch.float64))


@pytest.mark.parametrize("name", TIMESTEP_SAMPLERS)
def test_a_restored_sampler_continues_the_draws_exactly(name):
    T = 16
    options = {
        "uniform": {},
        "importance": {"history": 2},
        "topk": {"k": 3, "warmup": 2},
        "speed": {"bins": 4, "horizon": 10},
    }
    sampler = make_timestep_sampler(name, num_timesteps=T, **options[name])
    g = torch.Generator().manual_seed(5)

    def step(s, gen):
        t, w = s.sample(32, generator=gen, device="cpu")
        s.update(t, (t.double() + 1) * torch.rand(32, generator=gen, dtype=torch.float64))
        return t, w

    for _ in range(12):
        step(sampler, g)
    assert name == "uniform" or sampler.ready()
    buffer = io.BytesIO()
    torch.save({"sampler": sampler.state_dict(), "generator": g.get_state()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_timestep_sampler(name, num_timesteps=T, **options[name])
    resumed.load_state_dict(saved["sampler"])
    g2 = torch.Generator()
    g2.set_state(saved["generator"])
    for _ in range(4):
        (t1, w1), (t2, w2) = step(sampler, g), step(resumed, g2)
        assert torch.equal(t1, t2) and torch.equal(w1, w2)


def test_nonfinite_losses_are_not_recorded():
    sampler = make_timestep_sampler("importance", num_timesteps=4, history=1)
    sampler.update(torch.tensor([0, 1, 2, 3]), torch.tensor([1.0, float("nan"), 2.0, float("inf")]))
    assert sampler.counts.tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("nope", {}, "choose one of uniform, importance, topk, speed"),
        ("importance", {"histories": 3}, "no option 'histories'"),
        ("uniform", {"history": 3}, "no option 'history'"),
        ("importance", {"history": 0}, "history must be an integer >= 1, got 0"),
        ("importance", {"uniform_prob": 1.0}, r"uniform_prob must be a number in \[0, 1\), got 1.0"),
        ("topk", {"k": 11}, r"k must be an integer in \[1, 10\], got 11"),
        ("topk", {"warmup": True}, "warmup must be an integer >= 1, got True"),
        ("speed", {"suppress": 0.0}, "suppress must be a number in"),
        ("speed", {"bins": 20}, "bins must be an integer in"),
        ("speed", {"change_weight": float("nan")}, "change_weight must be a number in"),
    ],
)
def test_bad_names_and_options_are_refused_in_one_line(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_timestep_sampler(name, num_timesteps=10, **options)


def test_a_state_of_another_sampler_or_length_or_options_is_refused():
    state = make_timestep_sampler("importance", num_timesteps=10).state_dict()
    with pytest.raises(ValueError, match="'importance' timestep sampler over 10 timesteps, not 'topk' over 10"):
        make_timestep_sampler("topk", num_timesteps=10).load_state_dict(state)
    with pytest.raises(ValueError, match="not 'importance' over 12"):
        make_timestep_sampler("importance", num_timesteps=12).load_state_dict(state)
    with pytest.raises(ValueError, match="has options"):
        make_timestep_sampler("importance", num_timesteps=10, history=5).load_state_dict(state)
    with pytest.raises(ValueError, match="timesteps must lie in"):
        make_timestep_sampler("importance", num_timesteps=10).update(torch.tensor([10]), torch.tensor([1.0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_importance_sampler_draws_on_cuda_with_a_cuda_generator():
    sampler = make_timestep_sampler("importance", num_timesteps=10, history=1)
    feed(sampler, torch.arange(10, device="cuda", dtype=torch.float32) + 1, rounds=1)
    t, w = sampler.sample(64, generator=torch.Generator("cuda").manual_seed(0), device="cuda")
    assert t.is_cuda and w.is_cuda and t.dtype == torch.int64 and w.dtype == torch.float32
    assert close(w.cpu().double(), sampler.timestep_weights()[t.cpu()], rel=1e-6, abs_=0)
