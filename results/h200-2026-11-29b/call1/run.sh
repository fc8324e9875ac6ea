#!/usr/bin/env bash
# This session's device call: the runner's tests after the CPU twin's change, the GPU's MNIST recipe, the 28x28
# training rows interleaved, the b8 and CIFAR sampling rows, students.
set -u
START=$(date +%s)
BUDGET=${BUDGET:-540}
G=/tmp/gc
mkdir -p $G
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
pack() { tar -czf "$OUT/gc.tar.gz" --exclude='*.pt' -C /tmp gc; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt 25 ] && { echo "== $name: skipped ($l s left)" | tee -a $G/summary.txt; return; }
  [ "$limit" -gt $((l - 15)) ] && limit=$((l - 15))
  local t0; t0=$(date +%s%N)
  echo "== $name: $*" | tee -a $G/summary.txt
  timeout "$limit" "$@" > "$G/$name.log" 2>&1
  local code=$?
  echo "== $name: exit $code after $((($(date +%s%N) - t0) / 1000000)) ms" | tee -a $G/summary.txt
  tail -n 3 "$G/$name.log"
  pack
}
STAGE_TIMEOUT=120 scripts/gpu_check.sh $G environment build gpu_tests_runner
pack
step mnist_recipes 260 scripts/gpu_check.sh $G/recipes mnist_recipes
step training_rows_28 100 python3 main.py --mode benchmark --bench training --device cuda --model_channels 32 \
  --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --train_steps 40 --interleave \
  --rows fp32,default,amp --json $G/training_rows_28.json
for spec in "mnist_b8:--img_size 28 --channels 1 --n_samples 8" "cifar_b64:--img_size 32 --channels 3 --n_samples 64"; do
  step "rows_${spec%%:*}" 90 python3 main.py --mode benchmark --device cuda ${spec#*:} --precision bf16 --timesteps 1000 \
    --sampler ddpm --sampling_steps 200 --repeats 3 --rows original,cuda_steps,cuda_compile,cuda \
    --json "$G/rows_${spec%%:*}.json"
done
step students 120 python3 scripts/gpu_students.py --out $G --batches 8,64
cat $G/summary.txt
pack
