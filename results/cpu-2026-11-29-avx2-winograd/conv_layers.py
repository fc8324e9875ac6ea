import os, sys, time, torch, torch.nn.functional as F
sys.path.insert(0, '/work/main')
from ddpm.kernels import ops
ops.load_extension()
torch.manual_seed(0)
print("capability", torch.backends.cpu.get_cpu_capability(), "DNNL", os.environ.get("DNNL_MAX_CPU_ISA"), "ISA", os.environ.get("DDPM_KERNELS_ISA"), "threads", torch.get_num_threads())
def bench(f, reps):
    for _ in range(3): f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2]
for B, C, H in [(64, 32, 28), (64, 64, 14), (64, 64, 7), (64, 64, 16), (64, 128, 8), (64, 256, 4), (128, 32, 8), (128, 64, 4), (16, 128, 32), (16, 256, 16)]:
    x = torch.randn(B, C, H, H).contiguous(memory_format=torch.channels_last)
    w = torch.randn(C, C, 3, 3) * 0.05; b = torch.randn(C)
    U = ops.winograd_weight(w)
    flops = 2 * B * C * C * 9 * H * H
    reps = max(5, int(2e10 / flops))
    with torch.no_grad():
        t1 = bench(lambda: F.conv2d(x, w, b, padding=1), reps)
        t2 = bench(lambda: torch.ops.diffusion_kernels.conv3x3_winograd(x, U, b), reps)
    print(f"B{B} C{C} {H}x{H}: oneDNN {t1*1e3:8.2f} ms ({flops/t1/1e9:6.1f} GFLOP/s)  winograd {t2*1e3:8.2f} ms  ratio {t1/t2:5.2f}x")
