#!/usr/bin/env bash
# The sampling rows on AVX2 kernels (the AVX2 table's command in BENCHMARKS, "The default path on an AVX2 CPU") after
# this folder's GEMM broadcast and tile-major scratch, which the runner's float32 Winograd shares; nothing else running.
#   bash results/cpu-2026-11-30-training-28/run_sampling.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/cpu-2026-11-30-training-28
env DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DDPM_KERNELS_ISA=avx2 DDPM_NATIVE_BF16=0 \
  TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python main.py --mode benchmark --device cpu --img_size 16 --channels 1 \
  --n_samples 64 --sampler ddim --sampling_steps 50 --warmup 1 --repeats 3 --interleave --precision fp32 \
  --rows original,cuda,cuda_onednn,compile,onnxruntime --json "$out/sampling_avx2.json" > "$out/sampling_avx2.log" 2>&1
