#!/bin/sh
# The training rows with their peers on the Zen 5 EPYC (AVX-512, avx512_bf16), the 28x28 step then the latent 8x8
# one, one command at a time, nothing else running (Inductor's cache emptied first, so the compile rows compile).
#   sh results/cpu-2026-12-01-zen5/run_peers.sh
OUT=results/cpu-2026-12-01-zen5
COMMON="--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --interleave"
rm -rf /tmp/torchinductor_root
python main.py $COMMON --train_steps 5 --rows fp32,default,fp32_compile,amp_compile,diffusers --json $OUT/mnist28_peers.json > $OUT/mnist28_peers.log 2>&1
rm -rf /tmp/torchinductor_root
python main.py $COMMON --img_size 8 --channels 4 --train_steps 30 --rows fp32,default,fp32_compile,amp_compile,diffusers --json $OUT/latent8_peers.json > $OUT/latent8_peers.log 2>&1
