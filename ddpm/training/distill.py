"""Distilling a teacher into a student that samples in 1, 2, 4 or 8 U-Net calls.

    config = DistillConfig(teacher="digits.pt", sampling_steps=4, samples=4096, teacher_steps=32)
    objective = DistillObjective.build(teacher, config, device=device)
    trainer = Trainer(train_config, teacher.model_config, objective.schedule_config, images=None,
                      device=device, objective=objective)   # the training loop of trainer.py

The method (BENCHMARKS.md, "Distillation: how few steps?"):

1. The teacher's probability-flow ODE is solved with DPM-Solver++(2M) from ``samples`` noise draws, on
   a grid that holds the student's timesteps (log-SNR spacing within each segment, ``teacher_steps``
   in all); each trajectory gives the state at every student timestep and its end, a clean image.
   A class-conditional teacher draws each trajectory for a random class with classifier-free guidance
   at ``guidance_scale``: the student learns the guided ODE in one call per step.
2. The student (the teacher's U-Net and EMA weights, predicting velocity v instead) learns to map the
   state at each of its timesteps to that trajectory's end: the consistency function of the teacher's
   ODE (Song et al. 2023), regressed directly, with the loss on v (x_0's error weighted 1 / (1 - abar)).
3. It samples with the multistep consistency sampler (noise_schedule.py): predict x_0, noise it afresh
   to the next timestep, predict again.
4. ``--distill_method`` adds a term against the blur of regressing onto a many-to-one target: ``adversarial``
   (a discriminator) or ``dmd`` (distribution matching), both in distill_losses.py; ``consistency`` instead
   makes each state's target an EMA target network's x_0 at the next solver state.
5. The student's timesteps start at T - 1; the rest sit at the noise levels choices.py lists
   (:func:`spaced_timesteps`), evenly spaced where it lists none.

A resumed run draws the trajectories again, bit for bit, from the teacher, the config and its seed; the config
records the teacher by its content (:func:`teacher_identity`), so a resumed run refuses another teacher.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from basic_diffusion import eps_of, guided_model_eps
from ddpm.choices import (
    ADV_REAL,
    DISTILL_DEFAULTS,
    DISTILL_METHODS,
    NOISE_LEVEL_SIDE,
    STUDENT_NOISE_LEVELS,
    STUDENT_STEPS,
)  # what --distill_method, --adv_real and --sampling_steps offer
from ddpm.conditioning import Guidance
from ddpm.training.distill_losses import Consistency, make_method
from noise_schedule import (
    MAX_GUIDANCE,
    NoiseSchedule,
    ScheduleConfig,
    config_fields,
    consistency_timesteps,
    make_betas,
    p_step,
)

STUDENT_SAMPLER = "consistency"
STUDENT_PREDICTION = "v"  # x_0 from eps is ill-conditioned at the few, noisy timesteps of a student
MAX_SAMPLES = 1 << 20
MAX_TEACHER_STEPS = 1000
MAX_PAIR_BYTES = 4 << 30  # the trajectories are held in memory for the whole run
MAX_METHOD_WEIGHT = 100.0  # --adv_weight and --dmd_weight: beyond it the regression is noise beside the term
TEACHER_BATCH = 256  # trajectories solved together
TEACHER_KINDS = ("checkpoint", "safetensors", "diffusers")  # files holding PyTorch weights a student starts from
SPACINGS = ("noise_levels", "even")  # the student's timesteps (spaced_timesteps)


@dataclass(frozen=True)
class DistillConfig:
    """What a distillation run learns from; a student's checkpoint keeps it (``distill_config``) to resume."""

    teacher: str  # the teacher's path, as given
    sampling_steps: int  # the student's U-Net calls per image (defaults: the flags', ddpm/choices.py)
    samples: int  # teacher trajectories
    teacher_steps: int  # teacher solver steps per trajectory
    guidance_scale: float = 0.0  # a class-conditional teacher's guidance, folded into the student (0: none)
    seed: int = 0
    teacher_sha256: str = ""  # teacher_identity(): its weights and configs ("": a run that predates it)
    method: str = "regression"  # --distill_method: the regression alone, or with distill_losses.py's term
    adv_weight: float = DISTILL_DEFAULTS["adv_weight"]  # --adv_weight (method "adversarial")
    dmd_weight: float = DISTILL_DEFAULTS["dmd_weight"]  # --dmd_weight (method "dmd")
    adv_real: str = "teacher"  # --adv_real: the discriminator's real images, the training data or the ODE ends
    spacing: str = "noise_levels"  # the student's timesteps: choices.STUDENT_NOISE_LEVELS', or "even"
    data_dir: str = ""  # --data_dir as given, where the discriminator's real images come from a folder ("": none)
    data_sha256: str = ""  # those images' content (modes/distill.py's images_identity): what --resume compares

    # Checkpoints written before a field: the values that reproduce their runs (the regression alone; the weights
    # of the terms it has not are any valid number).
    ADDED_LATER = {
        "teacher_sha256": "",
        "method": "regression",
        "adv_weight": DISTILL_DEFAULTS["adv_weight"],
        "dmd_weight": DISTILL_DEFAULTS["dmd_weight"],
        "adv_real": "teacher",
        "spacing": "even",
        "data_dir": "",
        "data_sha256": "",
    }

    def __post_init__(self) -> None:
        if self.sampling_steps not in STUDENT_STEPS:
            steps = ", ".join(map(str, STUDENT_STEPS))
            raise ValueError(f"--sampling_steps for a student must be one of {steps}, got {self.sampling_steps}")
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise ValueError(f"--distill_samples must be between 1 and {MAX_SAMPLES}, got {self.samples}")
        if not self.sampling_steps <= self.teacher_steps <= MAX_TEACHER_STEPS:
            raise ValueError(
                f"--teacher_steps must be between the student's {self.sampling_steps} steps and "
                f"{MAX_TEACHER_STEPS}, got {self.teacher_steps}"
            )
        if not 0.0 <= self.guidance_scale <= MAX_GUIDANCE:  # also False for NaN
            raise ValueError(f"--guidance_scale must be between 0 and {MAX_GUIDANCE:g}, got {self.guidance_scale}")
        if self.method not in DISTILL_METHODS:
            raise ValueError(f"--distill_method must be one of {', '.join(DISTILL_METHODS)}, got {self.method!r}")
        if self.adv_real not in ADV_REAL:
            raise ValueError(f"--adv_real must be one of {', '.join(ADV_REAL)}, got {self.adv_real!r}")
        if self.spacing not in SPACINGS:
            raise ValueError(
                f"the student's timestep spacing must be one of {', '.join(SPACINGS)}, got {self.spacing!r}"
            )
        for flag, weight in (("--adv_weight", self.adv_weight), ("--dmd_weight", self.dmd_weight)):
            if not 0.0 < weight <= MAX_METHOD_WEIGHT:  # also False for NaN
                raise ValueError(f"{flag} must be above 0 and at most {MAX_METHOD_WEIGHT:g}, got {weight:g}")

    @classmethod
    def from_dict(cls, data: object) -> DistillConfig:
        """A checkpoint's ``distill_config``: keys and types checked by the config files' one door
        (noise_schedule.config_fields), the ranges by the class."""
        try:
            return cls(**config_fields(cls, data))
        except ValueError as exc:
            raise ValueError(f"its distillation settings are damaged ({exc})") from None


