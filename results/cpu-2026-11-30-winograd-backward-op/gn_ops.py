"""group_norm_act and its backward op alone, batch 128, channels-last fp32, 2 threads, ms a call (means of 15):
with and without SiLU, against a clone of the same tensor.

    PYTHONPATH=. python results/cpu-2026-11-30-winograd-backward-op/gn_ops.py
"""

import time

import torch

from ddpm.kernels import ops
from ddpm.util.memory import keep_freed_memory

ops.load_extension(allow_jit=False)
keep_freed_memory()
torch.set_num_threads(2)
K = torch.ops.diffusion_kernels


def t(f, n=15):
    for _ in range(3):
        f()
    s = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - s) / n * 1e3


print(torch.backends.cpu.get_cpu_capability())
for C, S in ((32, 28), (64, 14), (64, 8), (128, 4)):
    x = torch.randn(128, C, S, S).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(C), torch.randn(C)
    sc, sh = torch.randn(128, C), torch.randn(128, C)
    g = torch.randn_like(x)
    r = {}
    r["clone"] = t(lambda: x.clone())
    for silu in (True, False):
        r[f"fwd{'_silu' if silu else ''}"] = t(
            lambda: K.group_norm_act(x, None, w, b, None, sc, sh, groups=32, eps=1e-5, silu=silu)
        )
        r[f"bwd{'_silu' if silu else ''}"] = t(
            lambda: K.group_norm_act_backward(g, x, w, b, sc, sh, groups=32, eps=1e-5, silu=silu)
        )
    print(f"C{C} {S}x{S}:", " ".join(f"{k} {v:.3f}" for k, v in r.items()))
