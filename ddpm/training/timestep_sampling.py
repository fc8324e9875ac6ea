"""Which timesteps a training step draws, and the loss weight of each draw; and the learning rate's schedule over
a run's steps (:func:`lr_factor`: linear warm-up, then cosine decay), the other thing each step draws from a
schedule.

DDPM draws t uniformly (Ho et al. 2020). A sampler here draws t from a distribution p_t that follows
the losses training has shown it, with a weight w per draw, and the step's loss is mean_b(w_b L_b):

    sampler = make_timestep_sampler("importance", num_timesteps=1000)
    t, w = sampler.sample(batch_size, generator=generator, device=device)   # (B,) int64, (B,) float32
    loss = (w * per_sample_loss).mean()
    sampler.update(t, per_sample_loss.detach())                              # one sync (see update)

- ``uniform``: torch.randint exactly as diffusion_loss draws t; w = 1.
- ``importance``: Nichol & Dhariwal 2021, "Improved Denoising Diffusion Probabilistic Models", Sec. 3.3.
- ``topk``: adaptive top-K timestep selection, made unbiased with w = 1/(T p_t).
- ``speed``: a loss-driven simplification of SpeeD (Wang et al. 2024, "A Closer Look at Time Steps is
  Worthy of Triple Speed-Up for Diffusion Model Training", arXiv:2405.17403). Reweights the objective
  on purpose: ``unbiased = False``; the others keep E[w_t L_t] = mean_t L_t.

Until its warm-up is over a sampler draws exactly like ``uniform``. What it learned is in
``state_dict()``; with the generator's state restored too, a resumed run draws the same t and w.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from ddpm.choices import TIMESTEP_SAMPLERS


def _check_int(name: str, value: object, *, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {span}, got {value!r}")
    return value


def _check_number(
    name: str, value: object, *, low: float, high: float, open_low: bool = False, open_high: bool = False
) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        span = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        raise ValueError(f"{name} must be a number in {span}, got {value!r}")
    return float(value)


def _with_floor(p: Tensor, uniform_prob: float) -> tuple[Tensor, Tensor]:
    """Mix p with the uniform distribution, p <- (1-u) p + u/T; weights 1/(T p) (0 where p = 0: never drawn)."""
    T = p.numel()
    p = (1.0 - uniform_prob) * p + uniform_prob / T
    return p, torch.where(p > 0, 1.0 / (T * p), torch.zeros_like(p))


def _batch_means(index: Tensor, values: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per-slot count (n,) and mean (n,) of ``values`` grouped by ``index`` (mean 0 where the count is 0)."""
    counts = torch.bincount(index, minlength=n)
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, index, values)
    return counts, sums / counts.clamp(min=1)


def _ema_step(ema: Tensor, *, counts: Tensor, seen: Tensor, values: Tensor, decay: float) -> None:
    """One EMA step in place for the slots seen in this batch; a slot's first value starts its average."""
    ema.copy_(torch.where(seen, torch.where(counts == 0, values, decay * ema + (1.0 - decay) * values), ema))


def top_k_timesteps(signal: Tensor, k: int) -> Tensor:
    """The k timesteps with the largest ``signal`` (T,), ascending; a tie goes to the smaller t."""
    if signal.dim() != 1:
        raise ValueError(f"signal must be one value per timestep (T,), got shape {tuple(signal.shape)}")
    _check_int("k", k, high=signal.numel())
    return torch.argsort(signal, descending=True, stable=True)[:k].sort().values


