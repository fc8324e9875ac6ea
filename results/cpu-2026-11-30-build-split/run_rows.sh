#!/bin/sh
# The 28x28 training rows at the two-file build (the same kernels as the interior-tile folder's), on the AVX2-only
# AMD EPYC, one command at a time with nothing else running.
#   PATH=.venv/bin:$PATH sh results/cpu-2026-11-30-build-split/run_rows.sh
set -e
OUT=results/cpu-2026-11-30-build-split
COMMON="--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --interleave"
rm -rf /tmp/torchinductor_root
python main.py $COMMON --train_steps 3 --rows fp32,default,diffusers,fp32_compile --json $OUT/mnist28.json > $OUT/mnist28.log 2>&1
rm -rf /tmp/torchinductor_root
python main.py $COMMON --img_size 8 --channels 4 --train_steps 10 --rows fp32,default,diffusers,fp32_compile --json $OUT/latent8.json > $OUT/latent8.log 2>&1
