#!/usr/bin/env bash
# Every measurement of this folder, one after another, nothing else running:
#   bash results/cpu-2026-11-29-training-step/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/cpu-2026-11-29-training-step
lscpu > "$out/lscpu.txt"
bash "$out/run_rows.sh" native
DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 bash "$out/run_rows.sh" avx2
for layout in nchw nhwc; do
  PYTHONPATH=. python "$out/step_parts.py" --layout "$layout" --steps 10 > "$out/parts_$layout.txt" 2>/dev/null
done
python "$out/conv_layers.py" --threads 2 > "$out/conv_layers_2t.txt"
