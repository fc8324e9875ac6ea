#!/bin/sh
# The training rows of BENCHMARKS' peers table after this folder's changes, one command at a time, nothing else
# running: the latent step and the 28x28 pixel step with AVX2 kernels, then the latent step with this CPU's own.
#   sh results/cpu-2026-11-30-training-28/run_rows.sh
set -e
OUT=results/cpu-2026-11-30-training-28
COMMON="--mode benchmark --bench training --model_channels 32 --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --interleave"
AVX2="env DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 DDPM_KERNELS_ISA=avx2 DDPM_NATIVE_BF16=0"
rm -rf /tmp/torchinductor_root
$AVX2 python main.py $COMMON --img_size 8 --channels 4 --train_steps 10 --rows fp32,default,diffusers,fp32_compile --json $OUT/latent8_avx2.json > $OUT/latent8_avx2.log 2>&1
rm -rf /tmp/torchinductor_root
$AVX2 python main.py $COMMON --train_steps 3 --rows fp32,default,diffusers,fp32_compile --json $OUT/mnist28_avx2.json > $OUT/mnist28_avx2.log 2>&1
rm -rf /tmp/torchinductor_root
python main.py $COMMON --img_size 8 --channels 4 --train_steps 10 --rows fp32,default,diffusers,fp32_compile,amp_compile,amp --json $OUT/latent8_avx512.json > $OUT/latent8_avx512.log 2>&1
