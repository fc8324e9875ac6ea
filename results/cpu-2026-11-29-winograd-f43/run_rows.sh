#!/usr/bin/env bash
# The training rows with --interleave (built first, then 3 rounds, each row once a round), nothing else running:
# AVX2 kernels everywhere, then this CPU's own (AVX-512, AMX), after F(4x4, 3x3) joined the default step.
#   bash results/cpu-2026-11-29-winograd-f43/run_rows.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/cpu-2026-11-29-winograd-f43
common=(--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0
  --interleave)
avx2=(env DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DDPM_KERNELS_ISA=avx2 DDPM_NATIVE_BF16=0
  TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)")
"${avx2[@]}" python main.py "${common[@]}" --dataset mnist_5k --train_steps 3 \
  --rows default,fp32_nhwc,diffusers,fp32_compile --json "$out/i_mnist28_avx2.json" > "$out/i_mnist28_avx2.log" 2>&1
"${avx2[@]}" python main.py "${common[@]}" --dataset mnist_5k --img_size 8 --channels 4 --train_steps 10 \
  --rows default,fp32_nhwc,diffusers,fp32_compile --json "$out/i_latent8_avx2.json" > "$out/i_latent8_avx2.log" 2>&1
# bf16 torch.compile, the one peer row not above, at 28x28 with AVX2 kernels (bf16 emulated there).
"${avx2[@]}" python main.py "${common[@]}" --dataset mnist_5k --train_steps 3 \
  --rows default,amp_compile --json "$out/i_mnist28_avx2_amp_compile.json" > "$out/i_mnist28_avx2_amp_compile.log" 2>&1
