"""The training benchmark (``--mode benchmark --bench training``): images per second, time per step
and peak memory of training variants on one U-Net, each from a fresh Trainer on random images.

    python main.py --mode benchmark --bench training --dataset digits --batch_size 64 --train_steps 20
"""

from __future__ import annotations

import gc
import json
import re
import statistics
import time
from collections.abc import Callable

import torch

from ddpm.benchmarks.report import PeakRSS, environment, times_text
from ddpm.requests import BenchmarkRequest
from ddpm.training.timestep_sampling import TIMESTEP_SAMPLERS, TimestepSampler
from ddpm.util import distributed
from ddpm.util.memory import allocator_description
from ddpm.util.messages import first_line
from ddpm.util.precision import resolve
from ddpm.util.safe_files import atomic_write

PROFILED_STEPS = 3  # with --profile: 1 warm-up + 2 recorded steps per variant (profiling.ProfileConfig.fitted)


DIFFUSERS = "diffusers"  # the row trained by diffusers' own model and loop (DiffusersTrainer), not by a Trainer


def training_variants(device: torch.device, *, pixels: int = 0, side: int = 0) -> list[tuple[str, str, dict]]:
    """(key for --rows, name, TrainConfig fields): fp32 eager vs mixed precision + fused AdamW + channels-last,
    +/- compile; each precision with activation checkpointing (--grad_checkpoint: the memory it saves, the
    time it costs); then fp32 eager with each adaptive timestep sampler (their cost per step: a draw and
    a history update). Beside them, two peers: ``default``, what --mode train runs on this device without flags
    (--precision auto for images of ``pixels``, resolved as train resolves it), and ``diffusers``, diffusers'
    UNet2DModel of the same widths and blocks trained by a loop like its train_unconditional.py example. ``side``:
    the side of a 2-D U-Net's largest feature maps (0 for none), where the names say whether Winograd's run."""
    amp = "bf16" if device.type != "cuda" or torch.cuda.is_bf16_supported() else "fp16"
    from ddpm.kernels import ops
    from ddpm.training import winograd
    from ddpm.training.trainer import TrainConfig, trains_channels_last, trains_fused_norms

    fast = "+fused AdamW+channels-last" if device.type == "cuda" else ""
    eager = dict(precision="fp32", compile=False, cuda_fast_path=False, cpu_channels_last=False, winograd_convs=False)
    mixed = dict(precision=amp, compile=False, cuda_fast_path=True)
    auto = resolve("auto", purpose="training", device=device, pixels=pixels)

    def cpu_layout(precision: str, **fields) -> str:  # what an eager CPU run of this precision adds
        config = TrainConfig(precision=precision, **fields)
        if device.type != "cpu" or not trains_channels_last(device, config):
            return ""
        start = winograd.trained_from(precision=precision, enabled=config.winograd_convs, largest=side)
        convs = "" if start is None else "+Winograd" + (f" from {start}x{start}" if start > 1 else "")
        fp32 = convs and precision == "fp32"  # a bf16 step's Winograd convolutions are the mixed path's alone
        convs += "+1x1 GEMMs" if fp32 and winograd.gemm_1x1() else ""
        convs += "+thin convs direct" if fp32 and ops.thin_is_fast() else ""
        return "+channels-last" + ("+fused norms" if trains_fused_norms(device, config) else "") + convs

    return [
        ("fp32", "fp32 eager", eager),
        (
            "default",
            f"default: {auto}{fast or cpu_layout(auto)} eager",
            dict(precision=auto, compile=False, cuda_fast_path=True),
        ),
        (DIFFUSERS, "diffusers UNet2DModel fp32 eager", dict(precision="fp32", compile=False)),
        ("fp32_compile", "fp32 compile", dict(eager, compile=True)),
        (
            "fp32_nhwc",
            f"fp32 eager{cpu_layout('fp32', winograd_convs=False) or ' channels-last'}",
            dict(eager, cpu_channels_last=True, cuda_fast_path=True),
        ),
        ("amp", f"{amp}{fast or cpu_layout(amp)} eager", mixed),
        ("amp_compile", f"{amp}{fast} compile", dict(mixed, compile=True)),
        ("fp32_checkpoint", "fp32 eager, grad checkpoint", dict(eager, grad_checkpoint=True)),
        ("amp_checkpoint", f"{amp}{fast or cpu_layout(amp)} eager, grad checkpoint", dict(mixed, grad_checkpoint=True)),
        *(
            (f"t_{name}", f"fp32 eager, t: {name}", dict(eager, timestep_sampling=name))
            for name in TIMESTEP_SAMPLERS[1:]
        ),
    ]


