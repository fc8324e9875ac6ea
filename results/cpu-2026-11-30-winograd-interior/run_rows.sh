#!/bin/sh
# The training rows (28x28 pixels and 4x8x8 latents) and the sampling rows after the interior-tile change, on the
# AVX2-only AMD EPYC, one command at a time with nothing else running.
#   sh results/cpu-2026-11-30-winograd-interior/run_rows.sh
set -e
OUT=results/cpu-2026-11-30-winograd-interior
COMMON="--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --interleave"
ROWS=fp32,default,diffusers,fp32_compile
rm -rf /tmp/torchinductor_root
python main.py $COMMON --train_steps 3 --rows $ROWS --json $OUT/mnist28.json > $OUT/mnist28.log 2>&1
rm -rf /tmp/torchinductor_root
python main.py $COMMON --img_size 8 --channels 4 --train_steps 10 --rows $ROWS --json $OUT/latent8.json > $OUT/latent8.log 2>&1
rm -rf /tmp/torchinductor_root
TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)" python main.py --mode benchmark --device cpu --img_size 16 --channels 1 \
  --n_samples 64 --sampler ddim --sampling_steps 50 --warmup 1 --repeats 3 --interleave --precision fp32 \
  --rows original,cuda,compile,onnxruntime,openvino --json $OUT/sampling.json > $OUT/sampling.log 2>&1
