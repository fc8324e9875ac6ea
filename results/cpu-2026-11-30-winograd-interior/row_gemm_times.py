"""The row-GEMM ops of row_gemm_not_kept.diff against MKL (torch.addmm and a^T @ b) at the step's 1x1 shapes:
median milliseconds and the relative error against float64. Needs a build with that diff applied.

    PYTHONPATH=. python results/cpu-2026-11-30-winograd-interior/row_gemm_times.py
"""

from __future__ import annotations

import torch
from op_times import median_ms  # this folder's timing helper (the script's folder is on sys.path)

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

SHAPES = [(100352, 96, 32), (100352, 32, 96), (100352, 64, 32), (100352, 32, 64), (25088, 128, 64), (25088, 64, 128)]


def error(mine: torch.Tensor, exact: torch.Tensor) -> float:
    return ((mine.double() - exact).abs().max() / exact.abs().max()).item()


def main() -> None:
    keep_freed_memory()
    ops.load_extension()
    torch.manual_seed(0)
    for rows, k, m in SHAPES:
        a, b, bias, g = torch.randn(rows, k), torch.randn(k, m), torch.randn(m), torch.randn(rows, m)
        exact, exact_t = a.double() @ b.double() + bias.double(), g.double().t() @ a.double()
        errors = (error(ops.gemm_nn(a, b, bias), exact), error(torch.addmm(bias, a, b), exact))
        errors_t = (error(ops.gemm_tn(g, a), exact_t), error(g.t() @ a, exact_t))
        nn_ms = (median_ms(lambda: ops.gemm_nn(a, b, bias)), median_ms(lambda: torch.addmm(bias, a, b)))
        tn_ms = (median_ms(lambda: ops.gemm_tn(g, a)), median_ms(lambda: g.t() @ a))
        print(
            f"{rows}x{k}->{m}: a @ b ours {nn_ms[0]:.2f} MKL {nn_ms[1]:.2f} ms (err {errors[0]:.1e}, {errors[1]:.1e})"
            f" | a^T @ b ours {tn_ms[0]:.2f} MKL {tn_ms[1]:.2f} ms (err {errors_t[0]:.1e}, {errors_t[1]:.1e})"
        )


if __name__ == "__main__":
    main()
