"""Where a U-Net forward's time goes, per kernel category: the profile stage of scripts/gpu_check.sh.

    python scripts/gpu_profile.py --out OUTDIR [--img_size 28 --channels 1 --batch 64 --precision bf16]

For the fused runner (optimized_diffusion.FusedUNet; on a GPU also with group_norm_act's kernel forced to 1, 2 and
4 groups per block) and the autocast eager U-Net (the step kernels' U-Net), on the same random "small" U-Net and
inputs: GPU time per category (convolution, GEMM, group_norm_act, attention, the fused step, layout copies and
casts, other elementwise), each convolution shape's TFLOP/s, and each group_norm_act call's GB/s (its minimum
traffic: inputs read once, output written once) against a measured device copy's. On a CPU (a smoke run) the same
tables come from CPU op times. Writes OUTDIR/profile.json and OUTDIR/profile.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Kernel (GPU) or operator (CPU) name fragments, checked in this order; the first match names the category.
CATEGORIES = (
    ("group_norm_act", ("group_norm_act",)),
    ("fused_step", ("fused_step", "gather_timestep")),
    ("attention", ("flash", "fmha", "attention", "softmax")),
    (
        "convolution",
        ("conv", "cudnn", "implicit_gemm", "xmma_fprop", "sm90_xmma", "winograd", "fprop", "mkldnn_convolution"),
    ),
    ("gemm", ("gemm", "cutlass", "addmm", "matmul", "aten::mm", "bmm", "linear")),
    (
        "copy/cast/layout",
        ("copy", "cast", "to_copy", "nchwtonhwc", "nhwctonchw", "transpose", "cat", "contiguous", "clone"),
    ),
)


def category(name: str) -> str:
    """The category of a kernel or operator name (case-insensitive): see CATEGORIES; else 'other'."""
    lowered = name.lower()
    for label, fragments in CATEGORIES:
        if any(fragment in lowered for fragment in fragments):
            return label
    return "other"


def copy_bandwidth_gbs(device: torch.device, *, megabytes: int = 256, repeats: int = 20) -> float:
    """A device-to-device copy's GB/s (bytes read + written): the bandwidth the op's GB/s is compared with."""
    from ddpm.benchmarks.sampling_bench import time_runs

    src = torch.randn(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times, _ = time_runs(lambda: dst.copy_(src), device=device, warmup=3, repeats=repeats)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def profile_forward(forward, *, device: torch.device, repeats: int) -> dict:
    """Per-category time (ms per forward), per-convolution-shape TFLOP/s and per-group_norm_act-shape GB/s."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(3):
        forward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities, record_shapes=True, with_flops=True) as prof:
        for _ in range(repeats):
            forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    on_gpu = device.type == "cuda"
    per_category: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            per_category[category(event.name)] += event.device_time / 1000 / repeats  # us -> ms per forward
            kernels[event.name] += event.device_time / 1000 / repeats
        elif not on_gpu and event.device_type == torch.autograd.DeviceType.CPU:
            per_category[category(event.name)] += (
                event.self_cpu_time_total / 1000 / repeats
            )  # self time: no double count
    convolutions, norms = [], []
    averages = prof.key_averages(group_by_input_shape=True)
    with_flops = {avg.key for avg in averages if avg.flops and "conv" in avg.key}  # the outermost op that counts them
    conv_key = next((k for k in ("aten::conv2d", "aten::conv3d", "aten::convolution") if k in with_flops), None)
    for avg in averages:
        ms = (avg.device_time_total if on_gpu else avg.cpu_time_total) / 1000 / avg.count
        if avg.key == conv_key:
            convolutions.append(
                {
                    "input_shapes": str(avg.input_shapes[:2]),
                    "calls_per_forward": avg.count / repeats,
                    "ms": ms,
                    "tflops": avg.flops / avg.count / (ms / 1000) / 1e12,
                }
            )
        elif (
            avg.key == "diffusion_kernels::conv3x3_winograd"
        ):  # the CPU runner's 3x3 convolutions (x, U (16 or 36, Cin, Cout))
            (batch, cin, *spatial), (products, _, cout) = avg.input_shapes[0], avg.input_shapes[1]
            outputs = torch.Size(spatial).numel() * (
                4 if products == 36 else 1
            )  # 36 products: the upsampling mode (2x2 up)
            flops = (
                2 * batch * outputs * cin * cout * 9
            )  # a direct convolution's (of the upsampled input): "effective" TFLOP/s
            label = f"winograd{' upsample' if products == 36 else ''} {avg.input_shapes[0]} -> {cout}"
            convolutions.append(
                {
                    "input_shapes": label,
                    "calls_per_forward": avg.count / repeats,
                    "ms": ms,
                    "tflops": flops / (ms / 1000) / 1e12,
                }
            )
        elif avg.key == "diffusion_kernels::group_norm_act":
            shapes = [s for s in avg.input_shapes[:2] if s]  # x, x2
            elements = sum(torch.Size(s).numel() for s in shapes)
            out_channels = avg.input_shapes[2][0]  # weight: (C,)
            out_elements = shapes[0][0] * out_channels * torch.Size(shapes[0][2:]).numel()
            norms.append(
                {
                    "input_shapes": str(shapes),
                    "calls_per_forward": avg.count / repeats,
                    "ms": ms,
                    "elements": elements,
                    "out_elements": out_elements,
                }
            )
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        "ms_per_forward": dict(sorted(per_category.items(), key=lambda kv: -kv[1])),
        "total_ms": sum(per_category.values()),
        "convolutions": convolutions,
        "group_norm_act": norms,
        "top_kernels": [{"name": n, "ms": v} for n, v in top],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for profile.json and profile.txt")
    parser.add_argument("--img_size", type=int, default=28)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    import optimized_diffusion as od
    from basic_diffusion import UNet, unet_preset
    from ddpm.util.precision import LOW_DTYPES, autocast, backend_policy

    device = torch.device(args.device)
    if device.type == "cpu":
        from ddpm.util.memory import keep_freed_memory

        keep_freed_memory()  # as benchmark and sample modes run on the CPU: no page faults in the profile
    torch.manual_seed(0)
    model = UNet(unet_preset("small", image_size=args.img_size, in_channels=args.channels)).to(device).eval()
    dtype = LOW_DTYPES.get(args.precision, torch.float32)
    runner = od.FusedUNet(model, dtype=dtype)
    x = torch.randn(args.batch, args.channels, args.img_size, args.img_size, device=device)
    t = torch.randint(0, 1000, (args.batch,), device=device)
    bytes_per_element = torch.finfo(dtype).bits // 8
    copy_gbs = copy_bandwidth_gbs(device)

    def eager() -> torch.Tensor:
        with autocast(device.type, args.precision, cache_enabled=False):
            return model(x, t)

    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "shape": list(x.shape),
        "precision": args.precision,
        "copy_gbs": copy_gbs,
        "runs": {},
    }
    with torch.no_grad(), backend_policy(args.precision):
        runs = [("fused_unet", lambda: runner(x, t), {}), ("eager_autocast", eager, {})]
        if device.type == "cuda":  # group_norm_act's kernels (same bits): the default rows kernel against the chunk
            # kernel (one thread per value) and at 2, 4 and 8 groups per block
            variants = [("fused_unet_chunk_kernel", {"DIFFUSION_KERNELS_GN_KERNEL": "chunk"})]
            variants += [(f"fused_unet_rows_{n}_groups_per_block", {"DIFFUSION_KERNELS_GN_CHUNK": n}) for n in "248"]
            runs[1:1] = [(name, lambda: runner(x, t), env) for name, env in variants]
        for name, forward, env in runs:
            for knob in ("DIFFUSION_KERNELS_GN_CHUNK", "DIFFUSION_KERNELS_GN_KERNEL"):
                os.environ.pop(knob, None)
            os.environ.update(env)
            run = profile_forward(forward, device=device, repeats=args.repeats)
            for norm in run["group_norm_act"]:
                norm["gbs"] = (norm["elements"] + norm["out_elements"]) * bytes_per_element / (norm["ms"] / 1000) / 1e9
                norm["of_copy"] = norm["gbs"] / copy_gbs
            results["runs"][name] = run

    lines = [
        f"{results['device']}, torch {results['torch']}, {results['date']}: U-Net forward {tuple(x.shape)} "
        f"{args.precision}",
        f"device copy: {copy_gbs:.0f} GB/s (read + write)",
    ]
    for name, run in results["runs"].items():
        lines.append(f"\n{name}: {run['total_ms']:.3f} ms per forward")
        lines += [f"  {label:<18} {ms:8.3f} ms" for label, ms in run["ms_per_forward"].items()]
        lines.append("  convolutions (per shape): ms per call, TFLOP/s")
        lines += [f"    {c['input_shapes']:<60} {c['ms']:.4f}  {c['tflops']:.3g}" for c in run["convolutions"]]
        if run["group_norm_act"]:
            lines.append("  group_norm_act (per shape): ms per call, GB/s, share of the copy's")
            lines += [
                f"    {n['input_shapes']:<60} {n['ms']:.4f}  {n['gbs']:.0f}  {100 * n['of_copy']:.0f}%"
                for n in run["group_norm_act"]
            ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(results, indent=2))
    (out / "profile.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