def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class TimestepSampler:
    """One instance per training run: draws (t, w), learns from the losses it is shown."""

    name = "base"
    unbiased = True  # E_p[w_t L_t] == mean_t L_t for every loss profile L

    def __init__(self, *, num_timesteps: int) -> None:
        self.num_timesteps = _check_int("num_timesteps", num_timesteps)
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}  # (p, w) per device, until the next update

    # ----- what a sampler defines: OPTIONS and BUFFERS (attribute names), and these --------------
    OPTIONS: tuple[str, ...] = ()  # the settings a resumed run must share
    BUFFERS: tuple[str, ...] = ()  # the tensors it learns (a ``counts`` among them, for the warm-up)
    warmup = 1  # values every slot of ``counts`` needs before the draws follow the learned distribution

    def ready(self) -> bool:
        """Past the warm-up: draws follow the learned distribution (before: exactly like ``uniform``)."""
        return "counts" in self.BUFFERS and bool((self.counts >= self.warmup).all())

    def _distribution(self) -> tuple[Tensor, Tensor]:
        """(p, w) over the T timesteps, float64 on the CPU; called only when ready()."""
        raise NotImplementedError

    def _record(self, t: Tensor, values: Tensor) -> None:
        """Learn from finite per-sample values (float64) at timesteps t (int64), both on the CPU."""

    # ----- the interface -------------------------------------------------------------------------
    def _table(self, device: torch.device) -> tuple[Tensor, Tensor]:
        cpu = torch.device("cpu")
        if cpu not in self._tables:
            T = self.num_timesteps
            uniform = (torch.full((T,), 1.0 / T, dtype=torch.float64), torch.ones(T, dtype=torch.float64))
            self._tables[cpu] = self._distribution() if self.ready() else uniform
        if device not in self._tables:
            self._tables[device] = tuple(x.to(device) for x in self._tables[cpu])
        return self._tables[device]

    def probabilities(self) -> Tensor:
        """The current distribution p_t (T,), float64, summing to 1."""
        return self._table(torch.device("cpu"))[0].clone()

    def timestep_weights(self) -> Tensor:
        """The weight w_t (T,), float64, that a draw of t gets now."""
        return self._table(torch.device("cpu"))[1].clone()

    def sample(
        self, batch_size: int, *, generator: torch.Generator, device: torch.device | str
    ) -> tuple[Tensor, Tensor]:
        """(t, w): t (B,) int64 and w (B,) float32 on ``device``; p is built on the generator's device."""
        B, device = _check_int("batch_size", batch_size), torch.device(device)
        if not self.ready():  # the very draw diffusion_loss makes, so warm-up (and uniform) runs stay bit-identical
            t = torch.randint(0, self.num_timesteps, (B,), device=device, generator=generator)
            return t, torch.ones(B, device=device, dtype=torch.float32)
        p, w = self._table(generator.device)
        t = torch.multinomial(p, B, replacement=True, generator=generator)  # (B,)
        return t.to(device), w[t].to(device=device, dtype=torch.float32)

    def update(self, t: Tensor, losses: Tensor) -> None:
        """Record detached per-sample ``losses`` (B,) of the draws ``t`` (B,); non-finite ones are ignored."""
        if t.dim() != 1 or t.shape != losses.shape:
            raise ValueError(f"t and losses must both be (B,), got {tuple(t.shape)} and {tuple(losses.shape)}")
        # sync: one copy of (t, losses) to the CPU, where the histories live.
        both = torch.stack([t.detach().to(losses.device, torch.float64), losses.detach().to(torch.float64)]).cpu()
        finite = both[1].isfinite()
        t_cpu, values = both[0, finite].long(), both[1, finite]
        if t_cpu.numel() and not (0 <= int(t_cpu.min()) and int(t_cpu.max()) < self.num_timesteps):
            raise ValueError(
                f"timesteps must lie in [0, {self.num_timesteps}), got {int(t_cpu.min())}..{int(t_cpu.max())}"
            )
        self._record(t_cpu, values)
        self._tables.clear()

    def state_dict(self) -> dict:
        """Name, T, options and learned tensors: loadable with torch.load(weights_only=True)."""
        buffers = {key: getattr(self, key).clone() for key in self.BUFFERS}
        return {"name": self.name, "num_timesteps": self.num_timesteps, "options": self._options(), **buffers}

    def _options(self) -> dict[str, int | float]:
        return {key: getattr(self, key) for key in self.OPTIONS}

    def load_state_dict(self, state: dict) -> None:
        state = state if isinstance(state, dict) else {}
        theirs, ours = (state.get("name"), state.get("num_timesteps")), (self.name, self.num_timesteps)
        if theirs != ours:
            raise ValueError(
                f"this state is of the {theirs[0]!r} timestep sampler over {theirs[1]} timesteps, not {ours[0]!r} "
                f"over {ours[1]}"
            )
        if state.get("options") != self._options():
            raise ValueError(
                f"this {self.name} sampler state has options {state.get('options')}, this run {self._options()}"
            )
        for key in self.BUFFERS:
            buffer, value = getattr(self, key), state.get(key)
            if not isinstance(value, Tensor) or value.shape != buffer.shape:
                raise ValueError(
                    f"this {self.name} sampler state's {key!r} is missing or not of shape {tuple(buffer.shape)}"
                )
            buffer.copy_(value)
        self._tables.clear()


