#!/usr/bin/env bash
# All the GPU work in one call, for a machine with an NVIDIA GPU, nvcc and compute-sanitizer:
#
#   scripts/gpu_check.sh OUTDIR
#
# Stages (each logged to OUTDIR/<stage>.log; a failed stage does not stop the later ones):
#   environment  GPU, driver, torch and nvcc versions (OUTDIR/environment.txt); fails without a GPU
#   build        python setup.py build_ext --inplace (the CUDA extension for the local GPU)
#   gpu_tests    pytest -m gpu: CUDA kernels vs the reference, graph replay, cuda vs original
#   memcheck     compute-sanitizer --tool memcheck on the CUDA kernel tests (caching allocator
#                off, so an out-of-bounds access hits unallocated memory and is reported)
#   racecheck    compute-sanitizer --tool racecheck on group_norm_act (its shared-memory reduction)
#   benchmark    scripts/bench_sampling.py: original vs cuda sampling, fused op bandwidth
#                (OUTDIR/benchmark.json)
#   rows         benchmark mode, MNIST size, bf16, batch 64 and 8: original, cuda, cuda_fused_unet
#                (the fused U-Net runner), cuda_compile (OUTDIR/rows_b64.json, rows_b8.json)
# OUTDIR/summary.txt lists each stage's status and time. Exit status: 0 if every stage passed,
# 1 otherwise. Environment: PYTHON (default python3), MEMCHECK_TIMEOUT seconds (default 1200).
set -u

if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SUMMARY="$OUTDIR/summary.txt"
: >"$SUMMARY"
FAILED=()

# run_stage NAME COMMAND...: run COMMAND with its output in OUTDIR/NAME.log; record the outcome.
run_stage() {
  local name=$1
  shift
  local start status
  start=$(date +%s)
  echo "== $name: $*" | tee -a "$SUMMARY"
  if "$@" >"$OUTDIR/$name.log" 2>&1; then
    status="ok"
  else
    status="FAILED (exit $?)"
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

run_stage environment environment
cp "$OUTDIR/environment.log" "$OUTDIR/environment.txt"
run_stage build "$PYTHON" setup.py build_ext --inplace
run_stage gpu_tests "$PYTHON" -m pytest -m gpu -v -rs tests/
run_stage memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_TIMEOUT:-1200}" \
  compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
  "$PYTHON" -m pytest -m gpu -q -x tests/test_diffusion_kernels.py
run_stage racecheck timeout "${MEMCHECK_TIMEOUT:-1200}" \
  compute-sanitizer --tool racecheck --error-exitcode 1 \
  "$PYTHON" -m pytest -m gpu -q -x tests/test_diffusion_kernels.py -k group_norm_act
run_stage benchmark "$PYTHON" scripts/bench_sampling.py --out "$OUTDIR/benchmark.json"
for batch in 64 8; do
  run_stage "rows_b$batch" "$PYTHON" main.py --mode benchmark --device cuda --img_size 28 --channels 1 \
    --n_samples "$batch" --precision bf16 --timesteps 1000 --sampler ddpm --repeats 3 \
    --rows original,cuda,cuda_fused_unet,cuda_compile --json "$OUTDIR/rows_b$batch.json"
done

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED stages: ${FAILED[*]} (logs in $OUTDIR)" | tee -a "$SUMMARY"
  exit 1
fi
echo "all stages passed (logs in $OUTDIR)" | tee -a "$SUMMARY"
