"""The terms --distill_method adds to distillation's regression (training/distill.py), or the target it gives it,
each with the network it keeps beside the student for the run only (a student stays a normal model file).

    method = make_method(config, teacher, device=device, lr=1e-4, precision="fp32")   # None for "regression"
    loss = method.loss(regression, out=v, x0=x0, x_start=ends, y=labels, draws=draws)  # steps its own network

* ``adversarial``: a small discriminator (:class:`Discriminator`) learns to tell real images (``--adv_real``:
  the teacher's training data or its ODE ends) from the student's x_0 with the non-saturating loss; the student
  adds ``--adv_weight`` x VQGAN's adaptive weight (taken at the student's output) x softplus(-D(x_0)).
* ``dmd`` (Distribution Matching Distillation, Yin et al. 2023, arXiv 2311.18828; DMD2, arXiv 2405.14867): a
  "fake score" copy of the teacher's U-Net learns the student's x_0; the student moves along
  :func:`matching_gradient` (fake minus real score), weighted by ``--dmd_weight`` beside the regression.
* ``consistency`` (Song et al. 2023, arXiv 2303.01469): no term; the regression's target becomes the x_0 that a
  target network theta^- (:class:`Consistency`, an EMA of the student) predicts at the trajectory's next, less
  noisy state, or the trajectory's end at t = 0.

Each trained network has its own Adam optimizer at the student's --lr, stepped inside :meth:`loss` once per
student step; its state is the checkpoint's ``objective_state`` (trainer.py), so --resume continues it. Under
torchrun every rank holds the same network, and its random draws come from the global batch (:meth:`draw`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from basic_diffusion import eps_of, guided_model_eps
from ddpm.conditioning import Guidance
from ddpm.util import distributed
from noise_schedule import NoiseSchedule

AUX_GRAD_CLIP = 1.0  # the auxiliary networks' gradient norm, clipped
MAX_ADAPTIVE_WEIGHT = 1e4  # VQGAN's bound on the adaptive weight (a vanishing GAN gradient)
DMD_T_RANGE = (0.02, 0.98)  # the share of the timesteps the distribution-matching gradient noises x_0 to (DMD2's)
DISCRIMINATOR_WIDTH = (32, 128)  # its first and widest layers' channels
# The consistency method's target network: theta^- <- mu theta^- + (1 - mu) theta once per student step (Song et
# al. 2023's mu); trailing the student keeps the bootstrapped target from chasing it.
TARGET_EMA = 0.95


class Discriminator(nn.Module):
    """A small convolutional critic of x_0 (2-D or 3-D, any channels): a 3x3 stem, then stride-2 4x4
    convolutions after GroupNorm and SiLU while the side is above 4 (28 -> 14 -> 7 -> 3, 8 -> 4), channels
    doubling to 128; the mean over positions gives one logit per sample. A class-conditional teacher's labels
    enter by projection (Miyato & Koyama 2018): the logit adds <embedding(y), features>."""

    def __init__(self, *, sample_shape: tuple[int, ...], num_classes: int = 0) -> None:
        super().__init__()
        channels, *spatial = sample_shape
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[len(spatial)]
        width, widest = DISCRIMINATOR_WIDTH
        layers: list[nn.Module] = [conv(channels, width, 3, padding=1)]
        side = min(spatial)
        while side > 4:
            wider = min(2 * width, widest)
            layers += [nn.GroupNorm(8, width), nn.SiLU(), conv(width, wider, 4, stride=2, padding=1)]
            width, side = wider, side // 2
        layers += [nn.GroupNorm(8, width), nn.SiLU()]
        self.features = nn.Sequential(*layers)
        self.logit = nn.Linear(width, 1)
        self.embedding = nn.Embedding(num_classes, width) if num_classes else None

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) logits: above 0 says "a teacher's image"."""
        h = self.features(x).flatten(2).mean(2)  # (B, width)
        logit = self.logit(h).squeeze(1)
        if self.embedding is not None and y is not None:
            logit = logit + (self.embedding(y) * h).sum(1)
        return logit