class UniformSampler(TimestepSampler):
    """t ~ U{0..T-1} with torch.randint, w = 1: the DDPM default, drawn exactly as diffusion_loss does."""

    name = "uniform"

    def update(self, t: Tensor, losses: Tensor) -> None:
        """Nothing to learn (and no sync)."""


class ImportanceSampler(TimestepSampler):
    """Nichol & Dhariwal 2021, Sec. 3.3: p_t ∝ sqrt(E[L_t^2]) over the last ``history`` losses of each t,
    p <- (1-u) p + u/T, w_t = 1/(T p_t); uniform until every timestep has ``history`` losses."""

    name = "importance"
    OPTIONS, BUFFERS = ("history", "uniform_prob"), ("losses", "counts")

    def __init__(self, *, num_timesteps: int, history: int = 10, uniform_prob: float = 0.001) -> None:
        super().__init__(num_timesteps=num_timesteps)
        self.history = self.warmup = _check_int("history", history)
        self.uniform_prob = _check_number("uniform_prob", uniform_prob, low=0, high=1, open_high=True)
        self.losses = torch.zeros(num_timesteps, self.history, dtype=torch.float64)  # ring buffer per timestep
        self.counts = torch.zeros(num_timesteps, dtype=torch.int64)  # losses seen per timestep, ever

    def _distribution(self) -> tuple[Tensor, Tensor]:
        rms = self.losses.pow(2).mean(dim=1).sqrt()  # (T,) sqrt(E[L_t^2]) over the history
        total = float(rms.sum())
        p = rms / total if total > 0 else torch.full_like(rms, 1.0 / self.num_timesteps)
        return _with_floor(p, self.uniform_prob)

    def _record(self, t: Tensor, values: Tensor) -> None:
        # Slot of a draw: (losses seen before + its rank among this batch's draws of the same t) mod H.
        # Of a t drawn more than H times in the batch only its last H draws are written (no slot twice).
        H, T = self.history, self.num_timesteps
        t, order = torch.sort(t, stable=True)
        values = values[order]
        rank = torch.arange(t.numel()) - torch.searchsorted(t, t)
        per_t = torch.bincount(t, minlength=T)
        keep = rank >= per_t[t] - H
        self.losses[t[keep], (self.counts[t[keep]] + rank[keep]) % H] = values[keep]
        self.counts += per_t


