#!/bin/sh
# The 28x28 training rows after the fused norm-and-skip (and the latent 8x8 ones with "latent" as the argument), on
# the AVX2-only AMD EPYC, one command at a time with nothing else running.
#   PATH=.venv/bin:$PATH sh results/cpu-2026-11-30-norm-skip/run_rows.sh [latent] [suffix]
set -e
OUT=${OUT:-results/cpu-2026-11-30-norm-skip}  # a later folder may name itself
COMMON="--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --interleave"
rm -rf /tmp/torchinductor_root
if [ "$1" = latent ]; then
  python main.py $COMMON --img_size 8 --channels 4 --train_steps 10 --rows fp32,default,diffusers,fp32_compile --json $OUT/latent8$2.json > $OUT/latent8$2.log 2>&1
else
  python main.py $COMMON --train_steps 3 --rows fp32,default,diffusers,fp32_compile --json $OUT/mnist28$2.json > $OUT/mnist28$2.log 2>&1
fi
# The default against fp32 eager alone, more steps a round:
#   python main.py $COMMON --train_steps 8 --rows fp32,default --json $OUT/mnist28_long.json
