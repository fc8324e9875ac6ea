"""Training a DDPM: AdamW, warm-up + cosine LR, gradient clipping, EMA, mixed precision, checkpoints.

The loop is step-based. The batch of step ``k`` is a function of (seed, k) (see data/datasets.py), and every other
source of randomness (timesteps, noise, dropout) lives in states the checkpoint keeps, so ``--resume`` continues a run
exactly: on a CPU, the same loss curve to the bit.

Under torchrun (distributed.py) every rank draws the whole global batch's timesteps and noise from the same generator
and keeps its own rows; DistributedDataParallel averages the gradients, so N ranks take the same steps as one process
with the same global batch (to float rounding, and without dropout, whose masks each rank draws for its own rows), and
a checkpoint resumes on any number of ranks. Rank 0 alone writes checkpoints, grids and the progress bar.

    trainer = Trainer(train_config, model_config, schedule_config, images=images, device="cpu")
    trainer.run()   # -> writes the checkpoint and sample grids as configured

Distillation (training/distill.py) is another objective of the same loop (``objective=``: a student's loss instead of
the diffusion loss); optimizer, schedule, EMA, clipping, precision, checkpoints, resume, signals and ranks are shared.
"""

from __future__ import annotations

import copy
import math
import signal
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from basic_diffusion import UNet, UNetConfig, per_sample_losses, sample
from ddpm.conditioning import DEFAULT_GUIDANCE, MAX_CLASS_NAME, Guidance, labels_for, valid_class_names
from ddpm.data.datasets import ImageSet
from ddpm.data.image_files import save_grid
from ddpm.formats.checkpoints import FORMAT_VERSION, LINK_KEY, save_checkpoint
from ddpm.kernels.ops import norm_training_available, use_fused_norms, use_seeded_dropout
from ddpm.latent.autoencoder import FirstStage, clips_x0
from ddpm.requests import own_sampling, previews_folder
from ddpm.training import winograd
from ddpm.training.compiled import CompileTrial
from ddpm.training.timestep_sampling import TIMESTEP_SAMPLERS, lr_factor, make_timestep_sampler
from ddpm.util import distributed, messages
from ddpm.util.distributed import Ranks
from ddpm.util.memory import keep_freed_memory
from ddpm.util.messages import TrainingDiverged, first_line
from ddpm.util.phases import phase
from ddpm.util.precision import autocast, check_precision
from ddpm.util.profiling import NullProfiler, Profiler
from noise_schedule import NoiseSchedule, ScheduleConfig, short_repr

if TYPE_CHECKING:
    from ddpm.training.curves import TrainingLog


class Objective(Protocol):
    """What the loop asks of an objective that replaces the noise-prediction loss (training/distill.py's
    DistillObjective, which sits above this loop: it runs a teacher): its settings, the class names its data has, a
    global batch drawn in step on every rank, this rank's loss on its rows of it (which may step a network of the
    objective's own first), and that network's state ({} for none), kept by the checkpoint."""

    config: object  # a dataclass: the checkpoint keeps it (distill_config)
    class_names: tuple[str, ...]

    def batch(self, batch_size: int, *, generator: torch.Generator, device: torch.device) -> tuple: ...

    def loss(self, forward: nn.Module, batch: tuple, *, rows: slice) -> torch.Tensor: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


MAX_CONSECUTIVE_NONFINITE = 20


VOLUME_PREVIEWS = 4  # volumes in a 3-D model's preview PNG (each a row of slices and a projection)


