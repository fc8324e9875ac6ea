#!/usr/bin/env bash
# The training step with fp32's 3x3 convolutions in Winograd's domain by default, against its peers, nothing else
# running: AVX2 kernels everywhere (oneDNN, ATen, the extension's GEMM), then AVX-512 without native bf16.
#   bash results/cpu-2026-11-29-winograd-training/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/cpu-2026-11-29-winograd-training
common=(--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0)
avx2=(env DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DDPM_KERNELS_ISA=avx2 DDPM_NATIVE_BF16=0
  TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)")
"${avx2[@]}" python main.py "${common[@]}" --dataset mnist_5k --train_steps 8 \
  --rows default,fp32_nhwc,diffusers,fp32_compile --json "$out/mnist28_avx2.json" > "$out/mnist28_avx2.log" 2>&1
"${avx2[@]}" python main.py "${common[@]}" --dataset mnist_5k --img_size 8 --channels 4 --train_steps 30 \
  --rows default,fp32_nhwc,diffusers,fp32_compile --json "$out/latent8_avx2.json" > "$out/latent8_avx2.log" 2>&1
DDPM_NATIVE_BF16=0 python main.py "${common[@]}" --dataset mnist_5k --train_steps 8 \
  --rows default,fp32_nhwc --json "$out/mnist28_avx512_fp32.json" > "$out/mnist28_avx512_fp32.log" 2>&1