def variant_keys() -> tuple[str, ...]:
    """The training benchmark's --rows names."""
    return tuple(key for key, _, _ in training_variants(torch.device("cpu")))


def select_variants(
    rows: str | None, device: torch.device, *, pixels: int = 0, side: int = 0
) -> list[tuple[str, str, dict]]:
    """The variants --rows names (default "all"); fp32 eager always runs first: the speedups' baseline."""
    variants = training_variants(device, pixels=pixels, side=side)
    if rows in (None, "all"):
        return variants
    wanted = [r.strip() for r in rows.split(",") if r.strip()]
    unknown = [r for r in wanted if r not in variant_keys()]
    if unknown:
        raise ValueError(
            f"--rows: {', '.join(unknown)} not a training row; choose from {', '.join(variant_keys())}, or all (alone)"
        )
    return [v for v in variants if v[0] == "fp32" or v[0] in wanted]


def warm_timestep_sampler(sampler: TimestepSampler) -> None:
    """Feed a sampler synthetic losses (falling with t, as epsilon-prediction losses do) until its warm-up
    is over, so timed steps run its learned-distribution path rather than the uniform warm-up draw."""
    t = torch.arange(sampler.num_timesteps)
    losses = 1.0 / (1.0 + t.double())
    for _ in range(100_000):  # speed's warm-up is its horizon (1,000 updates): far below this bound
        if sampler.ready():
            return
        sampler.update(t, losses)


