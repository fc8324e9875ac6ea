#!/bin/sh
# The 28x28 pixel recipe (the earlier make demo-mnist: 1,800 steps of 128, bf16 by --precision auto on this CPU, so its
# 3x3 convolutions by the mixed path), then evaluate's judge at seeds 1 and 2, nothing else running.
#   sh results/cpu-2026-12-01-zen5/run_quality.sh   (the checkpoint goes to /tmp/q)
OUT=results/cpu-2026-12-01-zen5
/usr/bin/time -v python main.py --mode train --dataset mnist_5k --model_channels 32 --num_res_blocks 1 --batch_size 128 \
  --lr 1.5e-3 --max_steps 1800 --timestep_sampling importance --sample_every 0 --save_every 600 --overwrite \
  --model_path /tmp/q/mnist_pixel.pt > $OUT/quality_train.log 2>&1
for seed in 1 2; do
  python main.py --mode evaluate --model_path /tmp/q/mnist_pixel.pt --n_samples 512 --seed $seed \
    --json $OUT/quality_eval_seed$seed.json > $OUT/quality_eval_seed$seed.log 2>&1
done