class AuxiliaryStep:
    """One network's optimizer step inside the student's loss: its gradients (averaged over the ranks), clipped,
    through a loss scaler under fp16; a non-finite gradient skips the step."""

    def __init__(self, network: nn.Module, *, lr: float, betas: tuple[float, float], fp16: bool, device) -> None:
        self.network = network
        self.params = list(network.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=lr, betas=betas)
        self.scaler = torch.amp.GradScaler(torch.device(device).type, enabled=fp16)

    def __call__(self, loss: torch.Tensor) -> None:
        ranks = distributed.current()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(loss.device.type, enabled=False):  # the backward outside the student's autocast
            self.scaler.scale(loss).backward()
        if ranks.distributed:  # every rank's network stays the same: the gradient of the global batch's loss
            for p in self.params:
                if p.grad is not None:
                    distributed.all_reduce_sum(p.grad, ranks=ranks).div_(ranks.world_size)
        self.scaler.unscale_(self.optimizer)
        norm = nn.utils.clip_grad_norm_(self.params, AUX_GRAD_CLIP)
        if self.scaler.is_enabled() or bool(norm.isfinite()):  # sync: a NaN step would poison the network
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient held between steps (a fake score's: a U-Net's worth)

    def state_dict(self) -> dict:
        return {
            "network": self.network.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.network.load_state_dict(state["network"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["grad_scaler"])


def adaptive_weight(regression: torch.Tensor, term: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """|d regression / d out| / |d term / d out| over the global batch (VQGAN's balance, at the student's output
    ``out``: no parameter's gradient is taken, so DistributedDataParallel sees one backward), detached."""
    (g_regression,) = torch.autograd.grad(regression, out, retain_graph=True)
    (g_term,) = torch.autograd.grad(term, out, retain_graph=True)
    squares = torch.stack([g_regression.float().square().sum(), g_term.float().square().sum()])
    distributed.all_reduce_sum(squares)  # each rank's rows: the global batch's norms (their ratio is one process's)
    norms = squares.sqrt()
    return (norms[0] / norms[1].clamp_min(1e-12)).clamp(max=MAX_ADAPTIVE_WEIGHT).detach()


class Adversarial:
    """``--distill_method adversarial``: the regression plus ``weight`` x the adaptive weight x the non-saturating
    GAN loss of :class:`Discriminator`, stepped once per student step on real images and the student's x_0. The
    real images are ``data``'s (an ImageSet: the teacher's training data, with its labels for a class-conditional
    teacher), a batch drawn per step, or without it the teacher's ODE ends of the student's own rows."""

    def __init__(self, discriminator: Discriminator, *, weight: float, lr: float, device, data=None) -> None:
        self.discriminator = discriminator.to(device).requires_grad_(False)  # only its own step takes gradients
        self.weight, self.data = weight, data
        # GAN practice (StyleGAN2): no momentum, a short second moment. float32 always: it is small.
        self.step = AuxiliaryStep(self.discriminator, lr=lr, betas=(0.0, 0.99), fp16=False, device=device)

    def draw(self, batch_size: int, *, generator: torch.Generator, device: torch.device) -> tuple:
        """The global batch's real images: indices into ``data`` (none for the ODE ends)."""
        if self.data is None:
            return ()
        return (torch.randint(0, len(self.data), (batch_size,), generator=generator, device=device),)

    def discriminator_loss(
        self, real: torch.Tensor, fake: torch.Tensor, y: torch.Tensor | None, y_real: torch.Tensor | None = None
    ) -> torch.Tensor:
        """softplus(-D(real)) + softplus(D(fake)), each a mean over the rows; ``y_real``: the real rows' labels
        where they are not the fake rows' ``y``."""
        y_real = y if y_real is None else y_real
        return F.softplus(-self.discriminator(real, y_real)).mean() + F.softplus(self.discriminator(fake, y)).mean()

    def loss(self, regression, *, out, x0, x_start, y, draws) -> torch.Tensor:
        real, y_real = x_start, y  # the teacher's ends of the same rows, or a batch of its training data
        if self.data is not None:
            real, labels = self.data.rows(draws[0], device=x0.device)
            y_real = labels if y is not None else None
        with torch.autocast(x0.device.type, enabled=False):
            self.discriminator.requires_grad_(True)  # its step: the real images against the student's x_0
            self.step(self.discriminator_loss(real.float(), x0.detach().float(), y, y_real))
            self.discriminator.requires_grad_(False)  # the student's term: gradients reach x_0, not D
            adversarial = F.softplus(-self.discriminator(x0.float(), y)).mean()
        return regression + self.weight * adaptive_weight(regression, adversarial, out=out) * adversarial

    def state_dict(self) -> dict:
        return {"discriminator": self.step.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step.load_state_dict(state["discriminator"])


def matching_gradient(x0: torch.Tensor, *, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """DMD's gradient of the student's x_0 (DMD2's code; DMD eq. 7-8): the fake score's denoised estimate minus
    the real one's, over the mean |x_0 - real| of each sample. Descending it moves x_0 toward where the teacher
    denoises it and away from where the student's own distribution does; it is 0 where the two scores agree."""
    scale = (x0 - real).abs().mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
    return torch.nan_to_num((fake - real) / scale)


class DistributionMatching:
    """``--distill_method dmd``: the regression plus ``weight`` x 0.5 |x_0 - (x_0 - grad).detach()|^2 with
    :func:`matching_gradient`'s grad; the fake score learns the student's x_0 once per student step, after."""

    def __init__(
        self,
        real: nn.Module,  # the teacher: (x_t, t[, y]) -> its prediction, in eval mode (any callable does)
        fake: nn.Module,  # the fake score's network, predicting what the teacher predicts
        schedule: NoiseSchedule,  # the teacher's
        *,
        sample_shape: tuple[int, ...],  # (C, H, W) or (C, D, H, W)
        weight: float,
        guidance_scale: float,
        null_label: int,
        lr: float,
        fp16: bool,
        device,
    ) -> None:
        self.real, self.schedule, self.sample_shape, self.weight = real, schedule, tuple(sample_shape), weight
        self.guidance_scale, self.null_label = guidance_scale, null_label
        # No dropout (eval mode): deterministic, the same on every rank. Adam as DMD2's guidance model's.
        self.fake = fake.to(device).eval().requires_grad_(True)
        self.step = AuxiliaryStep(self.fake, lr=lr, betas=(0.9, 0.999), fp16=fp16, device=device)

    def draw(self, batch_size: int, *, generator: torch.Generator, device: torch.device) -> tuple:
        """The global batch's (t, noise) of the matching gradient, then of the fake score's step."""
        T = self.schedule.num_timesteps
        low, high = (max(0, min(T - 1, int(share * T))) for share in DMD_T_RANGE)
        t_matching = torch.randint(low, high + 1, (batch_size,), generator=generator, device=device)
        t_fake = torch.randint(0, T, (batch_size,), generator=generator, device=device)
        noise = torch.randn((2, batch_size, *self.sample_shape), generator=generator, device=device)
        return t_matching, noise[0], t_fake, noise[1]

    def fake_prediction(self, x_t, t, y) -> torch.Tensor:
        return eps_of(self.fake, x_t, t, y).float()

    @torch.no_grad()
    def gradient(self, x0: torch.Tensor, *, t: torch.Tensor, noise: torch.Tensor, y) -> torch.Tensor:
        """:func:`matching_gradient` at x_0 noised to ``t`` with ``noise`` (the real score guided as the
        trajectories were)."""
        x_t = self.schedule.q_sample(x0, t, noise)
        guidance = None if y is None else Guidance(labels=y, null_label=self.null_label, scale=self.guidance_scale)
        real = self.schedule.predict_xstart(x_t, t, guided_model_eps(self.real, x_t, t, guidance))
        fake = self.schedule.predict_xstart(x_t, t, self.fake_prediction(x_t, t, y))
        return matching_gradient(x0, real=real, fake=fake)

    def fake_loss(self, x0: torch.Tensor, *, t: torch.Tensor, noise: torch.Tensor, y) -> torch.Tensor:
        """The teacher's denoising loss on the student's (detached) x_0: what the fake score learns."""
        x_t = self.schedule.q_sample(x0, t, noise)
        return F.mse_loss(self.fake_prediction(x_t, t, y), self.schedule.training_target(x0, noise, t).float())

    def loss(self, regression, *, out, x0, x_start, y, draws) -> torch.Tensor:
        t_matching, noise_matching, t_fake, noise_fake = draws
        sample = x0.detach()
        grad = self.gradient(sample, t=t_matching, noise=noise_matching, y=y)
        matching = 0.5 * F.mse_loss(x0, (x0 - grad).detach())
        self.step(self.fake_loss(sample, t=t_fake, noise=noise_fake, y=y))  # after: DMD's Algorithm 1
        return regression + self.weight * matching

    def state_dict(self) -> dict:
        return {"fake_score": self.step.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step.load_state_dict(state["fake_score"])


def unwrapped(module: nn.Module) -> nn.Module:
    """The student's own module inside torch.compile's wrapper (``_orig_mod``) and DistributedDataParallel's
    (``module``): the trainer hands the loss its forward, ``torch.compile(DistributedDataParallel(model))``."""
    module = getattr(module, "_orig_mod", module)
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


class Consistency:
    """``--distill_method consistency``: the target network theta^- of consistency distillation, an EMA of the
    student (:data:`TARGET_EMA`). The objective (training/distill.py) calls :meth:`follow` with the student at the
    start of each loss call, then :meth:`x0` at each state's next grid state for the regression's target."""

    def __init__(self, target: nn.Module, *, clip: bool, mu: float = TARGET_EMA) -> None:
        # A network of the student's architecture (a copy of the teacher's U-Net, which the student starts from);
        # its weights are the student's from the first loss call on. Eval mode: no dropout, the same on every rank.
        self.target = target.eval().requires_grad_(False)
        self.clip, self.mu = clip, mu
        self.started = False  # whether it holds the student's weights yet (the first follow copies them)

    def draw(self, batch_size: int, *, generator: torch.Generator, device: torch.device) -> tuple:
        """Nothing of its own: the grid indices are the objective's draw."""
        return ()

    @torch.no_grad()
    def follow(self, student: nn.Module) -> None:
        """theta^- <- mu theta^- + (1 - mu) theta, with ``student`` (the trainer's forward, wrapped or not) as it is
        now, after the last optimizer step; the first call copies it. Buffers are copied, as the trainer's EMA's."""
        student = unwrapped(student)
        own = dict(student.named_parameters())
        pairs = [(p, own[name]) for name, p in self.target.named_parameters()]  # by name: a renamed layer fails
        mine, theirs = [p for p, _ in pairs], [q.detach() for _, q in pairs]
        if self.started:
            torch._foreach_lerp_(mine, theirs, 1.0 - self.mu)
        else:
            torch._foreach_copy_(mine, theirs)
            self.started = True
        for buffer, source in zip(self.target.buffers(), student.buffers()):
            buffer.copy_(source)

    @torch.no_grad()
    def x0(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None, *, schedule: NoiseSchedule):
        """The target network's x_0 at (x_t, t) through ``schedule`` (the student's: its output is v), in the
        caller's autocast, clipped to [-1, 1] where the teacher's trajectories clip theirs (``clip``)."""
        out = eps_of(self.target, x_t, t, y).float()
        x0 = schedule.predict_xstart(x_t.float(), t, out)  # (B, *shape)
        return x0.clamp(-1.0, 1.0) if self.clip else x0

    def state_dict(self) -> dict:
        return {"target": {"network": self.target.state_dict(), "started": self.started}}

    def load_state_dict(self, state: dict) -> None:
        self.target.load_state_dict(state["target"]["network"])
        self.started = bool(state["target"]["started"])


def make_method(config, teacher, *, device, lr: float, precision: str, data=None, clip_denoised: bool = True):
    """The term ``config.method`` (training/distill.py's DistillConfig) adds for ``teacher`` (an Artifact), or
    None for the plain regression. ``lr``: its network's (the student's --lr); ``precision``: the student's;
    ``data``: the adversarial method's real images (an ImageSet; None: the teacher's ODE ends); ``clip_denoised``:
    whether the teacher's trajectories clip their x_0 (the consistency method's target clips alike)."""
    model_config = teacher.model_config
    shape = tuple(model_config.sample_shape(1)[1:])
    if config.method == "adversarial":
        with torch.random.fork_rng(devices=[]):  # the same weights on every rank, and the global RNG untouched
            torch.manual_seed(config.seed)
            discriminator = Discriminator(sample_shape=shape, num_classes=model_config.num_classes)
        return Adversarial(discriminator, weight=config.adv_weight, lr=lr, device=device, data=data)
    if config.method == "dmd":
        return DistributionMatching(
            teacher.model,
            copy.deepcopy(teacher.model),
            NoiseSchedule(teacher.schedule_config).to(device),
            sample_shape=shape,
            weight=config.dmd_weight,
            guidance_scale=config.guidance_scale,
            null_label=model_config.null_label,
            lr=lr,
            fp16=precision == "fp16",
            device=device,
        )
    if config.method == "consistency":
        return Consistency(copy.deepcopy(teacher.model).to(device), clip=clip_denoised)
    return None