def teacher_identity(teacher) -> str:
    """The sha256 of a teacher (backends/artifacts.py's Artifact): its U-Net's weights as loaded (EMA), its model
    and schedule configs and its class names, so the same weights under any path or format match."""
    digest = hashlib.sha256()
    configs = {
        "model": teacher.model_config.to_dict(),
        "schedule": asdict(teacher.schedule_config),
        "class_names": list(teacher.class_names),
    }
    digest.update(json.dumps(configs, sort_keys=True, default=str).encode())
    for name, tensor in sorted(teacher.model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def spaced_timesteps(schedule: ScheduleConfig, *, steps: int, spacing: str, side: int) -> tuple[int, ...]:
    """The student's timesteps: t = T - 1, then the timesteps whose noise level sigma = sqrt((1 - abar) / abar) is
    nearest choices.STUDENT_NOISE_LEVELS' for ``steps``, scaled to images ``side`` pixels (or voxels) a side (the
    same noise on any schedule); the even spacing (noise_schedule.consistency_timesteps) for a step count not listed
    there, or ``spacing`` "even"."""
    levels = STUDENT_NOISE_LEVELS.get(steps)
    if spacing == "even" or levels is None:
        return tuple(consistency_timesteps(schedule.num_timesteps, steps).tolist())
    alphas_cumprod = torch.cumprod(1.0 - make_betas(schedule), dim=0)  # float64
    sigma = ((1.0 - alphas_cumprod) / alphas_cumprod).sqrt()
    shift = side / NOISE_LEVEL_SIDE
    nearest = [int((sigma - level * shift).abs().argmin()) for level in levels]
    timesteps = (schedule.num_timesteps - 1, *nearest)
    if any(a <= b for a, b in zip(timesteps, timesteps[1:])):  # a schedule too short to tell the levels apart
        return tuple(consistency_timesteps(schedule.num_timesteps, steps).tolist())
    return timesteps


def student_schedule(teacher: ScheduleConfig, config: DistillConfig, *, side: int) -> ScheduleConfig:
    """The teacher's schedule, predicting v, with the sampler, timesteps and guidance the student records; ``side``:
    the side of what the U-Net draws (its image_size)."""
    timesteps = spaced_timesteps(teacher, steps=config.sampling_steps, spacing=config.spacing, side=side)
    return replace(
        teacher,
        prediction=STUDENT_PREDICTION,
        student_sampler=STUDENT_SAMPLER,
        student_timesteps=timesteps,
        folded_guidance=config.guidance_scale,
    )


def teacher_grid(schedule: ScheduleConfig, student_timesteps: tuple[int, ...], teacher_steps: int) -> list[int]:
    """The teacher solver's timesteps: the student's, and between each and the next (the last: t = 0) points
    spaced evenly in log-SNR, ``teacher_steps`` steps in all (fewer where timesteps run out)."""
    alphas_cumprod = torch.cumprod(1.0 - make_betas(schedule), dim=0)
    neg_lam = -0.5 * torch.log(alphas_cumprod / (1.0 - alphas_cumprod))  # increasing in t
    ends = [*student_timesteps, 0]
    per_segment = max(1, teacher_steps // len(student_timesteps))
    grid = {0, *student_timesteps}
    for high, low in zip(ends, ends[1:]):
        targets = torch.linspace(neg_lam[high].item(), neg_lam[low].item(), per_segment + 1, dtype=torch.float64)
        nearest = torch.searchsorted(neg_lam, targets).clamp(low, high)
        grid.update(int(t) for t in nearest)
    return sorted(grid, reverse=True)


def recorded_timesteps(
    schedule: ScheduleConfig, *, student_timesteps: tuple[int, ...], config: DistillConfig
) -> tuple[int, ...]:
    """The timesteps of the teacher's trajectories the student learns at: its own, or for the consistency method
    every state the solver visits above t = 0 (:func:`teacher_grid` without its last point, 0: the trajectory's
    end x_start stands for the state there, the boundary of the consistency function)."""
    if config.method != "consistency":
        return tuple(student_timesteps)
    return tuple(teacher_grid(schedule, student_timesteps, config.teacher_steps)[:-1])


@dataclass(frozen=True)
class Trajectories:
    """The teacher's ODE at the recorded timesteps: ``x_t`` (N, S, *shape), its end ``x_start`` (N, *shape),
    each trajectory's class (N,) for a class-conditional teacher, and the ``timesteps`` of x_t's second axis
    (descending; (): the student's, as :func:`teacher_trajectories` records by default)."""

    x_t: torch.Tensor
    x_start: torch.Tensor
    labels: torch.Tensor | None
    timesteps: tuple[int, ...] = ()


@torch.no_grad()
def teacher_trajectories(
    teacher: nn.Module,  # in eval mode, as loaded (any callable teacher(x_t, t[, y]) does)
    schedule: NoiseSchedule,
    *,
    config: DistillConfig,
    student_timesteps: tuple[int, ...],
    sample_shape: tuple[int, ...],
    num_classes: int = 0,
    null_label: int = 0,
    clip_denoised: bool = True,
    device: torch.device,
    progress: bool = True,
    record: tuple[int, ...] | None = None,
) -> Trajectories:
    """Solve the teacher's ODE (DPM-Solver++(2M) on :func:`teacher_grid`) from ``config.samples`` seeded noise draws,
    keeping the state at the timesteps ``record`` (points of the grid, descending; default: the student's,
    :func:`recorded_timesteps` says which a method learns from). What is recorded changes no state."""
    grid = teacher_grid(schedule.config, student_timesteps, config.teacher_steps)
    plan = schedule.make_plan("dpm_solver", timesteps=grid, clip_denoised=clip_denoised, device=device)
    kept = tuple(student_timesteps if record is None else record)
    if not set(kept) <= set(grid) or list(kept) != sorted(set(kept), reverse=True):
        raise ValueError(f"the recorded timesteps must be distinct points of the teacher's grid {grid}, got {kept}")
    record_at = {grid.index(t): k for k, t in enumerate(kept)}  # solver step -> recorded timestep
    n, S = config.samples, len(kept)
    x_t = torch.empty((n, S, *sample_shape), device=device)
    x_start = torch.empty((n, *sample_shape), device=device)
    labels = torch.empty(n, dtype=torch.long, device=device) if num_classes else None
    generator = torch.Generator(device).manual_seed(config.seed)
    bar = tqdm(total=n, desc="teacher trajectories", unit="img", disable=not progress, dynamic_ncols=True)
    for start in range(0, n, TEACHER_BATCH):
        rows = slice(start, min(n, start + TEACHER_BATCH))
        b = rows.stop - rows.start
        x = torch.randn((b, *sample_shape), generator=generator, device=device)
        guidance = None
        if num_classes:
            labels[rows] = torch.randint(0, num_classes, (b,), generator=generator, device=device)
            guidance = Guidance(labels=labels[rows], null_label=null_label, scale=config.guidance_scale)
        prev = None
        for i in range(plan.num_steps):
            if i in record_at:
                x_t[rows, record_at[i]] = x
            t = plan.timesteps[i].expand(b)
            out = guided_model_eps(teacher, x, t, guidance)
            x, prev = p_step(plan, i, x, out, prev_xstart=prev if plan.uses_prev_xstart else None)
        x_start[rows] = x
        bar.update(b)
    bar.close()
    return Trajectories(x_t=x_t, x_start=x_start, labels=labels, timesteps=kept)


@dataclass(frozen=True)
class TrajectoryBudget:
    """What the teacher's trajectories cost, estimated before they are drawn."""

    held_bytes: int  # the states and ends (and labels), held for the whole run
    peak_bytes: int  # that, and one teacher batch's activations
    calls: int  # U-Net evaluations (a guided teacher runs each on a doubled batch)
    steps: int  # solver steps per trajectory (teacher_grid's: fewer than asked where timesteps run out)
    seconds: float  # from one timed teacher batch
    available_bytes: int

    def line(self, config: DistillConfig) -> str:
        from ddpm.util.messages import format_bytes, format_seconds

        return (
            f"teacher trajectories: {config.samples:,} x {self.steps} solver steps ({self.calls:,} U-Net "
            f"calls), about {format_seconds(self.seconds)}; {format_bytes(self.held_bytes)} held for the run, "
            f"{format_bytes(self.peak_bytes)} at peak, {format_bytes(self.available_bytes)} available"
        )


def trajectory_budget(
    forward: nn.Module,
    schedule: NoiseSchedule,
    *,
    config: DistillConfig,
    student_timesteps: tuple[int, ...],
    model_config,
    device: torch.device,
    guided: bool,
    record: tuple[int, ...] | None = None,
) -> TrajectoryBudget:
    """The memory and time of :func:`teacher_trajectories` for ``config``, refused (one line naming
    --distill_samples and the most that fit) beyond :data:`MAX_PAIR_BYTES` or the memory available on ``device``.
    ``record``: the timesteps it keeps (default: the student's). The time is one teacher batch, timed, times the
    batches and solver steps to come."""
    from ddpm.batch_memory import ALLOCATOR_OVERHEAD, estimate_peak_bytes
    from ddpm.util.memory import SAFETY_FRACTION, available_bytes

    shape = model_config.sample_shape(1)[1:]
    states = len(student_timesteps if record is None else record) + 1  # the recorded states and the end
    per_sample = states * torch.Size(shape).numel() * 4 + (8 if model_config.num_classes else 0)
    held = config.samples * per_sample
    shape_text = "x".join(map(str, shape))
    if held > MAX_PAIR_BYTES:
        raise ValueError(
            f"--distill_samples {config.samples} trajectories of {shape_text} would hold "
            f"{held / 2**30:.1f} GiB; use at most {MAX_PAIR_BYTES // per_sample}"
        )
    batch = min(TEACHER_BATCH, config.samples)
    unet_batch = 2 * batch if guided else batch
    activations = int(estimate_peak_bytes(model_config, batch_size=unet_batch, training=False) * ALLOCATOR_OVERHEAD)
    available = available_bytes(device)
    budget = int(SAFETY_FRACTION * available)
    if held + activations > budget:
        most = max(0, (budget - activations) // per_sample)
        raise ValueError(
            f"--distill_samples {config.samples} trajectories of {shape_text} need about "
            f"{(held + activations) / 2**30:.1f} GiB on {device.type} (the trajectories, held for the run, and one "
            f"teacher batch) and {available / 2**30:.1f} GiB is available; use at most {most}"
        )
    steps = len(teacher_grid(schedule.config, student_timesteps, config.teacher_steps)) - 1
    batches = -(-config.samples // batch)
    return TrajectoryBudget(
        held_bytes=held,
        peak_bytes=held + activations,
        calls=config.samples * steps,
        steps=steps,
        seconds=_time_one_call(forward, model_config, batch=batch, guided=guided, device=device) * steps * batches,
        available_bytes=available,
    )


def _time_one_call(forward: nn.Module, model_config, *, batch: int, guided: bool, device: torch.device) -> float:
    """Seconds of one teacher step on one batch, as the trajectories run it (util/estimates.py)."""
    from ddpm.util.estimates import seconds_per_call

    x = torch.zeros(model_config.sample_shape(batch), device=device)
    t = torch.full((batch,), 1, device=device, dtype=torch.long)
    guidance = None
    if model_config.num_classes:
        labels = torch.zeros(batch, dtype=torch.long, device=device)
        guidance = Guidance(labels=labels, null_label=model_config.null_label, scale=2.0 if guided else 1.0)
    return seconds_per_call(lambda: guided_model_eps(forward, x, t, guidance), device=device)


class DistillObjective:
    """The student's loss on the teacher's trajectories, for the trainer's loop (trainer.py): the regression, and
    the term of ``config.method`` (distill_losses.py's ``method``: None for the regression alone), which trains
    its own network inside :meth:`loss` and keeps it in :meth:`state_dict` (the checkpoint's objective_state); the
    consistency method's network (its target network) replaces the regression's target instead."""

    def __init__(
        self,
        config: DistillConfig,
        trajectories: Trajectories,
        *,
        schedule_config: ScheduleConfig,
        class_names: tuple[str, ...],
        device: torch.device,
        method=None,
    ) -> None:
        self.config, self.trajectories, self.class_names = config, trajectories, class_names
        self.schedule_config = schedule_config  # the student's
        self.schedule = NoiseSchedule(schedule_config).to(device)
        # The timesteps of the trajectories' states: the student's, or every grid point (the consistency method).
        self.timesteps = torch.tensor(trajectories.timesteps or schedule_config.student_timesteps, device=device)
        if len(self.timesteps) != trajectories.x_t.shape[1]:
            raise ValueError(f"trajectories of {trajectories.x_t.shape[1]} states but {len(self.timesteps)} timesteps")
        self.method = method

    @classmethod
    def build(
        cls,
        teacher,
        config: DistillConfig,
        *,
        device: torch.device,
        clip_denoised: bool,
        progress: bool = True,
        say: Callable[[str], None] | None = None,
        lr: float = DISTILL_DEFAULTS["lr"],
        precision: str = "fp32",
        data=None,
        teacher_forward: nn.Module | None = None,
    ) -> DistillObjective:
        """The objective of distilling ``teacher`` (backends/artifacts.py's Artifact) as ``config`` says: the
        trajectories' budget (:func:`trajectory_budget`, said through ``say``), then the trajectories. ``lr`` and
        ``precision`` (the student's) are those of the network a method trains beside the student; ``data`` (an
        ImageSet) the adversarial method's real images where ``config.adv_real`` is "data"; ``teacher_forward`` the
        teacher's U-Net as the trajectories evaluate it (the mode's choice; None: ``teacher.model``)."""
        model_config = teacher.model_config
        shape = model_config.sample_shape(1)[1:]
        schedule_config = student_schedule(teacher.schedule_config, config, side=model_config.image_size)
        forward = teacher.model if teacher_forward is None else teacher_forward
        schedule = NoiseSchedule(teacher.schedule_config).to(device)
        record = recorded_timesteps(schedule.config, student_timesteps=schedule_config.student_timesteps, config=config)
        budget = trajectory_budget(
            forward,
            schedule,
            config=config,
            student_timesteps=schedule_config.student_timesteps,
            model_config=model_config,
            device=device,
            guided=bool(model_config.num_classes) and config.guidance_scale != 1.0,
            record=record,
        )
        if say is not None:
            say(budget.line(config))
        trajectories = teacher_trajectories(
            forward,
            schedule,
            config=config,
            student_timesteps=schedule_config.student_timesteps,
            sample_shape=shape,
            num_classes=model_config.num_classes,
            null_label=model_config.null_label,
            clip_denoised=clip_denoised,
            device=device,
            progress=progress,
            record=record,
        )
        method = make_method(
            config, teacher, device=device, lr=lr, precision=precision, data=data, clip_denoised=clip_denoised
        )
        return cls(
            config,
            trajectories,
            schedule_config=schedule_config,
            class_names=teacher.class_names,
            device=device,
            method=method,
        )

    def batch(self, batch_size: int, *, generator: torch.Generator, device: torch.device) -> tuple:
        """The whole global batch's draw (every rank draws it, so the generator stays in step): which
        trajectory, and which of its recorded timesteps (the student's; the consistency method's: the grid's,
        uniformly), for each sample; then the method's own draws."""
        n, S = self.trajectories.x_t.shape[:2]
        which = torch.randint(0, n, (batch_size,), generator=generator, device=device)
        step = torch.randint(0, S, (batch_size,), generator=generator, device=device)
        extra = () if self.method is None else self.method.draw(batch_size, generator=generator, device=device)
        return which, step, *extra

    def examples(self, batch: tuple, *, rows: slice, ends: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(x_t, t, labels or None, target) of this rank's rows: each state, its timestep, its class, and the
        student's output that maps the state to its trajectory's end (v for a v-student), or to ``ends`` where
        given (the consistency method's x_0 targets, :meth:`consistency_ends`)."""
        which, step = (part[rows] for part in batch[:2])
        x_t = self.trajectories.x_t[which, step]  # (B / ranks, *shape)
        x_start = self.trajectories.x_start[which] if ends is None else ends
        t = self.timesteps[step]
        y = self.trajectories.labels[which] if self.trajectories.labels is not None else None
        eps = self.schedule.predict_eps_from_xstart(x_t, t, x_start)  # the noise that state holds, given its end
        return x_t, t, y, self.schedule.training_target(x_start, eps, t)

    def consistency_ends(self, forward: nn.Module, batch: tuple, *, rows: slice) -> torch.Tensor:
        """The consistency method's x_0 targets of this rank's rows (B / ranks, *shape), its target network first
        moved toward the student ``forward``: the target's x_0 at the same trajectory's next grid state (less
        noisy), or the trajectory's end after the last state (t = 0: the boundary, f(x, 0) = x)."""
        which, step = (part[rows] for part in batch[:2])
        self.method.follow(forward)
        last = len(self.timesteps) - 1
        following = (step + 1).clamp(max=last)  # the last state's is computed and replaced: the batch keeps its shape
        y = self.trajectories.labels[which] if self.trajectories.labels is not None else None
        x0 = self.method.x0(
            self.trajectories.x_t[which, following], self.timesteps[following], y, schedule=self.schedule
        )
        boundary = (step == last).view(-1, *[1] * (x0.ndim - 1))
        return torch.where(boundary, self.trajectories.x_start[which], x0)

    def loss(self, forward: nn.Module, batch: tuple, *, rows: slice) -> torch.Tensor:
        """MSE between the student's output and :meth:`examples`' target; with a method, its term added (on the
        student's x_0, its network stepped first), or for the consistency method the target its network gives."""
        consistency = isinstance(self.method, Consistency)
        ends = self.consistency_ends(forward, batch, rows=rows) if consistency else None
        x_t, t, y, target = self.examples(batch, rows=rows, ends=ends)
        out = eps_of(forward, x_t, t, y).float()
        regression = F.mse_loss(out, target.float())
        if self.method is None or consistency:
            return regression
        x0 = self.schedule.predict_xstart(x_t.float(), t, out)  # (B / ranks, *shape), differentiable
        x_start = self.trajectories.x_start[batch[0][rows]]  # the teacher's ends: a discriminator's real images
        draws = tuple(part[rows] for part in batch[2:])
        return self.method.loss(regression, out=out, x0=x0, x_start=x_start, y=y, draws=draws)

    def state_dict(self) -> dict:
        """The method's network, optimizer and scaler (the consistency method's: its target network; {} for the
        regression alone): the checkpoint keeps it."""
        return {} if self.method is None else self.method.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.method is not None:
            if not state:
                raise ValueError(f"it holds no state of the {self.config.method} method's network")
            self.method.load_state_dict(state)
