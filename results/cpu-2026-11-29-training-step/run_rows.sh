#!/usr/bin/env bash
# The training benchmark's rows at the three shapes the CPU recipes train, nothing else running.
#   bash results/cpu-2026-11-29-training-step/run_rows.sh [suffix] (suffix: a name for the run's files)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/cpu-2026-11-29-training-step
suffix=${1:-native}
rows=default,diffusers,fp32_compile,amp,amp_compile,fp32_nhwc,fp32_winograd
common=(--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0)
python main.py "${common[@]}" --dataset mnist_5k --img_size 8 --channels 4 --train_steps 30 --rows "$rows" \
  --json "$out/latent8_$suffix.json" > "$out/latent8_$suffix.log" 2>&1
python main.py "${common[@]}" --dataset digits --train_steps 30 --rows "$rows" \
  --json "$out/digits8_$suffix.json" > "$out/digits8_$suffix.log" 2>&1
python main.py "${common[@]}" --dataset mnist_5k --train_steps 8 --rows "$rows" \
  --json "$out/mnist28_$suffix.json" > "$out/mnist28_$suffix.log" 2>&1
