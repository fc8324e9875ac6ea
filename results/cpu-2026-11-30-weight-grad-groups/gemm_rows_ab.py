"""The 1x1 convolutions' row GEMMs (M pixels x K channels @ K x N) by the Winograd GEMM's register tile over the rows
(`gemm_rows_`, a scratch op: gemm_rows.diff) against MKL's torch.mm and addmm_: milliseconds, medians of 40, and
each one's largest relative error against float64.

    OMP_NUM_THREADS=2 PYTHONPATH=. python results/cpu-2026-11-30-weight-grad-groups/gemm_rows_ab.py
"""

import statistics
import time

import torch

from ddpm.kernels import ops

ops.load_extension()
Kops = torch.ops.diffusion_kernels
torch.set_num_threads(2)


def med(f, n=40):
    for _ in range(5):
        f()
    ts = []
    for _ in range(n):
        s = time.perf_counter()
        f()
        ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e3


torch.manual_seed(0)
for M, K, N in (
    (100352, 32, 32),
    (100352, 64, 32),
    (100352, 32, 64),
    (100352, 96, 32),
    (25088, 64, 64),
    (25088, 128, 64),
    (25088, 96, 64),
    (6272, 64, 192),
    (6272, 192, 64),
    (6272, 64, 64),
    (6272, 128, 64),
):
    x = torch.randn(M, K)
    b = torch.randn(K, N)
    out = torch.empty(M, N)
    out2 = torch.empty(M, N)
    Kops.gemm_rows_(out, x, b, False)
    ref = x.double() @ b.double()
    mkl = x @ b
    err_ours = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    err_mkl = ((mkl.double() - ref).abs().max() / ref.abs().max()).item()
    t_mkl = med(lambda: torch.mm(x, b, out=out2))
    t_ours = med(lambda: Kops.gemm_rows_(out, x, b, False))
    t_mkl_acc = med(lambda: out2.addmm_(x, b))
    t_ours_acc = med(lambda: Kops.gemm_rows_(out, x, b, True))
    line = f"{M}x{K}x{N}: mm {t_mkl:.2f} ours {t_ours:.2f} ({t_mkl / t_ours:.2f}x)"
    line += f"  addmm_ {t_mkl_acc:.2f} ours {t_ours_acc:.2f} ({t_mkl_acc / t_ours_acc:.2f}x)"
    print(f"{line}  err {err_ours:.1e} mkl {err_mkl:.1e}", flush=True)
