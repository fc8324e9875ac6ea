#!/bin/sh
# The 28x28 recipe's training rows (fp32 eager against the default) twice more, then the thin convolutions alone,
# one command at a time, nothing else running.
#   sh results/cpu-2026-12-01-thin-convs/run_rows.sh
OUT=results/cpu-2026-12-01-thin-convs
COMMON="--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --interleave"
for run in 2 3; do
  python main.py $COMMON --train_steps 10 --rows fp32,default --json $OUT/mnist28_rows_$run.json > $OUT/mnist28_rows_$run.log 2>&1
done
PYTHONPATH=. python $OUT/thin_alone.py > $OUT/thin_alone.txt 2>&1
