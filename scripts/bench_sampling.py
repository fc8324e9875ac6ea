"""Benchmark the original sampling loop against the "cuda" implementation on one GPU.

    python scripts/bench_sampling.py --out bench.json [--batch 64 --steps 100 --repeats 7]

Times whole sampling runs (DDPM, ``--steps`` steps, batch ``--batch``, a "small" U-Net with
random weights) with CUDA events after a warm-up run, and reports the median of ``--repeats``
runs: the original loop (fp32), the cuda implementation in fp32 and bf16 (graph captured once,
replays timed; capture time reported apart) and ``optimized_diffusion.sample`` end to end
(capture included). It checks first that fp32 cuda images match the original's (max abs
difference), and measures the fused step op alone against the p_step reference on a large
tensor (achieved bandwidth against the minimum bytes it must move, and against a device-to-device
copy of as many bytes: the practical ceiling). Writes one JSON file.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's flat layout

import optimized_diffusion as od  # noqa: E402
from basic_diffusion import UNet, unet_preset  # noqa: E402
from basic_diffusion import sample as original_sample  # noqa: E402
from ddpm.benchmarks.sampling_bench import perturb_zero_init, time_runs  # noqa: E402
from ddpm.kernels import ops  # noqa: E402
from ddpm.util.precision import backend_policy  # noqa: E402
from noise_schedule import NoiseSchedule, ScheduleConfig, p_step  # noqa: E402

DEVICE = torch.device("cuda")


def cuda_time_ms(fn, *, repeats: int) -> list[float]:
    """One warm-up run, then ``repeats`` runs timed with CUDA events (benchmark.time_runs), in ms."""
    times, _ = time_runs(fn, device=DEVICE, warmup=1, repeats=repeats)
    return [1000.0 * t for t in times]


def summary(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs_ms": times}


def random_unet(*, image_size: int, channels: int) -> UNet:
    """The "small" preset as benchmark mode builds it: never time on zeros (sampling_bench.perturb_zero_init)."""
    torch.manual_seed(0)
    model = UNet(unet_preset("small", image_size=image_size, in_channels=channels))
    perturb_zero_init(model, seed=0)
    return model.to(DEVICE).eval()


def bench_sampling(args: argparse.Namespace) -> dict:
    device = DEVICE
    model = random_unet(image_size=args.image_size, channels=args.channels)
    plan = (
        NoiseSchedule(ScheduleConfig(num_timesteps=1000))
        .to(device)
        .make_plan("ddpm", sampling_steps=args.steps, device=device)
    )
    shape = (args.batch, args.channels, args.image_size, args.image_size)

    def original():
        with backend_policy("fp32"):  # true fp32, the same numerics as the cuda fp32 path
            return original_sample(model, plan, shape=shape, generator=torch.Generator(device).manual_seed(0))

    results: dict = {}
    # Correctness first: fp32 cuda vs original, same seed.
    expected = original()
    # The cuda path converts its model to channels-last in place: give it its own copy, so the
    # original keeps running the model as a user would hand it over.
    cuda_model = copy.deepcopy(model)
    samplers = {}
    for precision in ("fp32", "bf16"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        samplers[precision] = od.FusedSampler(cuda_model, plan, shape=shape, precision=precision)
        torch.cuda.synchronize()  # sync: the capture time is wall-clock
        results[f"cuda_{precision}_capture_s"] = time.perf_counter() - t0
    images = samplers["fp32"](generator=torch.Generator(device).manual_seed(0))
    results["fp32_max_abs_diff_vs_original"] = (images - expected).abs().max().item()  # sync: one number
    bf16_images = samplers["bf16"](generator=torch.Generator(device).manual_seed(0))
    results["bf16_mean_abs_diff_vs_original"] = (bf16_images - expected).abs().mean().item()

    results["original_fp32"] = summary(cuda_time_ms(original, repeats=args.repeats))
    for precision, sampler in samplers.items():
        results[f"cuda_{precision}"] = summary(
            cuda_time_ms(lambda s=sampler: s(generator=torch.Generator(device).manual_seed(0)), repeats=args.repeats)
        )
    results["cuda_fp32_one_shot_with_capture"] = summary(
        cuda_time_ms(
            lambda: od.sample(cuda_model, plan, shape=shape, generator=torch.Generator(device).manual_seed(0)),
            repeats=max(3, args.repeats // 2),
        )
    )
    base = results["original_fp32"]["median_ms"]
    results["speedup_vs_original"] = {
        name: base / results[name]["median_ms"]
        for name in ("cuda_fp32", "cuda_bf16", "cuda_fp32_one_shot_with_capture")
    }
    results["per_step_ms"] = {
        name: results[name]["median_ms"] / args.steps for name in ("original_fp32", "cuda_fp32", "cuda_bf16")
    }
    return results


def bench_fused_step(args: argparse.Namespace) -> dict:
    """The op alone (DDPM step with noise, float32): fused vs the p_step reference's ~10 kernels."""
    device = DEVICE
    plan = (
        NoiseSchedule(ScheduleConfig(num_timesteps=1000))
        .to(device)
        .make_plan("ddpm", sampling_steps=100, device=device)
    )
    shape = (args.batch, 3, 256, 256)  # 50 MB per tensor: well past the 50-60 MB L2 in total
    g = torch.Generator(device).manual_seed(0)
    x, eps, noise = (torch.randn(shape, device=device, generator=g) for _ in range(3))
    step = torch.tensor(10, device=device)
    numel = x.numel()
    # Floors: reads x, eps, noise and writes x (4 float32 per element); 8 FLOPs per element
    # (5 multiplies, 3 adds), so the op is memory bound: time it against the bytes.
    min_bytes = 4 * 4 * numel

    def fused():
        ops.fused_step_(
            x,
            eps,
            noise=noise,
            xstart=None,
            coefficients=plan.coefficients,
            step=step,
            clip_denoised=True,
            use_prev=False,
        )

    def reference():
        p_step(plan, 10, x, eps, noise=noise)

    out = {"shape": list(shape), "min_bytes": min_bytes, "flops_per_element": 8}
    # The ceiling: a device-to-device copy of the same bytes (read + write counted).
    src, dst = torch.randn(2 * numel, device=device), torch.empty(2 * numel, device=device)
    copy_ms = statistics.median(cuda_time_ms(lambda: dst.copy_(src), repeats=50))
    out["copy_GBps"] = 2 * 4 * 2 * numel / (copy_ms * 1e-3) / 1e9
    for name, fn in (("fused_step", fused), ("p_step_reference", reference)):
        times = cuda_time_ms(fn, repeats=50)
        med = statistics.median(times)
        out[name] = {"median_ms": med, "effective_GBps": min_bytes / (med * 1e-3) / 1e9}
    out["speedup"] = out["p_step_reference"]["median_ms"] / out["fused_step"]["median_ms"]
    out["fused_step_share_of_copy_bandwidth"] = out["fused_step"]["effective_GBps"] / out["copy_GBps"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="DDPM sampling steps")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_sampling: needs a CUDA GPU", file=sys.stderr)
        return 2
    source = ops.load_extension()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "extension": source,
        "config": vars(args),
        "sampling": bench_sampling(args),
        "fused_step_op": bench_fused_step(args),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
