"""How much a benchmark runs, and how long that will take, decided and said before anything is timed.

    plan = choose_plan(device_type="cpu", steps=1000, rows="all", auto_row="cuda")
    plan.steps, plan.rows, plan.note     # 20, "original,cuda,tensorrt,compile,onnxruntime,openvino", "quick plan: ..."
    print(estimate_line(rows=5, runs_per_row=4, steps=50, forward_s=0.13))

A benchmark left at its defaults runs a quick plan, since every row at DDPM's full step count is slow: the rows
of :data:`QUICK_ROWS`, the row ``--implementation auto`` runs, and on a CPU at most :data:`CPU_QUICK_STEPS` steps
(the same sampler, respaced). Whatever the user gave is kept, and the header says how to ask for the full run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpm.util.messages import format_seconds

CPU_QUICK_STEPS = 20
QUICK_ROWS = {
    "cuda": ("original", "cuda", "tensorrt"),
    "cpu": ("original", "cuda", "tensorrt", "compile", "onnxruntime", "openvino"),
}


@dataclass(frozen=True)
class RunPlan:
    steps: int | None  # None: the sampler's default
    rows: str  # --rows' text
    note: str = ""  # what the quick plan changed and how to ask for the full run ('' when nothing changed)


def choose_plan(
    *,
    device_type: str,
    steps: int,
    rows: str,
    auto_row: str | None = None,
    steps_given: bool = False,
    rows_given: bool = False,
) -> RunPlan:
    """The steps and rows to run. ``steps``: the sampler's steps as requested or defaulted; ``auto_row``: what
    ``--implementation auto`` runs here (timed too); ``*_given``: whether the user chose that value (kept as is)."""
    changes, full = [], []
    if device_type == "cpu" and not steps_given and steps > CPU_QUICK_STEPS:
        changes.append(f"{CPU_QUICK_STEPS} of the sampler's {steps} steps")
        full.append(f"--sampling_steps {steps}")
        steps = CPU_QUICK_STEPS
    if not rows_given and rows == "all" and device_type in QUICK_ROWS:
        quick = list(QUICK_ROWS[device_type])
        if auto_row and auto_row not in quick:
            quick.insert(2, auto_row)
        rows = ",".join(quick)
        changes.append(f"rows {rows}" + (f" (--implementation auto runs {auto_row})" if auto_row else ""))
        full.append("--rows all")
    if not changes:
        return RunPlan(steps, rows)
    every = "every row (torch.compile and max-autotune among them)" if "--rows all" in full else "every step"
    note = f"quick plan: {' and '.join(changes)}; {every}: add {' '.join(full)}"
    return RunPlan(steps, rows, note)


def estimate_seconds(*, rows: int, runs_per_row: int, steps: int, forward_s: float) -> float:
    """Every row's runs at the original U-Net's pace (one forward per step): building (exports, compiles) aside."""
    return rows * runs_per_row * steps * forward_s


def estimate_line(*, rows: int, runs_per_row: int, steps: int, forward_s: float) -> str:
    total = estimate_seconds(rows=rows, runs_per_row=runs_per_row, steps=steps, forward_s=forward_s)
    return (
        f"about {format_seconds(total)}: {rows} rows x {runs_per_row} runs x {steps} steps x {1000 * forward_s:.0f} ms "
        "(one forward of the original U-Net, timed now), plus building the rows (exports, compiles)"
    )
