#!/usr/bin/env bash
# make demo's model trained three times (training seeds 0, 1, 2) with AVX2 kernels, its convolutions in Winograd's
# domain (the default there) and on oneDNN's (winograd._MIN_SIDE emptied), each judged by evaluate (512 samples,
# judge seed 1). Quality only: run beside nothing that is timed.
#   bash results/cpu-2026-11-29-winograd-training/quality.sh DIR   (DIR: where the checkpoints go)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/cpu-2026-11-29-winograd-training
dir=$1
export DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DDPM_KERNELS_ISA=avx2 DDPM_NATIVE_BF16=0
for convs in winograd onednn; do
  for seed in 0 1 2; do
    model=$dir/$convs-$seed/mnist_5k.pt
    mkdir -p "$(dirname "$model")"
    python - "$convs" main.py --mode train --dataset mnist_5k --max_steps 1000 --sample_every 0 --seed "$seed" \
      --model_path "$model" --overwrite > "$dir/$convs-$seed.train.log" 2>&1 <<'PY'
import runpy, sys
from ddpm.training import winograd
if sys.argv[1] == "onednn":
    winograd._MIN_SIDE.clear()
sys.argv = sys.argv[2:]
runpy.run_path("main.py", run_name="__main__")
PY
    grep -h "^training .*U-Net" "$dir/$convs-$seed.train.log" | tail -1
    python main.py --mode evaluate --model_path "$model" --n_samples 512 --seed 1 2>&1 | tr '\r' '\n' \
      | grep -A3 "^sampler" | sed "s/^/$convs seed $seed: /"
  done
done > "$out/quality.txt"
