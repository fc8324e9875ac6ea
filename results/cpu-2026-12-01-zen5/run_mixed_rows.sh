#!/bin/sh
# The 28x28 rows after the mixed path, again: fp32 eager against the default twice, then with the bf16 compile peer,
# one command at a time, nothing else running.
#   sh results/cpu-2026-12-01-zen5/run_mixed_rows.sh
OUT=results/cpu-2026-12-01-zen5
COMMON="--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --interleave"
for run in 1 2; do
  python main.py $COMMON --train_steps 10 --rows fp32,default --json $OUT/mnist28_mixed_rows_$run.json > $OUT/mnist28_mixed_rows_$run.log 2>&1
done
rm -rf /tmp/torchinductor_root
python main.py $COMMON --train_steps 5 --rows fp32,default,amp_compile --json $OUT/mnist28_mixed_compile.json > $OUT/mnist28_mixed_compile.log 2>&1