class TopKSampler(TimestepSampler):
    """After every t has ``warmup`` values: p = (1-u)/K on the K timesteps with the largest signal, plus
    u/T everywhere; w_t = 1/(T p_t). The signal is a per-timestep EMA (``decay`` per visit) of what
    update() is shown (the trainer's per-sample losses). Default K = T//4; u = 0.1 bounds the weight of the
    other timesteps at 1/u and keeps their signal fresh."""

    name = "topk"
    OPTIONS, BUFFERS = ("k", "uniform_prob", "warmup", "decay"), ("signal", "counts")

    def __init__(
        self,
        *,
        num_timesteps: int,
        k: int | None = None,
        uniform_prob: float = 0.1,
        warmup: int = 10,
        decay: float = 0.9,
    ) -> None:
        super().__init__(num_timesteps=num_timesteps)
        self.k = _check_int("k", max(1, num_timesteps // 4) if k is None else k, high=num_timesteps)
        self.uniform_prob = _check_number("uniform_prob", uniform_prob, low=0, high=1, open_high=True)
        self.warmup = _check_int("warmup", warmup)
        self.decay = _check_number("decay", decay, low=0, high=1, open_high=True)
        self.signal = torch.zeros(num_timesteps, dtype=torch.float64)  # EMA of the per-sample signal
        self.counts = torch.zeros(num_timesteps, dtype=torch.int64)

    def _distribution(self) -> tuple[Tensor, Tensor]:
        p = torch.zeros(self.num_timesteps, dtype=torch.float64)
        p[top_k_timesteps(self.signal, self.k)] = 1.0 / self.k
        return _with_floor(p, self.uniform_prob)

    def _record(self, t: Tensor, values: Tensor) -> None:
        n, means = _batch_means(t, values, self.num_timesteps)  # a t drawn twice: one EMA step on its mean
        _ema_step(self.signal, counts=self.counts, seen=n > 0, values=means, decay=self.decay)
        self.counts += n


class SpeedSampler(TimestepSampler):
    """SpeeD's asymmetric sampling and change-aware weighting, driven by the observed losses.

    SpeeD's convergence area is the noisy end, t >= tau, where x_t is nearly pure noise and the loss
    flattens early; it is drawn 1/k as often as the rest. Here the timesteps fall in ``bins`` equal bins.
    Per bin, a fast and a slow EMA of the batch-mean loss (time constants ``horizon``/10 and ``horizon``
    steps) give its change rate r_b = |slow - fast| / slow, set to 0 (converged) where the change is
    within 2 noise standard deviations of the fast EMA or at most ``threshold`` * max r. tau is the bin
    boundary that best splits moving bins below from converged ones above (tau = T: none converged).
    With s = ``suppress`` (1/k) and lambda = ``change_weight``:

        p_t = 1 / (tau + s (T - tau)) for t < tau, s / (tau + s (T - tau)) for t >= tau   (= k / (T + tau (k-1)))
        w_t ∝ (1 - lambda) + lambda r_b(t) / max r, scaled so that sum_t p_t w_t = 1 (the loss keeps its scale)

    Unlike the paper, tau and the weights come from the losses, not the noise schedule, and there is no "dual"
    draw mirrored about tau. Warm-up: every bin visited on ``horizon`` steps.
    """

    name = "speed"
    OPTIONS = ("suppress", "threshold", "change_weight", "bins", "horizon")
    BUFFERS = ("fast", "slow", "noise", "counts")
    unbiased = False  # E_p[w L] is SpeeD's reweighted objective, not mean_t L_t
    Z = 2.0  # a change within Z standard deviations of the fast EMA's noise is no change

    def __init__(
        self,
        *,
        num_timesteps: int,
        suppress: float = 0.2,
        threshold: float = 0.1,
        change_weight: float = 0.5,
        bins: int | None = None,
        horizon: int = 1000,
    ) -> None:
        super().__init__(num_timesteps=num_timesteps)
        self.suppress = _check_number("suppress", suppress, low=0, high=1, open_low=True)
        self.threshold = _check_number("threshold", threshold, low=0, high=1)
        self.change_weight = _check_number("change_weight", change_weight, low=0, high=1, open_high=True)
        self.bins = _check_int("bins", min(20, num_timesteps) if bins is None else bins, high=num_timesteps)
        self.horizon = self.warmup = _check_int("horizon", horizon, low=10)
        self.fast_decay, self.slow_decay = 1.0 - 10.0 / self.horizon, 1.0 - 1.0 / self.horizon
        self.bin_of = torch.arange(num_timesteps) * self.bins // num_timesteps  # (T,) nondecreasing
        self.fast, self.slow = torch.zeros(self.bins, dtype=torch.float64), torch.zeros(self.bins, dtype=torch.float64)
        self.noise = torch.zeros(self.bins, dtype=torch.float64)  # EMA of (batch mean - fast EMA)^2
        self.counts = torch.zeros(self.bins, dtype=torch.int64)  # steps that visited each bin

    def change_rates(self) -> Tensor:
        """r_b (bins,): how much each bin's loss still moves, relative to its level (0: converged)."""
        level = self.slow.clamp(min=1e-300)
        rate = torch.where(self.slow > 0, (self.slow - self.fast).abs() / level, 0.0)
        # Var(fast EMA) = Var(batch mean) (1 - d) / (1 + d); self.noise estimates Var(batch mean) (a bit above).
        spread = (self.noise * (1 - self.fast_decay) / (1 + self.fast_decay)).sqrt() / level
        moving = (rate > self.Z * spread) & (rate > self.threshold * rate.max())
        return torch.where(moving, rate, 0.0)

    def threshold_timestep(self) -> int:
        """tau: the step function "moving below tau, converged from tau on" that misclassifies the fewest bins
        (a tie goes to the larger tau), so that one bin's noise neither starts nor ends the convergence area."""
        moving = (self.change_rates() > 0).long()
        zero = torch.zeros(1, dtype=torch.long)
        agree = torch.cat([zero, moving.cumsum(0)]) + torch.cat([(1 - moving).flip(0).cumsum(0).flip(0), zero])
        first_converged_bin = self.bins - int(agree.flip(0).argmax())  # (bins + 1,) candidate boundaries
        return int((self.bin_of < first_converged_bin).sum())

    def _distribution(self) -> tuple[Tensor, Tensor]:
        T, tau = self.num_timesteps, self.threshold_timestep()
        p = torch.full((T,), self.suppress, dtype=torch.float64)
        p[:tau] = 1.0
        p = p / p.sum()
        r = self.change_rates()
        r_hat = r / r.max() if float(r.max()) > 0 else r
        w = (1.0 - self.change_weight) + self.change_weight * r_hat[self.bin_of]  # >= 1 - lambda > 0
        return p, w / (p * w).sum()

    def _record(self, t: Tensor, values: Tensor) -> None:
        n, means = _batch_means(self.bin_of[t], values, self.bins)  # (bins,): one observation per bin and step
        seen = n > 0
        squared_deviation = torch.where(self.counts > 0, (means - self.fast) ** 2, 0.0)
        _ema_step(self.noise, counts=self.counts, seen=seen, values=squared_deviation, decay=self.fast_decay)
        _ema_step(self.fast, counts=self.counts, seen=seen, values=means, decay=self.fast_decay)
        _ema_step(self.slow, counts=self.counts, seen=seen, values=means, decay=self.slow_decay)
        self.counts += seen.long()


_SAMPLERS: dict[str, type[TimestepSampler]] = {
    cls.name: cls for cls in (UniformSampler, ImportanceSampler, TopKSampler, SpeedSampler)
}


def make_timestep_sampler(name: str, *, num_timesteps: int, **options: float) -> TimestepSampler:
    """The sampler called ``name`` (one of TIMESTEP_SAMPLERS) over ``num_timesteps``, with its options."""
    if name not in _SAMPLERS:
        raise ValueError(f"unknown timestep sampler {name!r}; choose one of {', '.join(TIMESTEP_SAMPLERS)}")
    cls = _SAMPLERS[name]
    takes = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "num_timesteps")]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ValueError(
            f"the {name} timestep sampler has no option {unknown[0]!r} (it takes: {', '.join(takes) or 'none'})"
        )
    return cls(num_timesteps=num_timesteps, **options)
