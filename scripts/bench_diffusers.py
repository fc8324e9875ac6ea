"""Time a diffusers model folder sampled by diffusers' own pipeline loop and by this tool's implementations.

    python scripts/bench_diffusers.py DIR --batch 16 --steps 50 --repeats 3 --out bench.json
    python scripts/bench_diffusers.py --make small-28 DIR     # first write a random UNet2DModel equal to the "small"
    preset

One process, one model, the same DDPM timesteps (``--steps`` of the folder's scheduler, this tool's
uniform spacing, handed to DDPMScheduler as custom timesteps), the same batch and the same generator
seed for every row: diffusers' ``UNet2DModel`` + ``DDPMScheduler.step`` (what ``DDPMPipeline`` runs, without
its PIL conversion), then the folder imported by this tool (formats/diffusers_io.py) and sampled by the
``original`` loop and the ``cuda_steps`` implementation (the fused step ops around the eager U-Net; on a CPU
their CPU twins). Warm-up runs are excluded; the median of ``--repeats`` runs is reported, with each row's
largest difference from diffusers' images (same noise). Needs diffusers (``pip install diffusers``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's flat layout

import basic_diffusion  # noqa: E402
import optimized_diffusion  # noqa: E402
from ddpm.backends.artifacts import load_model_parts  # noqa: E402
from noise_schedule import NoiseSchedule  # noqa: E402

SMALL_28 = dict(  # this tool's "small" preset at 28x28 (6.95M parameters), as a UNet2DModel
    sample_size=28,
    in_channels=1,
    out_channels=1,
    block_out_channels=(64, 128, 128),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    attention_head_dim=32,
    resnet_time_scale_shift="scale_shift",
    attn_norm_num_groups=32,
    dropout=0.1,
)


def timed(fn, *, warmup: int, repeats: int) -> tuple[list[float], torch.Tensor]:
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument(
        "--make", choices=("small-28",), help="first write a random UNet2DModel + DDPMScheduler(1000) into FOLDER"
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import diffusers

    if args.make:
        torch.manual_seed(args.seed)
        unet = diffusers.UNet2DModel(**SMALL_28).eval()
        with torch.no_grad():
            for w in unet.parameters():
                w.add_(torch.randn_like(w) * 0.02)  # the zero-initialized output layers too: eps is not 0
        diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=1000)).save_pretrained(
            args.folder
        )
    unet = diffusers.UNet2DModel.from_pretrained(args.folder / "unet").eval()
    scheduler = diffusers.DDPMScheduler.from_pretrained(args.folder / "scheduler")
    model, schedule_config, *_ = load_model_parts(args.folder)
    plan = NoiseSchedule(schedule_config).make_plan("ddpm", sampling_steps=args.steps)
    shape = (args.batch, unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    scheduler.set_timesteps(timesteps=plan.timesteps.tolist())

    @torch.no_grad()
    def diffusers_loop() -> torch.Tensor:  # DDPMPipeline.__call__'s loop
        generator = torch.Generator().manual_seed(args.seed)
        x = torch.randn(shape, generator=generator)
        for t in scheduler.timesteps:
            x = scheduler.step(unet(x, t).sample, t, x, generator=generator).prev_sample
        return x

    cuda = optimized_diffusion.FusedSampler(model, plan, shape=shape)
    rows = {
        "diffusers (UNet2DModel + DDPMScheduler)": diffusers_loop,
        "original (this tool)": lambda: basic_diffusion.sample(
            model, plan, shape=shape, generator=torch.Generator().manual_seed(args.seed)
        ),
        "cuda_steps (this tool)": lambda: cuda(generator=torch.Generator().manual_seed(args.seed)),
    }
    results, reference = [], None
    for name, fn in rows.items():
        times, images = timed(fn, warmup=args.warmup, repeats=args.repeats)
        reference = images if reference is None else reference
        median = statistics.median(times)
        results.append(
            dict(
                row=name,
                median_s=median,
                min_s=min(times),
                max_s=max(times),
                ms_per_step=1e3 * median / plan.num_steps,
                max_abs_diff_vs_diffusers=(images - reference).abs().max().item(),
            )
        )
    base = results[0]["median_s"]
    print(f"{'row':42} {'median s':>9} {'min-max s':>15} {'ms/step':>8} {'vs diffusers':>12} {'max abs diff':>12}")
    for r in results:
        print(
            f"{r['row']:42} {r['median_s']:9.3f} {r['min_s']:7.3f}-{r['max_s']:<7.3f} {r['ms_per_step']:8.2f} "
            f"{base / r['median_s']:11.2f}x {r['max_abs_diff_vs_diffusers']:12.2e}"
        )
    if args.out:
        env = dict(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch=torch.__version__,
            diffusers=diffusers.__version__,
            python=platform.python_version(),
            threads=torch.get_num_threads(),
            device="cpu",
            processor=platform.processor() or platform.machine(),
        )
        config = dict(
            folder=str(args.folder),
            batch=args.batch,
            steps=args.steps,
            repeats=args.repeats,
            warmup=args.warmup,
            seed=args.seed,
        )
        args.out.write_text(json.dumps(dict(environment=env, config=config, rows=results), indent=2) + "\n")


if __name__ == "__main__":
    main()
