"""A distilled student's images per second on a GPU, beside its teacher's 20-step sampler and diffusers' own.

    python scripts/gpu_students.py --out DIR [--batches 8,64] [--img_size 28 --channels 1] [--no_compile]

One random "small" U-Net (zero-initialized layers given small weights: speed does not depend on what a network
learned, and a zero network would be timed on zeros) at MNIST size, timed as:

* the student: the multistep consistency sampler at 1, 2 and 4 steps on v-prediction (what ``--mode distill``
  writes), through the cuda implementation (the fused U-Net runner in bf16), its whole plan one CUDA graph
  replay; at 4 steps also one graph per step, the difference the whole-plan graph makes;
* its teacher's default few-step sampler, SDE-DPM-Solver++ at 20 steps, through the same implementation;
* diffusers: the same weights in ``UNet2DModel`` (fp16) with ``DPMSolverMultistepScheduler`` at 20 steps, the loop
  its pipelines run, eager and with the U-Net through ``torch.compile`` (needs diffusers).

Each row: warm-up runs (graph capture, compilation), then the median of ``--repeats`` timed runs, synchronized.
Writes DIR/students.json and DIR/students.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's flat layout

import optimized_diffusion as od  # noqa: E402
from basic_diffusion import UNet, unet_preset  # noqa: E402
from ddpm.benchmarks.sampling_bench import perturb_zero_init, time_runs  # noqa: E402
from ddpm.training.distill import STUDENT_PREDICTION  # noqa: E402
from noise_schedule import NoiseSchedule, ScheduleConfig  # noqa: E402


def timed(draw, *, device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """(median seconds of ``repeats`` timed runs, seconds of the ``warmup`` runs before them) of ``draw()``."""
    start = time.perf_counter()
    time_runs(draw, device=device, warmup=warmup, repeats=0)
    torch.cuda.synchronize(device)
    warm = time.perf_counter() - start
    times, _ = time_runs(draw, device=device, warmup=0, repeats=repeats)
    return statistics.median(times), warm


def ours(model: UNet, schedule: NoiseSchedule, sampler: str, steps: int, *, batch: int, whole_plan: bool):
    plan = schedule.make_plan(sampler, sampling_steps=steps, device=model.conv_in.weight.device)
    shape = model.config.sample_shape(batch)
    built = od.FusedSampler(model, plan, shape=shape, precision="bf16", fused_unet=True, whole_plan=whole_plan)
    generator = torch.Generator(plan.coefficients.device).manual_seed(0)
    return lambda: built(generator=generator)


def diffusers_loop(model: UNet, *, batch: int, steps: int, compile_unet: bool):
    from diffusers import DPMSolverMultistepScheduler

    from ddpm.formats.diffusers_io import DiffusersUNet

    unet = DiffusersUNet(model, dtype=torch.float16).unet
    if compile_unet:
        unet = torch.compile(unet)
    scheduler = DPMSolverMultistepScheduler(num_train_timesteps=1000, beta_schedule="linear")
    device = model.conv_in.weight.device
    shape = model.config.sample_shape(batch)
    generator = torch.Generator(device).manual_seed(0)

    @torch.no_grad()
    def draw() -> torch.Tensor:
        scheduler.set_timesteps(steps, device=device)
        x = torch.randn(shape, generator=generator, device=device, dtype=torch.float16)
        for t in scheduler.timesteps:
            eps = unet(x, t).sample
            x = scheduler.step(eps, t, x).prev_sample
        return x

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--img_size", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no_compile", action="store_true", help="skip the compiled diffusers row")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = UNet(unet_preset("small", image_size=args.img_size, in_channels=args.channels))
    perturb_zero_init(model, seed=0)
    model = model.to(device).eval()
    student = NoiseSchedule(ScheduleConfig(prediction=STUDENT_PREDICTION)).to(device)
    teacher = NoiseSchedule(ScheduleConfig()).to(device)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        candidates = [
            (
                f"student, consistency {k} step{'s' * (k > 1)}, cuda bf16",
                k,
                lambda k=k: ours(model, student, "consistency", k, batch=batch, whole_plan=True),
            )
            for k in (1, 2, 4)
        ]
        candidates += [
            (
                "student, consistency 4 steps, cuda bf16, one graph per step",
                4,
                lambda: ours(model, student, "consistency", 4, batch=batch, whole_plan=False),
            ),
            (
                "teacher, SDE-DPM-Solver++ 20 steps, cuda bf16",
                20,
                lambda: ours(model, teacher, "dpm_solver_sde", 20, batch=batch, whole_plan=True),
            ),
            (
                "teacher, SDE-DPM-Solver++ 20 steps, cuda bf16, one graph per step",
                20,
                lambda: ours(model, teacher, "dpm_solver_sde", 20, batch=batch, whole_plan=False),
            ),
        ]
        for compile_unet in (False, True) if not args.no_compile else (False,):
            label = "diffusers UNet2DModel fp16 + DPMSolverMultistepScheduler 20 steps" + (
                ", torch.compile" if compile_unet else ""
            )
            candidates.append(
                (label, 20, lambda c=compile_unet: diffusers_loop(model, batch=batch, steps=20, compile_unet=c))
            )
        for label, steps, build in candidates:
            try:
                start = time.perf_counter()
                draw = build()
                built = time.perf_counter() - start
                median, warm = timed(draw, device=device, warmup=2, repeats=args.repeats)
            except ImportError as exc:
                print(f"batch {batch}: {label}: skipped ({exc})", flush=True)
                continue
            row = dict(
                batch=batch,
                row=label,
                steps=steps,
                median_s=median,
                ms_per_step=1000 * median / steps,
                images_per_s=batch / median,
                build_and_warmup_s=built + warm,
            )
            rows.append(row)
            print(
                f"batch {batch:>3}  {label:<76} {1000 * median:8.3f} ms  {batch / median:10.0f} img/s  "
                f"(build + warm-up {built + warm:.1f} s)",
                flush=True,
            )
            del draw
            torch.cuda.empty_cache()
    results = dict(
        device=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        shape=[args.channels, args.img_size, args.img_size],
        parameters=sum(p.numel() for p in model.parameters()),
        rows=rows,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "students.json").write_text(json.dumps(results, indent=2))
    lines = [f"{results['device']}, torch {results['torch']}, {results['date']}"]
    lines += [
        f"batch {r['batch']:>3}  {r['row']:<76} {1000 * r['median_s']:8.3f} ms  {r['images_per_s']:10.0f} img/s"
        for r in rows
    ]
    (args.out / "students.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
