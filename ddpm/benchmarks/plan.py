"""How much a benchmark runs, and how long that will take, decided and said before anything is timed.

    plan = choose_plan(device_type="cpu", steps=1000, rows="all", given=frozenset({"n_samples"}))
    plan.steps, plan.rows, plan.note     # 50, "original,cuda,compile,onnxruntime,openvino", "CPU quick plan: ..."
    print(estimate_line(rows=5, runs_per_row=4, steps=50, forward_s=0.13))

On a CPU a default sampling benchmark (DDPM's 1,000 steps, every row, 1 + 3 runs each) takes an hour; so there,
what the user left at its default is planned to finish in a few minutes: at most :data:`CPU_QUICK_STEPS`
steps (the same sampler, respaced) and the rows that answer "which is fastest here" (:data:`CPU_QUICK_ROWS`).
Whatever the user gave is kept, and the header says how to ask for the full run.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_QUICK_STEPS = 50
CPU_QUICK_ROWS = ("original", "cuda", "compile", "onnxruntime", "openvino")


@dataclass(frozen=True)
class RunPlan:
    steps: int | None  # None: the sampler's default
    rows: str  # --rows' text
    note: str = ""  # what the quick plan changed and how to ask for the full run ('' when nothing changed)


def choose_plan(*, device_type: str, steps: int, rows: str, given: frozenset[str] | None) -> RunPlan:
    """The steps and rows to run. ``steps``: the sampler's steps as requested or defaulted; ``given``: the flags
    written on the command line (None: unknown, so everything counts as given and nothing changes)."""
    if device_type != "cpu" or given is None:
        return RunPlan(steps, rows)
    changes, full = [], []
    if "sampling_steps" not in given and steps > CPU_QUICK_STEPS:
        changes.append(f"{CPU_QUICK_STEPS} of the sampler's {steps} steps")
        full.append(f"--sampling_steps {steps}")
        steps = CPU_QUICK_STEPS
    if "rows" not in given and rows == "all":
        rows = ",".join(CPU_QUICK_ROWS)
        changes.append(f"rows {rows}")
        full.append("--rows all")
    if not changes:
        return RunPlan(steps, rows)
    note = f"CPU quick plan: {' and '.join(changes)}; the full run: add {' '.join(full)}"
    return RunPlan(steps, rows, note)


def estimate_seconds(*, rows: int, runs_per_row: int, steps: int, forward_s: float) -> float:
    """Every row's runs at the original U-Net's pace (one forward per step): building (exports, compiles) aside."""
    return rows * runs_per_row * steps * forward_s


def duration(seconds: float) -> str:
    """'45 s', '3 min 20 s', '1 h 05 min'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def estimate_line(*, rows: int, runs_per_row: int, steps: int, forward_s: float) -> str:
    total = estimate_seconds(rows=rows, runs_per_row=runs_per_row, steps=steps, forward_s=forward_s)
    return (
        f"about {duration(total)}: {rows} rows x {runs_per_row} runs x {steps} steps x {1000 * forward_s:.0f} ms "
        "(one forward of the original U-Net, timed now), plus building the rows (exports, compiles)"
    )
