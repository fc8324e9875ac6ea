#!/usr/bin/env bash
# This session's one device call: the GPU checks first, then the demo and the training rows on the GPU.
set -u
START=$(date +%s)
BUDGET=${BUDGET:-540}
G=/tmp/gc
mkdir -p $G
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
pack() { tar -czf "$OUT/gc.tar.gz" -C /tmp gc; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
# step NAME LIMIT COMMAND...: run with a time limit (never past the budget), log and time it.
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt 25 ] && { echo "== $name: skipped ($l s left)" | tee -a $G/summary.txt; return; }
  [ "$limit" -gt $((l - 20)) ] && limit=$((l - 20))
  local t0; t0=$(date +%s%N)
  echo "== $name: $*" | tee -a $G/summary.txt
  timeout "$limit" "$@" > "$G/$name.log" 2>&1
  local code=$?
  echo "== $name: exit $code after $((($(date +%s%N) - t0) / 1000000)) ms" | tee -a $G/summary.txt
  tail -n 4 "$G/$name.log"
  pack
}
STAGE_TIMEOUT=150 MEMCHECK_TIMEOUT=110 DEADLINE=200 scripts/gpu_check.sh $G environment build gpu_tests racecheck memcheck_runner
pack
mkdir -p $G/demo && cd $G/demo
REPO=$OLDPWD
step demo_train 160 python3 "$REPO/main.py" --mode train --dataset mnist_5k --max_steps 1000 --sample_every 0 --overwrite
step demo_sample 40 python3 "$REPO/main.py" --mode sample --model_path checkpoints/mnist_5k.pt --n_samples 64 --output mnist_samples.png
cp mnist_samples.png $OUT/ 2>/dev/null
step demo_evaluate 90 python3 "$REPO/main.py" --mode evaluate --model_path checkpoints/mnist_5k.pt --n_samples 512 --seed 1 --json $G/demo_evaluate.json
cd "$REPO"
step training_rows 170 python3 main.py --mode benchmark --bench training --device cuda --model_channels 32 --num_res_blocks 1 \
  --batch_size 128 --dropout 0 --dataset mnist_5k --train_steps 30 --rows fp32,default,diffusers,amp,fp32_compile,amp_compile \
  --json $G/training_rows.json
step seed_benchmark 60 python3 main.py --mode benchmark --n_samples 8 --img_size 32 --channels 3 --json $G/seed_benchmark.json
cat $G/summary.txt
pack
