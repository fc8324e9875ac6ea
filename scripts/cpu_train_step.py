"""Where a CPU training step of the demo's U-Net goes, part by part, and the trainer against its previous self.

    OMP_NUM_THREADS=2 python scripts/cpu_train_step.py OUT.json [--rounds 12] [--allocator-pairs 5]

How results/cpu-2026-11-27-train-step/ was measured. Three parts (four with --allocator-pairs), on the demo's
model (the small preset at 8x8, 32 base channels, one residual block per level, batch 128, fp32, the offline digits):

1. AdamW's step, gradient clipping and the EMA update on the model's 166 tensors: torch's default (foreach) AdamW
   against ``fused=True``, each timed over 200 calls.
2. Dropout on the residual blocks' shapes: ``torch.nn.functional.dropout`` against the extension's
   ``seeded_dropout`` (ddpm/kernels/ops.py).
3. Whole training steps, interleaved (A B C D, A B C D, ...: a machine whose speed drifts over minutes moves every
   variant alike), each variant's median ms/step and its time over the previous trainer's, round by round:
   "previous" (foreach AdamW, torch's dropout: the trainer before fused AdamW and seeded dropout), "fused AdamW"
   (torch's dropout), "now" (what the trainer runs) and "now, no dropout" (the floor dropout could reach).
4. With ``--allocator-pairs N``: the trainer with and without keep_freed_memory (ddpm/util/memory.py), which
   changes malloc for the whole process, so each run is its own process: N pairs, one after the other, each 5 warm-up
   and 15 timed steps, reporting wall ms/step, minor page faults, user and system CPU ms per step and peak RSS.
"""

import argparse
import datetime
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's flat layout

from basic_diffusion import unet_preset  # noqa: E402
from ddpm.benchmarks.report import environment  # noqa: E402
from ddpm.data.datasets import load_images  # noqa: E402
from ddpm.kernels.ops import SeededDropout, seeded_dropout_available  # noqa: E402
from ddpm.training.trainer import TrainConfig, Trainer  # noqa: E402
from noise_schedule import ScheduleConfig  # noqa: E402

BATCH, LR = 128, 1.5e-3
DROPOUT_SHAPES = ((128, 32, 8, 8), (128, 64, 4, 4), (128, 64, 2, 2))


def model_config(**overrides):
    return unet_preset("small", image_size=8, in_channels=1, model_channels=32, num_res_blocks=1, **overrides)


def ms_per_call(fn, calls: int = 200) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def optimizer_parts() -> dict:
    model = model_config().build()
    ema = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    result = {"tensors": len(params), "parameters": sum(p.numel() for p in params)}
    for name, fused in (("foreach", None), ("fused", True)):
        optimizer = torch.optim.AdamW(params, lr=LR, fused=fused)
        result[f"adamw_{name}_ms"] = ms_per_call(optimizer.step)
    result["clip_grad_norm_ms"] = ms_per_call(lambda: nn.utils.clip_grad_norm_(params, 1.0))
    result["ema_lerp_ms"] = ms_per_call(lambda: torch._foreach_lerp_(ema, params, 1e-3))
    return result


def dropout_parts() -> list[dict]:
    rows = []
    for shape in DROPOUT_SHAPES:
        x = torch.randn(shape)
        rows.append(
            {
                "shape": list(shape),
                "torch_dropout_ms": ms_per_call(lambda x=x: F.dropout(x, 0.1, training=True)),
                "seeded_dropout_ms": ms_per_call(lambda x=x: torch.ops.diffusion_kernels.seeded_dropout(x, 1, 0.1)),
            }
        )
    return rows


def previous_trainer(trainer: Trainer, *, fused: bool) -> None:
    """Undo what the trainer now does on a CPU: torch's dropout back, and (unless ``fused``) foreach AdamW."""
    for parent in trainer.model.modules():
        for name, child in parent.named_children():
            if isinstance(child, SeededDropout):
                setattr(parent, name, nn.Dropout(child.p))
    if not fused:
        trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=LR)


def demo_trainer(config, images) -> Trainer:
    """A CPU trainer of the demo's recipe (batch 128, lr 1.5e-3) for the U-Net ``config``."""
    train = TrainConfig(dataset="digits", total_steps=10**6, batch_size=BATCH, lr=LR, save_every=0, sample_every=0)
    return Trainer(train, config, ScheduleConfig(), images=images, device="cpu")


