#!/usr/bin/env bash
# What run_all.sh had left when it was stopped in the 28x28 bf16 rows with AVX2 kernels (bf16 emulated there: not a
# row a CPU without native bf16 would run, since auto picks fp32 on it): the fp32 rows, the parts, the layers.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/cpu-2026-11-29-training-step
# The first try segfaulted compiling (mnist28_avx2_segfault.log, Inductor's cache warm from the native rows): again
# with an empty cache.
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python main.py --mode benchmark --bench training --model_channels 32 \
  --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --train_steps 8 \
  --rows diffusers,fp32_compile,fp32_nhwc,fp32_winograd --json "$out/mnist28_avx2.json" > "$out/mnist28_avx2.log" 2>&1
for layout in nchw nhwc; do
  PYTHONPATH=. python "$out/step_parts.py" --layout "$layout" --steps 10 > "$out/parts_$layout.txt" 2>/dev/null
done
PYTHONPATH=. python "$out/conv_layers.py" --threads 2 > "$out/conv_layers_2t.txt"
