"""Per-step time of the cuda implementation's variants on one GPU, and where a step's time goes.

    python scripts/gpu_explore.py --out DIR [--batch 64 --image-size 28 --channels 1 --steps 50]

For each variant (precision x channels-last x torch.compile inside the graph) builds one
FusedSampler on a random "small" U-Net (DDPM plan), times whole sampling runs with CUDA events
after a warm-up run (median of --repeats), and reports ms per step. Also: the U-Net forward alone,
graph-replayed (the floor the sampling loop is compared with), and a torch.profiler table of the
kernels of one eager bf16 forward and one compiled one (DIR/profile_*.txt). Writes DIR/explore.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_sampling import cuda_time_ms, random_unet  # noqa: E402

import optimized_diffusion as od  # noqa: E402
from ddpm.kernels import ops  # noqa: E402
from ddpm.util.precision import backend_policy  # noqa: E402
from noise_schedule import NoiseSchedule, ScheduleConfig  # noqa: E402


class ChannelsLast(torch.nn.Module):
    """The U-Net with its weights and its input in channels-last (the sampler keeps x_t NCHW)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model.to(memory_format=torch.channels_last)  # in place; values unchanged

    def forward(self, x, t, *labels):
        return self.model(x.contiguous(memory_format=torch.channels_last), t, *labels)


def graphed_forward_ms(model, *, shape, precision, channels_last, repeats=50):
    """The U-Net forward alone, captured in a CUDA graph, median ms per replay."""
    model = copy.deepcopy(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(shape, device="cuda")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    t = torch.full((shape[0],), 500, device="cuda", dtype=torch.long)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    ac = lambda: torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None, cache_enabled=False)  # noqa: E731
    with torch.no_grad(), backend_policy(precision):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), ac():
            for _ in range(3):
                model(x, t)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), ac():
            model(x, t)
        times = cuda_time_ms(g.replay, repeats=repeats)
    return statistics.median(times)


def profile_table(model, *, shape, precision, compiled: bool, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = copy.deepcopy(model).to(memory_format=torch.channels_last)
    if compiled:
        model = torch.compile(model, dynamic=False)
    x = torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last)
    t = torch.full((shape[0],), 500, device="cuda", dtype=torch.long)
    with torch.no_grad(), backend_policy(precision), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):
            model(x, t)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                model(x, t)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    path.write_text(table)
    print(f"--- profile ({'compiled' if compiled else 'eager'}, {precision}, 5 forwards)\n{table[:4000]}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--variants",
        default="fp32:cl,fp32:nchw,bf16:cl,bf16:nchw,fp16:cl,bf16:cl:compile,bf16:nchw:compile,fp32:cl:compile",
    )
    p.add_argument("--skip-profile", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ops.load_extension()
    model = random_unet(image_size=args.image_size, channels=args.channels)
    shape = (args.batch, args.channels, args.image_size, args.image_size)
    plan = (
        NoiseSchedule(ScheduleConfig(num_timesteps=1000))
        .to("cuda")
        .make_plan("ddpm", sampling_steps=args.steps, device="cuda")
    )
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": shape,
        "steps": args.steps,
        "rows": [],
    }
    for spec in args.variants.split(","):
        parts = spec.split(":")
        precision, cl, comp = parts[0], parts[1] == "cl", "compile" in parts
        row = {"variant": spec}
        try:
            t0 = time.perf_counter()
            network = ChannelsLast(copy.deepcopy(model)) if cl else copy.deepcopy(model)
            sampler = od.FusedSampler(network, plan, shape=shape, precision=precision, compile_model=comp)
            torch.cuda.synchronize()
            row["build_s"] = time.perf_counter() - t0
            times = cuda_time_ms(
                lambda: sampler(generator=torch.Generator("cuda").manual_seed(0)), repeats=args.repeats
            )
            row["ms_per_step"] = statistics.median(times) / args.steps
            if not comp:
                row["forward_graphed_ms"] = graphed_forward_ms(
                    model, shape=shape, precision=precision, channels_last=cl
                )
                row["loop_over_forward"] = row["ms_per_step"] / row["forward_graphed_ms"]
            sampler = None  # free the graphs before the next row
        except Exception as exc:  # report and go on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        torch.cuda.empty_cache()
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    if not args.skip_profile:
        for compiled in (False, True):
            try:
                profile_table(
                    model,
                    shape=shape,
                    precision="bf16",
                    compiled=compiled,
                    path=out / f"profile_{'compiled' if compiled else 'eager'}.txt",
                )
            except Exception as exc:
                print(f"profile failed: {type(exc).__name__}: {exc}")
    (out / "explore.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
