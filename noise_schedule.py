"""Noise schedules and sampler update rules: the diffusion math every implementation shares.

It holds the beta schedules and what derives from them, the forward process q(x_t | x_0), the posterior
q(x_{t-1} | x_t, x_0), what the U-Net predicts (noise, velocity or the clean image) and the update rules of the
samplers (DDPM ancestral, DDIM, DPM-Solver++(2M) and its SDE form, multistep consistency). The "original", "cuda"
and "tensorrt" implementations all take their coefficients from here. Schedules are computed in float64 and kept
as float32 buffers that move with ``.to(device)``.

Sampling plans
--------------
A sampler visits ``S`` distinct timesteps chosen by :func:`sampling_timesteps`, from the last
trained timestep ``T - 1`` down to ``0``. DDPM and DDIM space them evenly in t (rounded half
up; ``S = T`` visits every timestep); DPM-Solver++ spaces them evenly in log-SNR, the grid starting no
lower than :data:`DPM_SOLVER_LAMBDA_MIN`. Step ``i`` goes from ``t_i`` to ``t_{i+1}``; the last
step goes from ``t = 0`` to clean data (alpha-bar = 1).

Every sampler's step has the same shape, so one fused kernel serves all of them::

    pred_xstart = a * (k_xt * x_t - s * out)             # x_0 from the U-Net's output
    pred_xstart = clamp(pred_xstart, -1, 1)              # optional
    x_prev      = c_xt * x_t + c_x0 * pred_xstart + c_prev * prev_xstart + sigma * z

with seven per-step coefficients precomputed in float64 (:class:`SamplingPlan`). The first line is
the one conversion from what the model predicts (``ScheduleConfig.prediction``) to x_0:

* ``eps`` (noise): ``a = 1/sqrt(abar)``, ``s = sqrt(1 - abar)``, ``k_xt = 1``. The difference is taken
  before the large factor ``a`` so that float32 loses no digits to cancellation.
* ``v`` (velocity, Salimans & Ho 2022: ``v = sqrt(abar) eps - sqrt(1 - abar) x_0``):
  ``a = sqrt(abar)``, ``s = sqrt(1 - abar) / sqrt(abar)``, ``k_xt = 1``.
* ``x0`` (the clean image): ``a = 1``, ``s = -1``, ``k_xt = 0``.

* DDPM: ``c_x0``, ``c_xt`` are the posterior-mean coefficients of the (respaced) chain,
  ``sigma`` the square root of the posterior variance ("fixed_small") or of beta
  ("fixed_large"), ``c_prev = 0``.
* DDIM: the eps re-derived from the (clipped) ``pred_xstart`` is folded into ``c_x0``, ``c_xt``.
* DPM-Solver++(2M): ``prev_xstart`` is the previous step's ``pred_xstart``; the first step, the
  final jump to clean data and (for ``S < 15``) the step into ``t = 0`` are first order.
* Consistency (multistep, Song et al. 2023): the prediction of x_0 noised afresh to the next
  timestep, ``x_prev = sqrt(abar_next) pred_xstart + sqrt(1 - abar_next) z``; the last step returns
  ``pred_xstart``. Its default timesteps, ``T (S - i) / S - 1``, stop short of t = 0; a distilled
  student records the ones it was trained on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

SCHEDULES = ("linear", "cosine")
SAMPLERS = ("ddpm", "ddim", "dpm_solver", "dpm_solver_sde", "consistency")
PREDICTIONS = ("eps", "v", "x0")  # what the U-Net predicts: the noise, the velocity, the clean image
VARIANCE_TYPES = ("fixed_small", "fixed_large")

# Columns of SamplingPlan.coefficients, in the order the fused kernels read them.
COEFFICIENT_NAMES = ("a", "s", "c_xt", "c_x0", "c_prev", "sigma", "k_xt")
NUM_COEFFICIENTS = len(COEFFICIENT_NAMES)

# DPM-Solver++'s log-SNR grid starts no lower than this (diffusers' lambda_min_clipped), so that few steps go to
# the nearly-pure-noise end of the cosine schedule; the linear schedule never reaches it.
DPM_SOLVER_LAMBDA_MIN = -5.1

# None: all T steps.
DEFAULT_SAMPLING_STEPS = {"ddpm": None, "ddim": 50, "dpm_solver": 20, "dpm_solver_sde": 20, "consistency": 4}
MAX_TIMESTEPS = 10_000
MAX_LIST_ITEMS = 16  # the longest list a config field read from a file may hold
MAX_GUIDANCE = 100.0  # the largest classifier-free guidance scale a file may record


@dataclass(frozen=True)
class ScheduleConfig:
    """The forward process. Linear endpoints are for T = 1000 and scale by 1000 / T.

    Valid values: ``kind`` in :data:`SCHEDULES`; ``2 <= num_timesteps <= MAX_TIMESTEPS``;
    ``0 < beta_start < beta_end < 1``;
    ``0 < cosine_s <= 1``; ``prediction`` in :data:`PREDICTIONS` (what the U-Net trained on this
    schedule predicts). A config read from a file goes through :meth:`from_dict`, which also checks
    the keys and the types.

    A distilled student (ddpm/training/distill.py) records how it samples: ``student_sampler``,
    ``student_timesteps`` and ``folded_guidance``, the classifier-free guidance scale it learned to produce in one
    call (0: none).
    """

    # Fields that files written before them lack, and the value that reproduces those models.
    ADDED_LATER = {"prediction": "eps", "student_sampler": "", "student_timesteps": (), "folded_guidance": 0.0}

    kind: str = "linear"
    num_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    cosine_s: float = 0.008
    prediction: str = "eps"
    student_sampler: str = ""  # "": not a distilled student
    student_timesteps: tuple[int, ...] = ()
    folded_guidance: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown beta schedule {short_repr(self.kind)}; choose one of {', '.join(SCHEDULES)}")
        if not 2 <= self.num_timesteps <= MAX_TIMESTEPS:
            raise ValueError(
                f"the number of diffusion timesteps must be between 2 and {MAX_TIMESTEPS}, got {self.num_timesteps}"
            )
        if not 0.0 < self.beta_start < self.beta_end < 1.0:  # also False for NaN
            raise ValueError(
                f"need 0 < beta_start < beta_end < 1, got beta_start={self.beta_start}, beta_end={self.beta_end}"
            )
        if not 0.0 < self.cosine_s <= 1.0:
            raise ValueError(f"cosine_s must be in (0, 1], got {self.cosine_s}")
        if self.prediction not in PREDICTIONS:
            raise ValueError(
                f"unknown prediction type {short_repr(self.prediction)}; choose one of {', '.join(PREDICTIONS)}"
            )
        if self.student_sampler not in ("", *SAMPLERS):
            raise ValueError(f"unknown student sampler {short_repr(self.student_sampler)}")
        if bool(self.student_sampler) != bool(self.student_timesteps):
            raise ValueError("a student records both its sampler and its timesteps")
        if self.student_timesteps:
            checked_timesteps(self.student_timesteps, self.num_timesteps)
        if not 0.0 <= self.folded_guidance <= MAX_GUIDANCE:  # also False for NaN
            raise ValueError(f"folded_guidance must be between 0 and {MAX_GUIDANCE}, got {self.folded_guidance}")

    @property
    def is_student(self) -> bool:
        return bool(self.student_sampler)

    @classmethod
    def from_dict(cls, data: object) -> ScheduleConfig:
        """A schedule config read from a file: refuses unknown or missing keys, wrong types, bad ranges."""
        return cls(**config_fields(cls, data))


def config_fields(cls: type, data: object) -> dict:
    """The fields of the config dataclass ``cls`` from ``data`` (a dict read from a file), type-checked.

    Refused with a one-line ValueError (the caller names the file): anything but a dict, unknown keys
    (named), missing keys, and values of the wrong type: ``int`` fields take ints (not bools, floats
    or strings), ``float`` fields finite ints or floats, ``str`` fields strings, ``tuple[int, ...]``
    fields lists or tuples of at most :data:`MAX_LIST_ITEMS` ints. Ranges are the class's own
    ``__post_init__``'s to check.
    Shared by :meth:`ScheduleConfig.from_dict` and ``basic_diffusion.UNetConfig.from_dict``.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a {type(data).__name__} instead of a dict of settings")
    types = {field.name: field.type for field in dataclasses.fields(cls)}
    unknown = [key for key in data if key not in types]
    if unknown:
        named = ", ".join(short_repr(key) for key in unknown[:3])
        named += f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        plural = "s" if len(unknown) > 1 else ""
        raise ValueError(f"unknown key{plural} {named}; the known keys are {', '.join(types)}")
    added_later = getattr(cls, "ADDED_LATER", {})  # fields files written before them lack -> their old values
    missing = [name for name in types if name not in data and name not in added_later]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    fields = {}
    for name, annotation in types.items():
        if name not in data:
            if name in added_later:
                fields[name] = added_later[name]
            continue
        value = data[name]
        if annotation not in _FIELD_CHECKS:
            raise TypeError(f"{cls.__name__}.{name}: no file check for type {annotation}")  # a programming error
        wanted, valid = _FIELD_CHECKS[annotation]
        if not valid(value):
            raise ValueError(f"{name} must be {wanted}, got {short_repr(value)}")
        fields[name] = tuple(value) if isinstance(value, list) else float(value) if annotation == "float" else value
    return fields