@dataclass(frozen=True)
class TrainConfig:
    dataset: str = "mnist"
    total_steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    min_snr_gamma: float | None = None  # None: the unweighted loss; a number: min-SNR-gamma weighting
    timestep_sampling: str = "uniform"  # which t each sample trains on (timestep_sampling.py)
    precision: str = "fp32"
    compile: bool = False
    seed: int = 0
    checkpoint: str = "checkpoints/mnist.pt"
    save_every: int = 1000
    sample_every: int = 1000
    preview_samples: int = 64
    preview_steps: int = 100  # respaced ancestral DDPM: robust early in training, when ODE samplers stay noisy
    cuda_fast_path: bool = True  # fused AdamW and channels-last on CUDA (off only to measure their effect)
    # A CPU's faster step, each off only to measure its effect (BENCHMARKS.md, "The training step against its peers"):
    # channels-last activations (fp32's, and bf16's with the fused norms); every block's GroupNorm, scale-shift and
    # SiLU through the extension's fused op and its backward (kernels/ops.fused_norm_act); fp32's 3x3 convolutions
    # in Winograd's domain on the maps where this CPU computes them faster (training/winograd.faster_from), and bf16's
    # where fp32 Winograd on bf16 activations beats oneDNN's bf16 (training/winograd.mixed_is_fast).
    cpu_channels_last: bool = True
    cpu_fused_norms: bool = True
    winograd_convs: bool = True
    world_size: int = 1  # processes training together (torchrun); batch_size is the global batch
    cond_drop: float = 0.1  # class-conditional models: share of labels replaced by the null label
    grad_checkpoint: bool = False  # recompute the residual blocks' activations in the backward pass (less memory)

    def per_rank_batch(self) -> int:
        return self.batch_size // self.world_size

    def __post_init__(self) -> None:
        positive = {
            "total steps": self.total_steps,
            "batch size": self.batch_size,
            "preview samples": self.preview_samples,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"learning rate must be positive, got {self.lr}")
        if self.warmup_steps < 0 or self.save_every < 0 or self.sample_every < 0:
            raise ValueError("warm-up steps, --save_every and --sample_every must be >= 0")
        if not 0.0 <= self.ema_decay < 1.0:  # also refuses NaN
            raise ValueError(f"EMA decay must be in [0, 1), got {self.ema_decay}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(f"gradient clipping norm (--grad_clip) must be positive and finite, got {self.grad_clip}")
        if self.min_snr_gamma is not None and not (math.isfinite(self.min_snr_gamma) and self.min_snr_gamma > 0):
            raise ValueError(f"--min_snr_gamma must be positive, got {self.min_snr_gamma}")
        check_precision(self.precision)
        if self.timestep_sampling not in TIMESTEP_SAMPLERS:
            raise ValueError(
                f"unknown timestep sampling {self.timestep_sampling!r}; choose one of {', '.join(TIMESTEP_SAMPLERS)}"
            )
        if not 0.0 <= self.cond_drop <= 1.0:  # also refuses NaN
            raise ValueError(f"--cond_drop must be in [0, 1], got {self.cond_drop}")
        if self.world_size < 1:
            raise ValueError(f"world size must be positive, got {self.world_size}")
        distributed.check_global_batch(self.batch_size, world_size=self.world_size)

    @property
    def samples_dir(self) -> Path:
        return previews_folder(self.checkpoint)


def check_warmup(warmup_steps: int | None, *, run_steps: int | None, run: str | None = None) -> None:
    """--warmup_steps no longer than the run it warms (``run_steps``; ``run`` says where that length comes from,
    default --max_steps): a longer warm-up never reaches --lr, and its cosine decay never starts."""
    if warmup_steps is not None and run_steps is not None and warmup_steps > run_steps:
        raise ValueError(
            f"--warmup_steps {warmup_steps:,} is longer than the run ({run or f'--max_steps {run_steps:,}'}); the "
            "learning rate would never reach --lr: lower it, or leave it out for 5% of the run"
        )


def trains_channels_last(device: torch.device, config: TrainConfig, *, dims: int = 2) -> bool:
    """Whether a run of ``config`` on ``device`` keeps its 2-D activations channels-last: on CUDA with the fast path;
    on a CPU in fp32, and in bf16 eagerly through the fused norms (PyTorch's own channels-last GroupNorm is slow in
    bf16). Module-level, so that the training benchmark names what its default row runs."""
    if dims != 2:
        return False
    if device.type == "cuda":
        return config.cuda_fast_path
    if device.type != "cpu" or not config.cpu_channels_last:
        return False
    return config.precision == "fp32" or (config.precision == "bf16" and trains_fused_norms(device, config))


def trains_fused_norms(device: torch.device, config: TrainConfig) -> bool:
    """Whether a CPU run of ``config`` trains through the extension's fused norms (eager runs whose extension has
    the backward op; compiled runs fuse their own)."""
    return device.type == "cpu" and config.cpu_fused_norms and not config.compile and norm_training_available()


class Trainer:
    """Owns the model, its EMA, the optimizer, LR schedule and grad scaler of one training run."""

    def __init__(
        self,
        config: TrainConfig,
        model_config: UNetConfig,
        schedule_config: ScheduleConfig,
        *,
        images: ImageSet | None,
        device: torch.device | str,
        resume_state: dict | None = None,
        ranks: Ranks | None = None,
        first_stage: FirstStage | None = None,
        objective: Objective | None = None,
    ) -> None:
        self.ranks = ranks or distributed.current()  # (rank, world size): distributed.SINGLE for one process
        # The world size validates the batch split; the checkpoint records it.
        config = replace(config, world_size=self.ranks.world_size)
        self.config, self.model_config, self.schedule_config = config, model_config, schedule_config
        self.images, self.device, self.objective = images, torch.device(device), objective
        self.first_stage = first_stage  # a latent model: ``images`` are latents, previews are decoded
        if objective is None:
            self._check_images(images)
        self.class_names = tuple(objective.class_names if objective is not None else images.class_names)
        if model_config.num_classes and not valid_class_names(self.class_names, num_classes=model_config.num_classes):
            raise ValueError(f"class names must be 1 to {MAX_CLASS_NAME} characters long (the checkpoint stores them)")
        torch.manual_seed(config.seed)  # weight init and dropout
        cuda = self.device.type == "cuda" and config.cuda_fast_path
        nhwc = trains_channels_last(self.device, config, dims=model_config.dims)
        self.memory_format = torch.channels_last if nhwc else torch.contiguous_format
        self.model = UNet(model_config).to(self.device, memory_format=self.memory_format)
        self.model.grad_checkpoint = config.grad_checkpoint
        if self.device.type == "cpu" and not config.compile:
            # torch's CPU dropout draws one variable at a time (kernels/ops.SeededDropout is cheaper); compiled, the
            # op's integer seed would break the graph and vary its shapes each step, and Inductor fuses its own.
            use_seeded_dropout(self.model)
            # Every step frees and reallocates the same activations: without this, glibc hands them back to the
            # kernel and the next step page-faults them in again (util/memory.py).
            keep_freed_memory()
        self.ema = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.fused_norms, self.winograd = False, ""  # what _use_cpu_kernels swapped in (or a failed compile's fallback)
        if not config.compile:
            self._use_cpu_kernels(nhwc=nhwc)
        self.schedule = NoiseSchedule(schedule_config).to(self.device)
        # Fused AdamW: one kernel per tensor instead of ~10 per-tensor ops each
        # (BENCHMARKS.md, "A faster CPU training step").
        fused = cuda or self.device.type == "cpu" or None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=fused
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.generator = torch.Generator(self.device).manual_seed(config.seed)  # timesteps and noise
        self.timesteps = make_timestep_sampler(config.timestep_sampling, num_timesteps=schedule_config.num_timesteps)
        wrapped = self.model
        if self.ranks.distributed:  # gradients averaged over the ranks during backward
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.forward = wrapped
        self.compile_trial = None  # settled by the first step
        if config.compile:  # eager after a failed compile: with the CPU's seeded dropout, as without --compile
            cpu = self.device.type == "cpu"
            self.compile_trial = CompileTrial(wrapped, on_fallback=lambda: cpu and self._eager_fallback(nhwc=nhwc))
            self.forward = self.compile_trial.compiled
        self.stop_requested = False  # a rank was asked to stop (Ctrl-C, SIGTERM): every rank stops after this step
        self.step = 0
        self.grad_norm = math.nan  # the last step's gradient norm, before clipping (for the training curves)
        if resume_state is not None:
            self._restore(resume_state)
        self._take_tensor_lists()

    def _take_tensor_lists(self) -> None:
        """The tensors each step walks (clipping, the EMA), listed once, since walking the modules costs time."""
        self.params = list(self.model.parameters())
        self.ema_params = list(self.ema.parameters())
        self.buffer_pairs = list(zip(self.ema.buffers(), self.model.buffers()))

    def _check_images(self, images: ImageSet) -> None:
        model_config = self.model_config
        data_shape, model_shape = tuple(images.images.shape[1:]), model_config.sample_shape(1)[1:]
        if data_shape != model_shape:
            raise ValueError(
                f"the data are {'x'.join(map(str, data_shape))} but the model expects {'x'.join(map(str, model_shape))}"
            )
        if model_config.num_classes and (images.labels is None or len(images.class_names) != model_config.num_classes):
            found = f"{len(images.class_names)} classes" if images.labels is not None else "no classes"
            raise ValueError(
                f"a model of {model_config.num_classes} classes cannot train on {images.name} data with {found}"
            )

    # ----- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        objective_state = self.objective.state_dict() if self.objective is not None else {}
        return {
            "format_version": FORMAT_VERSION,
            "model_config": self.model_config.to_dict(),
            "schedule_config": asdict(self.schedule_config),
            "train_config": asdict(self.config),
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.scaler.state_dict(),
            "step": self.step,
            "timestep_sampler": self.timesteps.state_dict(),
            "class_names": list(self.class_names) if self.model_config.num_classes else [],
            **({"distill_config": asdict(self.objective.config)} if self.objective is not None else {}),
            **({"objective_state": objective_state} if objective_state else {}),  # a distill method's network
            **({LINK_KEY: self.first_stage.link} if self.first_stage is not None else {}),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "generator": self.generator.get_state(),
                "device": self.device.type,
            },
        }

    def _restore(self, state: dict) -> None:
        check_resumable(state, optimizer=self.optimizer, generator=self.generator, source=self.config.checkpoint)
        saved_on = state["rng"].get("device", self.device.type)
        if saved_on != self.device.type:
            raise ValueError(
                f"this run was trained on {saved_on}; resume it there (--device {saved_on}) to continue it exactly"
            )
        try:
            self.model.load_state_dict(state["model"])
            self.ema.load_state_dict(state["ema"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["grad_scaler"])
            if "timestep_sampler" in state:  # checkpoints before it existed trained with uniform t
                self.timesteps.load_state_dict(state["timestep_sampler"])
            if self.objective is not None:
                self.objective.load_state_dict(state.get("objective_state", {}))
            rng = state["rng"]
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            self.generator.set_state(rng["generator"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ValueError(f"cannot resume from this checkpoint: {str(exc).splitlines()[0]}") from exc
        self.step = int(state["step"])

    def save(self) -> Path:
        """Write the checkpoint (rank 0; the other ranks hold the same weights and only check them)."""
        # sync: one check that no weight is NaN/inf before anything reaches the disk.
        tensors = self.params + self.ema_params
        if not bool(torch.stack([t.isfinite().all() for t in tensors]).all()):
            raise TrainingDiverged("the weights hold NaN or inf; the checkpoint was not written")
        if not self.ranks.is_main:
            return Path(self.config.checkpoint)
        return save_checkpoint(self.config.checkpoint, self.state_dict())

    def write_samples(self) -> Path:
        """A grid from the EMA weights with a fixed seed, so grids of successive steps compare."""
        clip = clips_x0(True, self.first_stage)
        # The model's own sampling (a distilled student's sampler and timesteps), else DDPM in preview_steps.
        sampler, timesteps = own_sampling(self.schedule_config, sampler=None, sampling_steps=None, default="ddpm")
        plan = self.schedule.make_plan(
            sampler,
            sampling_steps=None if timesteps else min(self.config.preview_steps, self.schedule.num_timesteps),
            timesteps=timesteps,
            clip_denoised=clip,
            device=self.device,
        )
        gen = torch.Generator(self.device).manual_seed(self.config.seed)
        n, guidance, columns = self.config.preview_samples, None, None
        if self.model_config.num_classes:  # one row per class, guided as sampling is by default
            classes = self.model_config.num_classes
            columns = max(1, math.ceil(n / classes))
            n = columns * classes
            labels = labels_for(list(range(classes)), n=n).to(self.device)
            scale = 1.0 if self.schedule_config.folded_guidance else DEFAULT_GUIDANCE  # a student's is folded in
            guidance = Guidance(labels=labels, null_label=self.model_config.null_label, scale=scale)
        if self.model_config.dims == 3:
            n = min(n, VOLUME_PREVIEWS)  # a volume costs what 32^3 / 28^2 MNIST images do
        images = sample(self.ema, plan, shape=self.model_config.sample_shape(n), generator=gen, guidance=guidance)
        if self.first_stage is not None:
            with torch.no_grad():
                images = self.first_stage.decoder(images)  # latents -> (n, C, H, W) images (loaded on self.device)
        path = self.config.samples_dir / f"step_{self.step:07d}.png"
        return save_grid(images, path, columns=columns)

    def _use_cpu_kernels(self, *, nhwc: bool) -> None:
        """An eager channels-last CPU step's norms through the extension (GroupNorm, scale-shift and SiLU in one pass
        each way) and its 3x3 convolutions in Winograd's domain where this CPU computes them faster (in fp32, and bf16
        where winograd.mixed_is_fast): the model's only, after the EMA's copy, which exports and previews read plain."""
        eager = replace(self.config, compile=False)  # after a failed --compile too
        if nhwc and trains_fused_norms(self.device, eager):
            self.fused_norms = use_fused_norms(self.model, float32_softmax=eager.precision == "bf16") > 0
        largest = self.model_config.image_size // self.model_config.patch_size  # the first level's maps
        side = winograd.trained_from(precision=eager.precision, enabled=eager.winograd_convs, largest=largest)
        if nhwc and self.device.type == "cpu" and side is not None:
            self.winograd = winograd.use_cpu_convs(self.model, side=side, precision=eager.precision)

    def _eager_fallback(self, *, nhwc: bool) -> None:
        """What a failed --compile's eager step trains through on a CPU: as an eager run's."""
        use_seeded_dropout(self.model)
        self._use_cpu_kernels(nhwc=nhwc)
        self._take_tensor_lists()

    @property
    def step_layout(self) -> str:
        """The run's first line on the step's layout, e.g. "channels-last with fused norms", "" for NCHW."""
        if self.memory_format != torch.channels_last:
            return ""
        layout = "channels-last with fused norms" if self.fused_norms else "channels-last"
        return f"{layout}, {self.winograd}" if self.winograd else layout

    # ----- the loop ------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The LR schedule is a function of the step (and the config), so the checkpoint's step restores it."""
        cfg = self.config
        return cfg.lr * lr_factor(self.step, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps)

    def _diffusion_loss(self, mine: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows' DDPM loss: (loss, the global batch's t, its per-sample losses for the timestep sampler)."""
        cfg = self.config
        with phase("data"):
            x_start, labels = self.images.batch_with_labels(
                self.step, batch_size=cfg.batch_size, seed=cfg.seed, device=self.device, rows=mine
            )
            x_start = x_start.contiguous(memory_format=self.memory_format)  # (B / ranks, C, H, W)
            # Timesteps, then noise, for the whole global batch on every rank (the generator stays in step across
            # ranks); each rank keeps its rows. t from the timestep sampler, each draw weighted to keep the expectation.
            t, weights = self.timesteps.sample(cfg.batch_size, generator=self.generator, device=self.device)
            noise = torch.randn(
                (cfg.batch_size, *x_start.shape[1:]), device=self.device, generator=self.generator, dtype=x_start.dtype
            )
            y = None
            if self.model_config.num_classes:  # classifier-free guidance: some labels become the null label
                drop = torch.rand(cfg.batch_size, device=self.device, generator=self.generator) < cfg.cond_drop
                y = torch.where(drop[mine], self.model_config.null_label, labels)  # (B / ranks,)
        # Forward, in the chosen precision: the weighted mean of the per-sample losses.
        with phase("forward"), autocast(self.device.type, cfg.precision):
            losses = per_sample_losses(
                self.forward, self.schedule, x_start, t[mine], noise=noise[mine], y=y, min_snr_gamma=cfg.min_snr_gamma
            )  # (B / ranks,)
            loss = (weights[mine] * losses).mean()
        return loss, t, losses

    def train_step(self) -> float:
        """One optimizer step on the batch of ``self.step``; returns the loss (NaN if skipped)."""
        if self.compile_trial is not None and self.compile_trial.pending:  # compiles, or falls back in one line
            return self.compile_trial.first_step(self)
        return self.one_step()

    def one_step(self) -> float:
        """train_step through ``self.forward`` as it is (compiled or eager)."""
        cfg, ranks = self.config, self.ranks
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        mine = ranks.share(cfg.batch_size)  # this rank's rows of the global batch (all of them for one process)
        if not self.model.training:  # set once: walking the modules each step costs time
            self.model.train()
        if self.objective is not None:
            with phase("data"):
                batch = self.objective.batch(cfg.batch_size, generator=self.generator, device=self.device)
            with phase("forward"), autocast(self.device.type, cfg.precision):
                loss = self.objective.loss(self.forward, batch, rows=mine)
        else:
            loss, t, losses = self._diffusion_loss(mine)
        with phase("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
        with phase("optimizer"):
            # Clip gradients (after unscaling fp16 gradients).
            self.scaler.unscale_(self.optimizer)
            grad_norm = nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            # sync: read the loss and check loss and gradients are finite before they touch the weights. With
            # ranks, the same all-reduce averages the loss and says whether any rank was asked to stop, so all
            # ranks take the same decisions (the gradients, and so their norm, are the same on every rank).
            stop = float(messages.pending() or 0) if ranks.distributed else 0.0
            stats = torch.stack([loss.detach().float(), grad_norm.float(), loss.new_tensor(stop, dtype=torch.float32)])
            loss_value, norm_value, stop = (
                distributed.all_reduce_sum(stats, ranks=ranks).div_(ranks.world_size).tolist()
            )
            self.grad_norm = norm_value
            self.stop_requested = stop > 0
            finite = math.isfinite(loss_value) and math.isfinite(norm_value)
            if finite:
                self.scaler.step(self.optimizer)
                self._update_ema()
        if self.objective is None and self.timesteps.name != "uniform" and finite:
            global_losses = distributed.all_gather_rows(losses.detach(), ranks=ranks)  # (B,), in rank order
            self.timesteps.update(t, global_losses)  # sync inside: the per-timestep history lives on the CPU
        self.scaler.update()  # with fp16, an overflowing gradient lowers the scale (the step is skipped)
        self.step += 1
        scaler_backoff = self.scaler.is_enabled() and math.isfinite(loss_value)
        return loss_value if finite or scaler_backoff else math.nan

    @torch.no_grad()
    def _update_ema(self) -> None:
        # Warm the decay up so short runs still get a useful average (Tensorflow's EMA num_updates).
        decay = min(self.config.ema_decay, (1 + self.step) / (10 + self.step))
        torch._foreach_lerp_(self.ema_params, self.params, 1.0 - decay)
        for ema_buf, buf in self.buffer_pairs:
            ema_buf.copy_(buf)

    def run(
        self,
        *,
        until_step: int | None = None,
        progress: bool = True,
        profiler: Profiler | NullProfiler | None = None,
        curves: TrainingLog | None = None,
    ) -> list[float]:
        """Train up to ``until_step`` (default: the end); save and sample as configured. Returns losses. With a
        ``profiler`` (profiling.py) each step is one profiler step, its phases named ranges; with ``curves``
        (curves.py; rank 0's) every step's loss, LR, gradient norm, time and preview grid are recorded (the caller
        closes it)."""
        cfg = self.config
        end = min(cfg.total_steps, until_step if until_step is not None else cfg.total_steps)
        losses, bad_in_a_row, smoothed = [], 0, None
        shown = progress and self.ranks.is_main
        bar = tqdm(total=end, initial=self.step, desc="training", unit="step", disable=not shown, dynamic_ncols=True)
        profiler = profiler or NullProfiler()
        window_start, window_steps = time.perf_counter(), 0
        # Ctrl-C and SIGTERM take effect between steps, so a checkpoint saved on interrupt is a whole step's state.
        try:
            with messages.deferred():
                while self.step < end:
                    if not self.ranks.distributed:  # ranks stop together, after the step that reports the signal
                        messages.raise_if_pending()
                    lr, started = self.lr, time.perf_counter()  # the rate this step trains with
                    loss = self.train_step()
                    seconds = time.perf_counter() - started  # the step's real time: train_step ends in its sync
                    profiler.step()
                    losses.append(loss)
                    if curves is not None and self.ranks.is_main:  # no sync of its own: train_step read loss and norm
                        images = cfg.batch_size
                        curves.add_step(
                            self.step, loss=loss, lr=lr, grad_norm=self.grad_norm, images=images, seconds=seconds
                        )
                    if math.isfinite(loss):
                        bad_in_a_row = 0
                        smoothed = loss if smoothed is None else 0.98 * smoothed + 0.02 * loss
                    else:
                        bad_in_a_row += 1
                        if self.ranks.is_main:  # every rank saw the same (averaged) loss
                            bar.write(f"step {self.step}: non-finite loss, update skipped")
                        if bad_in_a_row >= MAX_CONSECUTIVE_NONFINITE:
                            raise TrainingDiverged(
                                f"the loss was non-finite for {bad_in_a_row} steps in a row at step {self.step}; "
                                "try a lower --lr or --precision fp32 (the last good checkpoint is kept)"
                            )
                    window_steps += 1
                    bar.update(1)
                    elapsed = time.perf_counter() - window_start
                    if elapsed > 1.0 or self.step == end:
                        bar.set_postfix(
                            loss=f"{smoothed:.4f}" if smoothed is not None else "nan",
                            img_s=f"{window_steps * cfg.batch_size / elapsed:.0f}",
                            lr=f"{self.lr:.2e}",
                        )
                        window_start, window_steps = time.perf_counter(), 0
                    if self.stop_requested:  # this rank's own signal, or another rank's
                        messages.raise_if_pending()
                        raise messages.Interrupted(signal.SIGTERM)
                    at_end = self.step == cfg.total_steps
                    if at_end or (cfg.save_every and self.step % cfg.save_every == 0):
                        self.save()
                    sample_now = at_end or (cfg.sample_every and self.step % cfg.sample_every == 0)
                    if sample_now and self.ranks.is_main:  # the other ranks wait for rank 0 in the next step
                        grid = self.write_samples()
                        bar.write(f"step {self.step}: samples in {grid}")
                        if curves is not None:
                            curves.image(self.step, "samples", grid)
        finally:
            bar.close()
        skipped = sum(not math.isfinite(loss) for loss in losses)
        if 2 * skipped > len(losses):
            raise TrainingDiverged(
                f"{skipped} of the {len(losses)} steps of this run were skipped as non-finite, so the checkpoint "
                "learned little; try a lower --lr or --precision fp32"
            )
        return losses


def resume_config(state: dict, **overrides) -> TrainConfig:
    """The stored training config of a checkpoint, with the given fields replaced; every field checked for its
    kind first (a crafted file ends in one line naming the field, for --resume)."""
    source = overrides.get("checkpoint") or "this checkpoint"
    if "train_config" not in state:
        raise ValueError(
            f"{source} holds no train_config, so --resume cannot continue it (--mode train writes one into every "
            "checkpoint; start a new run with --overwrite, or train from it with --init_from)"
        )
    try:
        stored = TrainConfig(**typed_fields(TrainConfig, state["train_config"]))
    except ValueError as exc:
        raise ValueError(f"{source} cannot be resumed: its train_config is unusable ({first_line(exc)})") from exc
    # How the step computes (switches only a benchmark turns off) is this version's; what the run learns is the file's.
    switches = ("cuda_fast_path", "cpu_channels_last", "cpu_fused_norms", "winograd_convs")
    step = {k: getattr(TrainConfig, k) for k in switches}
    return replace(stored, **step, **{k: v for k, v in overrides.items() if v is not None})


_FIELD_KINDS = {  # a TrainConfig annotation -> (what it must be, the check)
    "int": ("an integer", lambda v: type(v) is int),
    "float": ("a finite number", lambda v: type(v) in (int, float) and math.isfinite(v)),
    "float | None": ("a finite number or null", lambda v: v is None or (type(v) in (int, float) and math.isfinite(v))),
    "str": ("a string", lambda v: type(v) is str and len(v) <= 4096),
    "bool": ("true or false", lambda v: type(v) is bool),
}


def typed_fields(cls: type, data: object) -> dict:
    """The fields of the config dataclass ``cls`` (TrainConfig) that ``data`` holds, each of its kind; ValueError
    naming the first unknown or mistyped one (a missing one takes the class's default)."""
    if not isinstance(data, dict):
        raise ValueError(f"a {type(data).__name__} instead of a dict of settings")
    kinds = {field.name: field.type for field in fields(cls)}
    for key, value in data.items():
        if key not in kinds:
            raise ValueError(f"unknown key {short_repr(key)}")
        wanted, valid = _FIELD_KINDS[kinds[key]]
        if not valid(value):
            raise ValueError(f"{key} must be {wanted}, got {short_repr(value)}")
    return data


def check_resumable(state: dict, *, optimizer: torch.optim.Optimizer, generator: torch.Generator, source) -> None:
    """Every field of a checkpoint that --resume restores besides the weights (load_state_dict checks those), checked
    for its kind and shape against this run's own: the RNG states, AdamW's state and groups, the grad scaler and the
    timestep sampler. ValueError in one line naming the checkpoint and the field."""

    def refuse(field: str, problem: str) -> ValueError:
        return ValueError(f"{source} cannot be resumed: its {field} {problem}")

    def byte_state(field: str, value: object, like: torch.Tensor) -> None:
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.shape == like.shape):
            got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "a "
            got += "" if isinstance(value, torch.Tensor) else type(value).__name__
            raise refuse(field, f"is {got}, not a uint8 RNG state of shape {tuple(like.shape)}")

    rng = state.get("rng")
    if not isinstance(rng, dict) or not {"torch", "cuda", "generator"} <= set(rng) <= {
        "torch",
        "cuda",
        "generator",
        "device",
    }:
        raise refuse("rng", "is not the RNG states this tool saves (torch, cuda, generator, device)")
    byte_state("rng.torch", rng["torch"], torch.get_rng_state())
    byte_state("rng.generator", rng["generator"], generator.get_state())
    if rng.get("device", "cpu") not in ("cpu", "cuda", "mps", "xpu"):  # checkpoints before it was saved lack it
        raise refuse("rng.device", f"is {short_repr(rng['device'])}, not a device type")
    cuda = rng["cuda"]
    if not isinstance(cuda, list) or len(cuda) > 1024:
        raise refuse("rng.cuda", "is not a list of CUDA RNG states")
    for i, value in enumerate(cuda):
        like = torch.cuda.get_rng_state(i) if torch.cuda.is_available() and i < torch.cuda.device_count() else value
        byte_state(f"rng.cuda[{i}]", value, like if isinstance(like, torch.Tensor) else torch.empty(0))
    _check_optimizer(state.get("optimizer"), optimizer=optimizer, refuse=refuse)
    scaler = state.get("grad_scaler")
    if not isinstance(scaler, dict) or not all(
        isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) for k, v in scaler.items()
    ):
        raise refuse("grad_scaler", "is not a dict of finite numbers")
    sampler = state.get("timestep_sampler", {})
    # Its buffers: running losses (floats) and counts (integers); their shapes are checked when they are loaded.
    if not isinstance(sampler, dict) or any(
        isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all() for v in sampler.values()
    ):
        raise refuse("timestep_sampler", "is not a state of finite tensors")


def _check_optimizer(saved: object, *, optimizer: torch.optim.Optimizer, refuse) -> None:
    """A saved AdamW state against ``optimizer``'s: the same groups (their settings of the same kinds, the same
    parameters) and, per parameter, a scalar step and moments of the parameter's shape."""
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise refuse("optimizer", "is not an optimizer state (state and param_groups)")
    ours = optimizer.state_dict()["param_groups"]
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(ours):
        raise refuse("optimizer.param_groups", f"is not a list of {len(ours)} parameter group(s)")
    for i, (group, mine) in enumerate(zip(groups, ours)):
        # Flags a newer torch added may be missing from an older file (AdamW's __setstate__ fills them in); the
        # numbers every step reads may not.
        core = {"params", "lr", "betas", "eps", "weight_decay"} & set(mine)
        if not isinstance(group, dict) or not core <= set(group) <= set(mine):
            raise refuse(f"optimizer.param_groups[{i}]", f"does not hold AdamW's settings ({', '.join(sorted(mine))})")
        for key, value in group.items():
            ref = mine[key]
            if key == "params":
                ok = value == ref
            elif isinstance(ref, bool) or ref is None:
                ok = value is None or isinstance(value, bool)
            elif isinstance(ref, (int, float)):
                ok = type(value) in (int, float) and math.isfinite(value)
            else:  # betas
                ok = isinstance(value, (tuple, list)) and len(value) == len(ref)
                ok = ok and all(type(v) in (int, float) and math.isfinite(v) for v in value)
            if not ok:
                raise refuse(f"optimizer.param_groups[{i}].{key}", f"is {short_repr(value)}, unlike AdamW's {ref!r}")
    shapes = {index: p.shape for group in optimizer.param_groups for index, p in enumerate(group["params"])}
    moments = {"step", "exp_avg", "exp_avg_sq"}
    if not isinstance(saved["state"], dict):
        raise refuse("optimizer.state", "is not a dict of parameter states")
    for index, entry in saved["state"].items():
        field = f"optimizer.state[{short_repr(index)}]"
        if index not in shapes:
            raise refuse(field, f"names no parameter of this model (it has {len(shapes)})")
        if not isinstance(entry, dict) or set(entry) != moments:
            raise refuse(field, f"does not hold AdamW's {', '.join(sorted(moments))}")
        for key, value in entry.items():
            shape = () if key == "step" else shapes[index]
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.shape == shape):
                got = (
                    f"of shape {tuple(value.shape)} ({value.dtype})"
                    if isinstance(value, torch.Tensor)
                    else "not a tensor"
                )
                raise refuse(f"{field}.{key}", f"is {got}, not float32 of shape {tuple(shape)}")
            if not torch.isfinite(value).all():
                raise refuse(f"{field}.{key}", "holds NaN or inf")
