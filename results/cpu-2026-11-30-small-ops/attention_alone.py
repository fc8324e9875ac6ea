"""One attention's forward and backward alone, on the views AttentionBlock takes of a channels-last qkv (B = 128, 4
heads): scaled_dot_product_attention against two matmuls and a softmax, alternating, 16 pairs a shape.

    PYTHONPATH=. python results/cpu-2026-11-30-attention/attention_alone.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from ddpm.util.memory import keep_freed_memory

keep_freed_memory()
torch.set_num_threads(2)
torch.manual_seed(0)
B, heads = 128, 4
for C, side in ((64, 4), (64, 7), (64, 8), (64, 10), (64, 12), (128, 7), (128, 8), (128, 10), (32, 8), (32, 14)):
    n = side * side
    qkv0 = torch.randn(B, 3 * C, side, side).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    g = torch.randn(B, heads, n, C // heads)

    def views():
        return [t.transpose(1, 2) for t in qkv0.permute(0, 2, 3, 1).reshape(B, n, 3, heads, C // heads).unbind(2)]

    def sdpa():
        q, k, v = views()
        F.scaled_dot_product_attention(q, k, v).backward(g)

    def matmuls():
        q, k, v = views()
        ((q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v).backward(g)

    for f in (sdpa, matmuls, sdpa, matmuls):
        f()
    ratios, ts, tm = [], [], []
    for _ in range(16):
        s = time.perf_counter()
        sdpa()
        a = time.perf_counter() - s
        s = time.perf_counter()
        matmuls()
        b = time.perf_counter() - s
        ratios.append(b / a)
        ts.append(a)
        tm.append(b)
    print(
        f"C{C} {side}x{side} ({n} tokens): sdpa {1e3 * statistics.median(ts):.2f} ms, "
        f"matmuls {1e3 * statistics.median(tm):.2f} ms, ratio median {statistics.median(ratios):.3f}",
        flush=True,
    )