def time_variants(
    model_config,
    schedule_config,
    *,
    device: torch.device,
    batch_size: int,
    steps: int,
    warmup: int,
    seed: int,
    progress: Callable[[str], None] = print,
    profile: str | None = None,
    rows: str | None = None,
    latent: bool = False,
    interleave: bool = False,
) -> list[dict]:
    """Images/s and peak memory of ``steps`` optimizer steps (after ``warmup``) for each variant.
    A latent model's U-Net (``latent``) trains on random unit-variance latents, as its encoded data are.

    With ``interleave`` (one process), every variant is built and warmed up first, then timed in
    INTERLEAVED_ROUNDS rounds of ``steps`` steps each, every variant once a round, so a machine whose pace drifts
    slows every row of a round alike: a row's speedup is the median of its per-round ratios to the fp32 row's, its
    images/s its rounds' together; peak memory is not measured (the variants are held together).

    With ``profile`` (--profile DIR), each variant then runs PROFILED_STEPS more steps, traced into
    DIR/train-<variant>/ (profiling.py), after its timing and memory were read.
    Under torchrun, ``batch_size`` is the global batch: each variant is timed on all ranks with
    DistributedDataParallel, and first on rank 0 alone with one rank's share of the batch, so the row
    reports images/s per rank and the scaling efficiency (per-rank throughput over the lone rank's).
    """
    from ddpm.data.datasets import ImageSet
    from ddpm.training.trainer import Trainer

    ranks = distributed.current()
    distributed.check_global_batch(batch_size, world_size=ranks.world_size)
    if interleave and ranks.distributed:
        raise ValueError("--interleave times the training rows in one process: run it without torchrun")
    gen = torch.Generator().manual_seed(seed)
    shape = model_config.sample_shape(batch_size * 4)
    if latent:  # float32 latents are fed as they are (data.ImageSet), like an autoencoder's encoded dataset
        images = ImageSet("random latents", torch.randn(shape, generator=gen))
    else:
        images = ImageSet("random", torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
    if model_config.num_classes:  # a class-conditional model trains on random labels too
        images.labels = torch.randint(0, model_config.num_classes, (shape[0],), generator=gen)
        images.class_names = tuple(str(i) for i in range(model_config.num_classes))
    timed = dict(
        model_config=model_config,
        schedule_config=schedule_config,
        images=images,
        device=device,
        steps=steps,
        warmup=warmup,
        seed=seed,
    )
    results = []
    held: dict[str, object] = {}  # interleave: row key -> its warmed-up trainer
    pixels = 0 if latent or model_config.dims == 3 else model_config.image_size**2  # as train's --precision auto
    side = 0 if model_config.dims == 3 else model_config.image_size // model_config.patch_size  # the first level's
    for key, name, fields in select_variants(rows, device, pixels=pixels, side=side):
        if key == DIFFUSERS and ranks.distributed and rows in (None, "all"):  # named in --rows: its row says why
            progress(f"training {name}: left out under torchrun (diffusers' loop runs in one process)")
            continue
        gc.collect()  # the previous variant's trainer (model, EMA, optimizer state) is gone before this one
        if device.type == "cuda":
            torch.cuda.empty_cache()
        timed_steps = f"{INTERLEAVED_ROUNDS} rounds of {steps}" if interleave else str(steps)
        progress(f"training {name}: {warmup} warm-up + {timed_steps} timed steps ...")
        row = {"key": key, "name": name, **fields, "status": "ok", "reason": ""}
        results.append(row)
        failure = None
        if ranks.distributed and ranks.is_main:  # the baseline: one rank alone, one rank's share of the batch
            try:
                alone, _, _, _ = time_variant(
                    key, fields, batch_size=batch_size // ranks.world_size, ranks=distributed.SINGLE, **timed
                )
                row["single_rank_images_per_s"] = steps * (batch_size // ranks.world_size) / alone
            except Exception as exc:  # the other ranks learn of it in the next all-reduce
                failure = exc
        # Every rank takes part in each any_failed (an all-reduce), so the ranks stay in step whatever fails.
        failed = any_failed(failure is not None, ranks=ranks, device=device)
        if not failed:
            try:
                elapsed, peak_mb, first, trainer = time_variant(
                    key, fields, batch_size=batch_size, ranks=ranks, timed_now=not interleave, **timed
                )
                row["first_step_s"] = first  # compiling included: apart from the timed steps
                if profile and isinstance(trainer, Trainer):
                    suffix = f"-rank{ranks.rank}" if ranks.distributed else ""
                    trace_steps(
                        trainer,
                        name=f"train-{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}{suffix}",
                        directory=profile,
                    )
                if interleave:
                    held[key] = trainer  # timed in the rounds below
                    continue
                del trainer  # freed before the next variant is built: its memory is measured alone
            except Exception as exc:  # e.g. diffusers missing, or a model it cannot represent: report, go on
                if distributed.is_collective_failure(exc, ranks=ranks):
                    raise
                failure = exc
            failed = any_failed(failure is not None, ranks=ranks, device=device)
        if failed:  # every rank marks the row alike
            reason = f"{type(failure).__name__}: {first_line(failure)}" if failure else "failed on another rank"
            row.update(status="failed", reason=reason)
            progress(f"training {name}: failed ({row['reason']})")
            continue
        # The slowest rank's time is the step's time (on the device: NCCL reduces only GPU tensors).
        elapsed = distributed.all_reduce_max(torch.tensor([elapsed], dtype=torch.float64, device=device)).item()
        row["images_per_s"] = steps * batch_size / elapsed
        row["ms_per_step"] = 1000.0 * elapsed / steps
        row["peak_memory_mb"] = peak_mb  # this rank's (rank 0's in the table)
        if ranks.distributed:
            row.update(ranks=ranks.world_size, images_per_s_per_rank=row["images_per_s"] / ranks.world_size)
            if row.get("single_rank_images_per_s"):
                row["scaling_efficiency"] = row["images_per_s_per_rank"] / row["single_rank_images_per_s"]
        progress(f"training {name}: {row['images_per_s']:.1f} img/s")  # each variant's result as soon as it is known
    if interleave:
        time_in_rounds(results, held, steps=steps, batch_size=batch_size, device=device, progress=progress)
        return results
    base = results[0].get("images_per_s")
    for row in results:
        if base and row.get("images_per_s"):
            row["speedup"] = row["images_per_s"] / base
    return results


INTERLEAVED_ROUNDS = 3


def time_in_rounds(results: list[dict], held: dict, *, steps: int, batch_size: int, device, progress) -> None:
    """--interleave: each held variant's ``steps`` steps once a round, INTERLEAVED_ROUNDS rounds; every row's
    images/s over its rounds, and its speedup the median of its per-round ratios to the first row's (fp32 eager)."""
    rates: dict[str, list[float]] = {key: [] for key in held}
    for _ in range(INTERLEAVED_ROUNDS):
        for key, trainer in held.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()  # reads the loss each step (a sync)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rates[key].append(steps * batch_size / (time.perf_counter() - t0))
    base = rates.get(results[0]["key"])
    for row in results:
        if row["key"] not in rates:  # failed while it was built
            continue
        mine = rates[row["key"]]
        row["images_per_s"] = len(mine) / sum(1 / rate for rate in mine)  # all its rounds' images over their time
        row["ms_per_step"] = 1000.0 * batch_size / row["images_per_s"]
        row["peak_memory_mb"] = None  # the variants were held together
        row["round_images_per_s"] = mine
        if base:
            row["speedup"] = statistics.median(r / b for r, b in zip(mine, base))
        progress(f"training {row['name']}: {row['images_per_s']:.1f} img/s over {len(mine)} rounds")


def any_failed(failed: bool, *, ranks: distributed.Ranks, device: torch.device) -> bool:
    """Whether this or any other rank failed (one all-reduce; just ``failed`` for one process)."""
    if not ranks.distributed:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    return bool(distributed.all_reduce_max(flag, ranks=ranks).item())


def time_variant(
    key: str,
    fields: dict,
    *,
    model_config,
    schedule_config,
    images,
    device: torch.device,
    batch_size: int,
    steps: int,
    warmup: int,
    seed: int,
    ranks: distributed.Ranks,
    timed_now: bool = True,
) -> tuple[float, float | None, float, object]:
    """(seconds for ``steps`` timed steps, peak memory in MB or None, seconds of the first step, the trainer) of
    one variant; the first step (a compile row's compiling) and ``warmup`` - 1 more steps are not timed ones.
    Not ``timed_now``: built and warmed up only (0 seconds, no peak), for --interleave's rounds.
    A compile row whose compiling failed raises that failure: its row gives the reason, not eager's time."""
    from ddpm.training.trainer import TrainConfig, Trainer

    if key == DIFFUSERS:
        if ranks.distributed:
            raise ValueError("the diffusers row runs in one process (not under torchrun)")
        trainer = DiffusersTrainer(
            model_config, schedule_config, images=images, device=device, seed=seed, batch_size=batch_size
        )
    else:
        config = TrainConfig(
            dataset="random",
            total_steps=warmup + steps * INTERLEAVED_ROUNDS + PROFILED_STEPS + 1,
            batch_size=batch_size,
            seed=seed,
            warmup_steps=0,
            save_every=0,
            sample_every=0,
            **fields,
        )
        trainer = Trainer(config, model_config, schedule_config, images=images, device=device, ranks=ranks)
        warm_timestep_sampler(trainer.timesteps)
    started = time.perf_counter()
    trainer.train_step()  # reads the loss (a sync): compiling, if any, is done
    first = time.perf_counter() - started
    trial = getattr(trainer, "compile_trial", None)
    if trial is not None and trial.failure is not None:
        raise trial.failure
    for _ in range(warmup - 1):
        trainer.train_step()
    if not timed_now:
        return 0.0, None, first, trainer
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()  # reads the loss each step (a sync), so the clock sees the GPU work
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mb = None if rss.peak is None else rss.peak / 2**20
    return elapsed, peak_mb, first, trainer


def trace_steps(trainer, *, name: str, directory: str) -> None:
    """PROFILED_STEPS more training steps under torch.profiler, each one profiler step."""
    from ddpm.util.profiling import ProfileConfig, make_profiler

    config = ProfileConfig(directory, run_name=name, total_steps=PROFILED_STEPS)
    with make_profiler(config, device=trainer.device) as profiler:
        for _ in range(PROFILED_STEPS):
            trainer.train_step()
            profiler.step()


def benchmark_training(
    args: BenchmarkRequest, *, model_config, schedule_config, device: torch.device, latent: bool = False
) -> list[dict]:
    warmup = max(args.warmup, 3)  # compile and cuDNN autotuning happen in the first steps
    ranks = distributed.current()
    allocator = None
    if device.type == "cpu":  # before any row, as the trainer does anyway: no row pays a trimmed heap's page faults
        allocator = allocator_description()
    rows = time_variants(
        model_config,
        schedule_config,
        device=device,
        batch_size=args.batch_size,
        steps=args.train_steps,
        warmup=warmup,
        seed=args.seed,
        profile=args.profile,
        progress=distributed.say,
        rows=args.rows,
        latent=latent,
        interleave=args.interleave,
    )
    if not ranks.is_main:
        return rows
    env = environment(device)
    env["timing"] = f"interleaved rounds ({INTERLEAVED_ROUNDS})" if args.interleave else "one row after another"
    if allocator is not None:
        env["cpu_allocator"] = allocator
    print()
    for key in ("date", "device", "torch", "cuda", "cpu_allocator"):
        if key in env:
            print(f"{key.removeprefix('cpu_'):>10}: {env[key]}")
    shape = "x".join(map(str, model_config.sample_shape(1)[1:]))
    print(
        f"{'model':>10}: {model_config.model_channels} base channels, {shape}{' latents' if latent else ''}, batch "
        f"{args.batch_size}, "
        f"{warmup} warm-up + {args.train_steps} timed steps"
        + (f" in each of {INTERLEAVED_ROUNDS} interleaved rounds" if args.interleave else "")
    )
    if ranks.distributed:
        env["ranks"] = ranks.world_size
        print(
            f"{'ranks':>10}: {ranks.world_size} ({distributed.backend()}), {args.batch_size // ranks.world_size} "
            "images each; "
            "scaling = img/s per rank over one rank alone with the same per-rank batch"
        )
    print()
    extra = f"{'img/s/rank':>11}{'scaling':>9}" if ranks.distributed else ""
    # 1st step s: the untimed first step, where a compile row compiles (the other rows' is about one step's time).
    print(f"{'variant':<40}{'img/s':>10}{'ms/step':>10}{'speedup':>9}{'peak MB':>9}{'1st step s':>11}{extra}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['name']:<40}{r['status']}: {r['reason']}")
            continue
        mem = "n/a" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        speedup = times_text(r.get("speedup"))
        line = f"{r['name']:<40}{r['images_per_s']:>10.1f}{r['ms_per_step']:>10.1f}{speedup:>9}{mem:>9}"
        line += f"{r['first_step_s']:>11.1f}"
        if ranks.distributed:
            scaling = f"{100 * r['scaling_efficiency']:.0f}%" if r.get("scaling_efficiency") else "n/a"
            line += f"{r['images_per_s_per_rank']:>11.1f}{scaling:>9}"
        print(line)
    if args.json:
        payload = json.dumps({"environment": env, "training_rows": rows}, indent=2, default=str)
        atomic_write(args.json, lambda f: f.write(payload.encode()))
        print(f"wrote {args.json}")
    return rows


class DiffusersTrainer:
    """The diffusers row: diffusers' ``UNet2DModel`` of the U-Net's widths and blocks (formats/diffusers_io's
    mapping: the same layers and parameter count), trained as diffusers' train_unconditional.py example trains it:
    DDPMScheduler.add_noise at uniform timesteps over the schedule's count, the noise-prediction MSE, gradients
    clipped to norm 1, AdamW with the example's settings and its cosine learning rate, and its EMAModel; fp32, on
    the same images and batch as the Trainer rows."""

    def __init__(self, model_config, schedule_config, *, images, device: torch.device, seed: int, batch_size: int):
        try:
            from diffusers import DDPMScheduler, UNet2DModel
            from diffusers.optimization import get_cosine_schedule_with_warmup
            from diffusers.training_utils import EMAModel
        except ImportError as exc:
            raise ImportError("diffusers is not installed (pip install diffusers)") from exc
        from ddpm.formats.diffusers_io import diffusers_unet_config

        config = diffusers_unet_config(model_config, source="the diffusers row")
        torch.manual_seed(seed)
        self.model = UNet2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
        self.model = self.model.to(device).train()
        kind = "squaredcos_cap_v2" if schedule_config.kind == "cosine" else "linear"
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=schedule_config.num_timesteps, beta_schedule=kind)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8
        )
        self.lr_scheduler = get_cosine_schedule_with_warmup(
            self.optimizer, num_warmup_steps=500, num_training_steps=10**6
        )
        self.ema = EMAModel(
            self.model.parameters(),
            decay=0.9999,
            use_ema_warmup=True,
            inv_gamma=1.0,
            power=3 / 4,
            model_cls=UNet2DModel,
            model_config=self.model.config,
        )
        self.images, self.device, self.seed, self.batch_size = images, device, seed, batch_size
        self.generator = torch.Generator(device).manual_seed(seed)
        self.num_timesteps = schedule_config.num_timesteps
        self.step = 0

    def train_step(self) -> float:
        x, labels = self.images.batch_with_labels(
            self.step, batch_size=self.batch_size, seed=self.seed, device=self.device
        )  # (B, C, H, W)
        noise = torch.randn(x.shape, device=self.device, generator=self.generator)
        t = torch.randint(0, self.num_timesteps, (x.shape[0],), device=self.device, generator=self.generator)
        noisy = self.noise_scheduler.add_noise(x, noise, t)
        eps = self.model(noisy, t, class_labels=labels, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(eps.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self.ema.step(self.model.parameters())
        self.step += 1
        return loss.item()  # sync: the clock sees the step's work, as the Trainer rows' loss read does