def _is_int(value: object) -> bool:
    return type(value) is int  # not bool, float or str


def _is_finite_number(value: object) -> bool:
    if type(value) is int:
        return abs(value) < 2**1000  # float() would overflow beyond
    return type(value) is float and math.isfinite(value)


# Annotation (a string under ``from __future__ import annotations``) -> (what it takes, its check).
_FIELD_CHECKS = {
    "int": ("an integer", _is_int),
    "float": ("a finite number", _is_finite_number),
    "str": ("a string", lambda v: type(v) is str),
    "bool": ("true or false", lambda v: type(v) is bool),
    "tuple[int, ...]": (
        f"a list of at most {MAX_LIST_ITEMS} integers",
        lambda v: isinstance(v, (list, tuple)) and len(v) <= MAX_LIST_ITEMS and all(map(_is_int, v)),
    ),
}


def short_repr(value: object, *, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: values from files go into one-line messages."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int too long to print, a list nested too deep
        return f"an integer of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def make_betas(config: ScheduleConfig) -> torch.Tensor:
    """The beta schedule as a float64 tensor of length T."""
    T = config.num_timesteps
    if config.kind == "linear":
        # Ho et al. 2020; scaled so that T != 1000 still ends with alpha-bar near zero.
        scale = 1000.0 / T
        return torch.linspace(scale * config.beta_start, scale * config.beta_end, T, dtype=torch.float64).clamp(
            max=0.999
        )
    # Nichol & Dhariwal 2021: alpha-bar(t) = f(t) / f(0), f(t) = cos^2(((t / T + s) / (1 + s)) * pi / 2).
    steps = torch.arange(T + 1, dtype=torch.float64) / T
    f = torch.cos((steps + config.cosine_s) / (1.0 + config.cosine_s) * math.pi / 2) ** 2
    alphas_cumprod = f / f[0]
    return (1.0 - alphas_cumprod[1:] / alphas_cumprod[:-1]).clamp(max=0.999)


def check_sampling_steps(sampling_steps: int, num_timesteps: int) -> None:
    """Check a step count (--sampling_steps) is in 1 to T; raises ValueError otherwise."""
    if not 1 <= sampling_steps <= num_timesteps:
        raise ValueError(
            f"sampling steps must be between 1 and {num_timesteps} (the trained timesteps), got {sampling_steps}"
        )


def sampling_timesteps(
    num_timesteps: int,
    num_steps: int,
    *,
    spacing: str = "uniform",
    alphas_cumprod: torch.Tensor | None = None,
    lambda_min: float | None = None,
) -> torch.Tensor:
    """The timesteps a sampler visits, descending and distinct: ``T - 1`` first, ``0`` last (``S >= 2``).

    ``uniform`` spaces them evenly in t (DDPM, DDIM). ``logsnr`` spaces them evenly in
    log-SNR, lambda = log(sqrt(abar) / sqrt(1 - abar)), then takes the nearest timesteps (the
    DPM-Solver authors' choice for low-resolution images; needs ``alphas_cumprod``).
    """
    check_sampling_steps(num_steps, num_timesteps)
    if spacing == "uniform":
        points = torch.linspace(num_timesteps - 1, 0, num_steps, dtype=torch.float64)
        return torch.floor(points + 0.5).long()  # round half up: distinct points for spacing >= 1
    if spacing != "logsnr" or alphas_cumprod is None:
        raise ValueError(f"unknown timestep spacing {spacing!r} (uniform, or logsnr with alphas_cumprod)")
    ac = alphas_cumprod.double()
    neg_lam = -0.5 * torch.log(ac / (1.0 - ac))  # increasing in t
    # With lambda_min the grid starts there instead of at lambda(T - 1); the first step still starts from T - 1.
    start = neg_lam[-1].item() if lambda_min is None else min(neg_lam[-1].item(), -lambda_min)
    targets = torch.linspace(start, neg_lam[0].item(), num_steps, dtype=torch.float64)
    upper = torch.searchsorted(neg_lam, targets).clamp(1, num_timesteps - 1)
    nearer_lower = (targets - neg_lam[upper - 1]) < (neg_lam[upper] - targets)
    timesteps = torch.where(nearer_lower, upper - 1, upper)
    timesteps[-1] = 0
    timesteps[0] = num_timesteps - 1
    # Where log-SNR is steep (small t), several targets share a timestep: keep step i within
    # [S - 1 - i, T - 1 - i] and push duplicates apart upward, so all S are distinct.
    timesteps = torch.minimum(timesteps, num_timesteps - 1 - torch.arange(num_steps))
    for i in range(num_steps - 2, -1, -1):
        timesteps[i] = max(int(timesteps[i]), int(timesteps[i + 1]) + 1)
    return timesteps


def consistency_timesteps(num_timesteps: int, num_steps: int) -> torch.Tensor:
    """The multistep consistency sampler's default timesteps: ``T (S - i) / S - 1`` for i < S, from T - 1
    down, stopping short of t = 0 (a call at t = 0 would only return its input)."""
    check_sampling_steps(num_steps, num_timesteps)
    return torch.tensor([num_timesteps * (num_steps - i) // num_steps - 1 for i in range(num_steps)])


def checked_timesteps(timesteps: object, num_timesteps: int) -> torch.Tensor:
    """Explicit timesteps (a distilled student's): distinct integers in [0, T - 1], descending, as an int64
    tensor. Refused with a one-line ValueError otherwise."""
    values = list(timesteps) if isinstance(timesteps, (list, tuple, torch.Tensor)) else None
    if values is not None and isinstance(timesteps, torch.Tensor):
        values = timesteps.tolist()
    if not values or len(values) > MAX_TIMESTEPS or not all(type(v) is int for v in values):
        raise ValueError(f"timesteps must be a non-empty list of integers, got {short_repr(timesteps)}")
    if any(not 0 <= v < num_timesteps for v in values) or any(a <= b for a, b in zip(values, values[1:])):
        raise ValueError(
            f"timesteps must be distinct, descending and between 0 and {num_timesteps - 1}, got {short_repr(values)}"
        )
    return torch.tensor(values, dtype=torch.int64)


def xstart_coefficients(alphas_cumprod: torch.Tensor, prediction: str) -> dict[str, torch.Tensor]:
    """``x_0 = a * (k_xt * x_t - s * out)`` for a model predicting ``prediction`` (float64 alphas_cumprod in,
    the three coefficients out): the one conversion from what a U-Net predicts to x_0 (module docstring)."""
    ac = alphas_cumprod.double()
    ones = torch.ones_like(ac)
    if prediction == "eps":
        return {"a": (1.0 / ac).sqrt(), "s": (1.0 - ac).sqrt(), "k_xt": ones}
    if prediction == "v":
        return {"a": ac.sqrt(), "s": ((1.0 - ac) / ac).sqrt(), "k_xt": ones}
    if prediction == "x0":
        return {"a": ones, "s": -ones, "k_xt": torch.zeros_like(ac)}
    raise ValueError(f"unknown prediction type {short_repr(prediction)}; choose one of {', '.join(PREDICTIONS)}")


def extract(values: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather ``values[t]`` for a batch of timesteps and shape it to broadcast over ``ndim`` dims."""
    out = values.gather(0, t)
    return out.view(t.shape[0], *([1] * (ndim - 1)))


class NoiseSchedule(nn.Module):
    """Schedule arrays as float32 buffers (standard names; the posterior q(x_{t-1} | x_t, x_0) by its variance and
    mean coefficients), plus q(x_t | x_0) and the predictions of x_0 and eps."""

    def __init__(self, config: ScheduleConfig | None = None) -> None:
        super().__init__()
        self.config = config or ScheduleConfig()
        betas = make_betas(self.config)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        float64 = {
            "betas": betas,
            "alphas_cumprod": alphas_cumprod,
            "sqrt_alphas_cumprod": alphas_cumprod.sqrt(),
            "sqrt_one_minus_alphas_cumprod": (1.0 - alphas_cumprod).sqrt(),
            "snr": alphas_cumprod / (1.0 - alphas_cumprod),  # signal-to-noise ratio of x_t
            "posterior_variance": posterior_variance,
            "posterior_mean_coef1": betas * alphas_cumprod_prev.sqrt() / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * (1.0 - betas).sqrt() / (1.0 - alphas_cumprod),
        }
        for name, value in float64.items():
            self.register_buffer(name, value.float(), persistent=False)

    # Type hints for the buffers registered above.
    betas: torch.Tensor
    alphas_cumprod: torch.Tensor
    sqrt_alphas_cumprod: torch.Tensor
    sqrt_one_minus_alphas_cumprod: torch.Tensor
    snr: torch.Tensor
    posterior_variance: torch.Tensor
    posterior_mean_coef1: torch.Tensor
    posterior_mean_coef2: torch.Tensor

    @property
    def num_timesteps(self) -> int:
        return self.config.num_timesteps

    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Draw x_t ~ q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I) given the noise."""
        n = x_start.ndim
        return (
            extract(self.sqrt_alphas_cumprod, t, n) * x_start
            + extract(self.sqrt_one_minus_alphas_cumprod, t, n) * noise
        )

    def predict_xstart(self, x_t: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x_0 from the U-Net's output ``out`` (what ``config.prediction`` names), as every step computes it."""
        coeffs = xstart_coefficients(self.alphas_cumprod[t].double(), self.config.prediction)
        a, s, k_xt = (coeffs[name].to(x_t.dtype).view(-1, *[1] * (x_t.ndim - 1)) for name in ("a", "s", "k_xt"))
        return a * (k_xt * x_t - s * out)

    def training_target(self, x_start: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the U-Net learns to output at x_t = q_sample(x_start, t, noise): the noise, the velocity
        ``sqrt(abar) eps - sqrt(1 - abar) x_0``, or x_0 itself (``config.prediction``)."""
        if self.config.prediction == "eps":
            return noise
        if self.config.prediction == "x0":
            return x_start
        n = x_start.ndim
        return (
            extract(self.sqrt_alphas_cumprod, t, n) * noise
            - extract(self.sqrt_one_minus_alphas_cumprod, t, n) * x_start
        )

    def loss_weights(self, t: torch.Tensor, *, min_snr_gamma: float) -> torch.Tensor:
        """Min-SNR-gamma weights (Hang et al. 2023) of each timestep's output MSE, for what the U-Net predicts:
        min(SNR, gamma) / SNR for eps, min(SNR, gamma) / (SNR + 1) for v, min(SNR, gamma) for x_0 (each the
        same x_0-space weighting min(SNR, gamma))."""
        snr = self.snr[t]
        clamped = snr.clamp(max=min_snr_gamma)
        return {"eps": clamped / snr, "v": clamped / (snr + 1.0), "x0": clamped}[self.config.prediction]

    def predict_eps_from_xstart(self, x_t: torch.Tensor, t: torch.Tensor, pred_xstart: torch.Tensor) -> torch.Tensor:
        """eps = (x_t - sqrt(abar_t) x_0) / sqrt(1 - abar_t)."""
        n = x_t.ndim
        return (x_t - extract(self.sqrt_alphas_cumprod, t, n) * pred_xstart) / extract(
            self.sqrt_one_minus_alphas_cumprod, t, n
        )

    def make_plan(
        self,
        sampler: str,
        *,
        sampling_steps: int | None = None,
        timesteps: object = None,
        eta: float = 0.0,
        variance_type: str = "fixed_small",
        clip_denoised: bool = True,
        device: torch.device | str | None = None,
    ) -> SamplingPlan:
        """Precompute a sampler's timesteps and per-step coefficients as device tensors.

        ``timesteps`` (descending, distinct) replaces the sampler's own spacing: a distilled student's. The
        plan lives on ``device``, by default where the schedule's buffers are (``.to()`` moved them)."""
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
        if variance_type not in VARIANCE_TYPES:
            raise ValueError(f"unknown variance type {variance_type!r}; choose one of {', '.join(VARIANCE_TYPES)}")
        if not (math.isfinite(eta) and 0.0 <= eta <= 1.0):
            # 0: deterministic DDIM; 1: DDPM's posterior variance; beyond 1 the noise outgrows the step.
            raise ValueError(f"eta must be between 0 (deterministic) and 1 (DDPM's posterior variance), got {eta}")
        if sampler != "ddim" and eta != 0.0:
            raise ValueError(f"eta only applies to the ddim sampler, got eta={eta} with {sampler}")
        if sampling_steps is None:
            sampling_steps = len(timesteps) if timesteps is not None else DEFAULT_SAMPLING_STEPS[sampler]
            sampling_steps = min(sampling_steps or self.num_timesteps, self.num_timesteps)
        check_sampling_steps(sampling_steps, self.num_timesteps)  # the one range check of --sampling_steps
        alphas_cumprod = torch.cumprod(1.0 - make_betas(self.config), dim=0)  # float64
        if timesteps is not None:
            timesteps = checked_timesteps(timesteps, self.num_timesteps)
            if len(timesteps) != sampling_steps:
                raise ValueError(f"{sampling_steps} sampling steps but {len(timesteps)} timesteps")
        elif sampler == "consistency":
            timesteps = consistency_timesteps(self.num_timesteps, sampling_steps)
        elif sampler.startswith("dpm_solver"):
            timesteps = sampling_timesteps(
                self.num_timesteps,
                sampling_steps,
                spacing="logsnr",
                alphas_cumprod=alphas_cumprod,
                lambda_min=DPM_SOLVER_LAMBDA_MIN,
            )
        else:
            timesteps = sampling_timesteps(self.num_timesteps, sampling_steps)
        if sampler == "ddpm":
            columns = _ddpm_coefficients(alphas_cumprod, timesteps, variance_type)
        elif sampler == "ddim":
            columns = _ddim_coefficients(alphas_cumprod, timesteps, eta)
        elif sampler == "consistency":
            columns = _consistency_coefficients(alphas_cumprod, timesteps)
        else:
            columns = _dpm_solver_coefficients(alphas_cumprod, timesteps, stochastic=sampler == "dpm_solver_sde")
        columns.update(xstart_coefficients(alphas_cumprod[timesteps], self.config.prediction))
        coefficients = torch.stack([columns[name] for name in COEFFICIENT_NAMES], dim=1)  # (S, 7) float64
        device = self.betas.device if device is None else device
        return SamplingPlan(
            sampler=sampler,
            timesteps=timesteps.to(device),
            coefficients=coefficients.float().to(device),
            clip_denoised=clip_denoised,
            noise_steps=tuple(bool(s > 0.0) for s in columns["sigma"].tolist()),
        )


def _step_alphas(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha-bar at each visited timestep and at the one after it (1.0 after the last: clean data)."""
    ac_t = alphas_cumprod[timesteps]
    ac_prev = torch.cat([alphas_cumprod[timesteps[1:]], torch.ones(1, dtype=torch.float64)])
    return ac_t, ac_prev


def _ddpm_coefficients(
    alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, variance_type: str
) -> dict[str, torch.Tensor]:
    # The respaced chain has its own betas: beta_i = 1 - abar_t / abar_prev (the originals when S = T).
    ac_t, ac_prev = _step_alphas(alphas_cumprod, timesteps)
    betas = 1.0 - ac_t / ac_prev
    posterior_variance = betas * (1.0 - ac_prev) / (1.0 - ac_t)
    if variance_type == "fixed_small":
        variance = posterior_variance
    else:
        variance = torch.cat([betas[:-1], torch.zeros(1, dtype=torch.float64)])  # no noise into clean data
    return {
        "c_x0": betas * ac_prev.sqrt() / (1.0 - ac_t),  # posterior_mean_coef1
        "c_xt": (1.0 - ac_prev) * (1.0 - betas).sqrt() / (1.0 - ac_t),  # posterior_mean_coef2
        "c_prev": torch.zeros_like(ac_t),
        "sigma": variance.clamp(min=0.0).sqrt(),
    }


def _ddim_coefficients(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, eta: float) -> dict[str, torch.Tensor]:
    # Song et al. 2021, eq. 12: x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev - sigma^2) eps + sigma z,
    # with eps = (x_t - sqrt(abar) x0) / s re-derived from the (clipped) x0, folded into c_x0 and c_xt.
    ac_t, ac_prev = _step_alphas(alphas_cumprod, timesteps)
    sigma = eta * ((1.0 - ac_prev) / (1.0 - ac_t) * (1.0 - ac_t / ac_prev)).sqrt()
    direction = (1.0 - ac_prev - sigma**2).clamp(min=0.0).sqrt()
    noise_scale = (1.0 - ac_t).sqrt()
    return {
        "c_x0": ac_prev.sqrt() - direction * ac_t.sqrt() / noise_scale,
        "c_xt": direction / noise_scale,
        "c_prev": torch.zeros_like(ac_t),
        "sigma": sigma,
    }


def _dpm_solver_coefficients(
    alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, *, stochastic: bool = False
) -> dict[str, torch.Tensor]:
    # Lu et al. 2022, DPM-Solver++(2M) in data prediction, with lambda = log(alpha / sigma), h = lambda_s - lambda_t:
    #   first order (ODE): x_s = (sigma_s / sigma_t) x_t - alpha_s expm1(-h) x0_t
    #   first order (SDE): x_s = (sigma_s / sigma_t) e^-h x_t - alpha_s expm1(-2h) x0_t + sigma_s sqrt(-expm1(-2h)) z
    #   second order: x0_t is replaced by D = (1 + 1 / 2r) x0_t - (1 / 2r) x0_prev, r = h_prev / h.
    # The SDE form ("sde-dpmsolver++" in diffusers) solves the reverse SDE; its noise corrects part of the model's
    # error.
    ac_t, ac_prev = _step_alphas(alphas_cumprod, timesteps)
    num_steps = len(timesteps)
    c_xt = torch.zeros(num_steps, dtype=torch.float64)
    c_x0 = torch.ones(num_steps, dtype=torch.float64)  # the final jump to clean data returns x0
    c_prev = torch.zeros(num_steps, dtype=torch.float64)
    sigma = torch.zeros(num_steps, dtype=torch.float64)
    lam = 0.5 * torch.log(ac_t / (1.0 - ac_t))
    for i in range(num_steps - 1):
        alpha_s, sigma_s, sigma_t = ac_prev[i].sqrt(), (1.0 - ac_prev[i]).sqrt(), (1.0 - ac_t[i]).sqrt()
        h = lam[i + 1] - lam[i]
        if stochastic:
            c_xt[i] = sigma_s / sigma_t * torch.exp(-h)
            c_x0[i] = -alpha_s * torch.expm1(-2.0 * h)
            sigma[i] = sigma_s * (-torch.expm1(-2.0 * h)).sqrt()
        else:
            c_xt[i] = sigma_s / sigma_t
            c_x0[i] = -alpha_s * torch.expm1(-h)
        # Second order once a previous x0 exists; like diffusers' lower_order_final, the step into
        # t = 0 stays first order for short plans (S < 15), where r is small and 1 / 2r large.
        if i > 0 and not (i == num_steps - 2 and num_steps < 15):
            r = (lam[i] - lam[i - 1]) / h
            c_prev[i] = c_x0[i] * -(1.0 / (2.0 * r))
            c_x0[i] = c_x0[i] * (1.0 + 1.0 / (2.0 * r))
    return {"c_xt": c_xt, "c_x0": c_x0, "c_prev": c_prev, "sigma": sigma}


def _consistency_coefficients(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> dict[str, torch.Tensor]:
    # Song et al. 2023, Algorithm 1: x0 predicted, then noised afresh to the next timestep; after the last
    # step (abar_next = 1) the prediction itself.
    ac_t, ac_prev = _step_alphas(alphas_cumprod, timesteps)
    return {
        "c_xt": torch.zeros_like(ac_t),
        "c_x0": ac_prev.sqrt(),
        "c_prev": torch.zeros_like(ac_t),
        "sigma": (1.0 - ac_prev).clamp(min=0.0).sqrt(),
    }


@dataclass(frozen=True)
class SamplingPlan:
    """A sampler's visited timesteps and per-step coefficients, ready on the sampling device.

    ``coefficients`` is ``(S, 7)`` float32 with columns :data:`COEFFICIENT_NAMES`; kernels index
    its rows with a device-side step counter. ``noise_steps[i]`` says (on the host, no sync)
    whether step ``i`` adds noise; noise is drawn for exactly those steps, in order.
    """

    sampler: str
    timesteps: torch.Tensor  # (S,) int64, descending
    coefficients: torch.Tensor  # (S, 7) float32
    clip_denoised: bool
    noise_steps: tuple[bool, ...]

    @property
    def num_steps(self) -> int:
        return len(self.noise_steps)

    @property
    def uses_prev_xstart(self) -> bool:
        return self.sampler.startswith("dpm_solver")

    def column(self, name: str) -> torch.Tensor:
        return self.coefficients[:, COEFFICIENT_NAMES.index(name)]


def p_step(
    plan: SamplingPlan,
    i: int,
    x_t: torch.Tensor,
    eps: torch.Tensor,
    *,
    noise: torch.Tensor | None = None,
    prev_xstart: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One reverse step ``t_i -> t_{i+1}`` in plain PyTorch: the reference for every fused kernel.

    Returns ``(x_prev, pred_xstart)``; arithmetic is float32 whatever the input dtypes.
    """
    a, s, c_xt, c_x0, c_prev, sigma, k_xt = plan.coefficients[i].unbind()  # 0-dim device tensors, no sync
    x_t, eps = x_t.float(), eps.float()
    # Predict x_0 from the model's output (the difference first: well conditioned where abar is tiny);
    # optionally clip. ``eps`` is whatever the model predicts: noise, velocity or x_0.
    pred_xstart = a * (k_xt * x_t - s * eps)
    if plan.clip_denoised:
        pred_xstart = pred_xstart.clamp(-1.0, 1.0)
    # Move to the next timestep (posterior mean / DDIM / DPM-Solver++ combination).
    x_prev = c_xt * x_t + c_x0 * pred_xstart
    if prev_xstart is not None:
        x_prev = x_prev + c_prev * prev_xstart.float()
    # Add sigma * z on stochastic steps.
    if noise is not None:
        x_prev = x_prev + sigma * noise.float()
    return x_prev, pred_xstart


def guided_eps(eps_pair: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance (Ho & Salimans 2022): ``eps_uncond + scale * (eps_cond - eps_uncond)``.

    ``eps_pair`` (2B, ...) is one U-Net pass over the batch twice: conditional rows first, then the
    same rows with the null label. Float32 arithmetic, each operation rounded in this order (the
    fused kernels reproduce it bit for bit). Scale 1 is the conditional eps, 0 the unconditional.
    """
    eps_cond, eps_uncond = eps_pair.float().chunk(2)
    return eps_uncond + scale * (eps_cond - eps_uncond)