def paired_steps(rounds: int, steps: int = 5) -> list[dict]:
    images = load_images("digits", data_dir="data", image_size=8)
    variants = {
        "previous": (model_config(), dict(fused=False)),
        "fused AdamW": (model_config(), dict(fused=True)),
        "now": (model_config(), None),
        "now, no dropout": (model_config(dropout=0.0), None),
    }
    trainers = {}
    for name, (config, undo) in variants.items():
        trainer = demo_trainer(config, images)
        if undo is not None:
            previous_trainer(trainer, **undo)
        for _ in range(3):
            trainer.train_step()
        trainers[name] = trainer
    times = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    base = times["previous"]
    return [
        {
            "variant": name,
            "median_ms_per_step": statistics.median(t),
            "min_ms_per_step": min(t),
            "speedup_vs_previous": statistics.median(b / x for b, x in zip(base, t)),
            "ms_per_step": t,
        }
        for name, t in times.items()
    ]


def allocator_run(mode: str, steps: int = 15) -> dict:
    """One process's measurement: glibc's default malloc ("default") or the trainer's kept memory ("kept")."""
    import ddpm.training.trainer as trainer_module

    if mode == "default":
        trainer_module.keep_freed_memory = lambda: False
    trainer = demo_trainer(model_config(), load_images("digits", data_dir="data", image_size=8))
    for _ in range(5):
        trainer.train_step()
    before, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        times.append((time.perf_counter() - start) * 1e3)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "mode": mode,
        "median_ms_per_step": statistics.median(times),
        "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
        "user_ms_per_step": (after.ru_utime - before.ru_utime) * 1e3 / steps,
        "sys_ms_per_step": (after.ru_stime - before.ru_stime) * 1e3 / steps,
        "max_rss_mb": after.ru_maxrss / 1024,  # Linux: KiB
    }


def allocator_pairs(pairs: int) -> dict:
    runs = []
    for _ in range(pairs):
        for mode in ("default", "kept"):
            out = subprocess.run(
                [sys.executable, __file__, "-", "--allocator-run", mode], capture_output=True, text=True, check=True
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in ("default", "kept")}
    summary = {
        mode: {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "mode"}
        for mode, rows in by_mode.items()
    }
    ratios = [d["median_ms_per_step"] / k["median_ms_per_step"] for d, k in zip(by_mode["default"], by_mode["kept"])]
    return {"runs": runs, "median": summary, "pair_speedups": ratios, "median_pair_speedup": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds of 5 steps per variant")
    parser.add_argument("--allocator-pairs", type=int, default=0, help="process pairs timing keep_freed_memory")
    parser.add_argument("--allocator-run", choices=("default", "kept"), help=argparse.SUPPRESS)  # one such process
    args = parser.parse_args()
    if args.allocator_run:
        print(json.dumps(allocator_run(args.allocator_run)))
        return
    if not seeded_dropout_available():
        sys.exit("the extension is not built, or predates seeded_dropout: make install")
    result = {
        "environment": environment(torch.device("cpu")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "optimizer": optimizer_parts(),
        "dropout": dropout_parts(),
        "paired_steps": paired_steps(args.rounds),
    }
    if args.allocator_pairs:
        result["allocator"] = allocator_pairs(args.allocator_pairs)
    print(json.dumps({k: v for k, v in result.items() if k != "paired_steps"}, indent=1))
    for row in result["paired_steps"]:
        print(
            f"{row['variant']:<18} median {row['median_ms_per_step']:6.1f} ms/step, "
            f"min {row['min_ms_per_step']:6.1f}, {row['speedup_vs_previous']:.3f}x the previous trainer"
        )
    if "allocator" in result:
        for mode, row in result["allocator"]["median"].items():
            print(
                f"malloc {mode:<8} median {row['median_ms_per_step']:6.1f} ms/step, {row['faults_per_step']:6.0f} "
                f"page faults, user {row['user_ms_per_step']:.1f} ms, sys {row['sys_ms_per_step']:.1f} ms per step, "
                f"peak RSS {row['max_rss_mb']:.0f} MB"
            )
        print(f"kept memory: {result['allocator']['median_pair_speedup']:.3f}x (median of the pairs)")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
