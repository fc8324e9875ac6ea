"""Where the 28x28 recipe's training step goes, by part, for the fp32 eager row (NCHW, PyTorch's and oneDNN's ops, as
`--bench training --rows fp32` builds it) and the default (what `--mode train` runs on this CPU): torch.profiler's
operator self time a step, grouped.

    PYTHONPATH=. python results/cpu-2026-11-30-norm-skip/step_parts.py [--steps 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "results/cpu-2026-11-30-training-28")
from step_time import recipe_trainer  # noqa: E402

EAGER = dict(precision="fp32", compile=False, cuda_fast_path=False, cpu_channels_last=False, winograd_convs=False)
# (part, operator names' prefixes or exact names), matched in order.
PARTS = [
    ("3x3 convolutions, Winograd forward", ("diffusion_kernels::conv3x3_winograd",)),
    ("3x3 convolutions, Winograd backward", ("diffusion_kernels::conv3x3_winograd_backward",)),
    ("convolutions, oneDNN forward", ("aten::mkldnn_convolution", "aten::convolution_overrideable")),
    ("convolutions, oneDNN backward", ("aten::convolution_backward", "aten::mkldnn_convolution_backward")),
    (
        "GroupNorm + scale-shift + SiLU",
        (
            "diffusion_kernels::group_norm_act",
            "diffusion_kernels::group_norm_act_backward",
            "aten::native_group_norm",
            "aten::silu",
            "aten::silu_backward",
            "aten::native_group_norm_backward",
            "aten::mul",
        ),
    ),
    ("GEMMs (1x1 convolutions, linear layers)", ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")),
    (
        "attention",
        (
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
            "aten::_softmax",
        ),
    ),
    (
        "additions, concatenations, copies",
        ("aten::add", "aten::add_", "aten::cat", "aten::copy_", "aten::clone", "aten::sum"),
    ),
]


def part_of(name: str) -> str:
    for part, names in PARTS:
        if name in names:
            return part
    return "the rest (optimizer, loss, embeddings, allocation)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    table: dict[str, dict[str, float]] = {}
    for row in ("fp32", "default"):
        with tempfile.TemporaryDirectory() as folder:
            trainer = recipe_trainer(side=28, channels=1, batch=128, folder=folder, **(EAGER if row == "fp32" else {}))
            for _ in range(3):
                trainer.train_step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    trainer.train_step()
        parts = table[row] = {}
        for event in prof.key_averages():
            if event.key.startswith(("aten::", "diffusion_kernels::")):
                part = part_of(event.key)
                parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total / 1e3 / args.steps
        rest = sorted(
            (e.self_cpu_time_total, e.key) for e in prof.key_averages() if part_of(e.key).startswith("the rest")
        )
        print(
            f"{row}: {trainer.step_layout or 'NCHW'}; the rest's largest: {[k for _, k in rest[-6:]]}", file=sys.stderr
        )
    names = [p for p, _ in PARTS] + ["the rest (optimizer, loss, embeddings, allocation)"]
    print(
        f"# 28x28x1, batch 128, torch {torch.__version__}, {torch.get_num_threads()} threads: ms a step "
        f"(operators' self time, {args.steps} steps under torch.profiler)"
    )
    print("| part | fp32 eager | default |")
    print("| --- | --- | --- |")
    for name in names:
        print(f"| {name} | {table['fp32'].get(name, 0.0):.0f} | {table['default'].get(name, 0.0):.0f} |")
    print(f"| total | {sum(table['fp32'].values()):.0f} | {sum(table['default'].values()):.0f} |")


if __name__ == "__main__":
    main()
