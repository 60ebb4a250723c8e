#!/usr/bin/env bash
# The GPU check, from the repository root of a machine with an NVIDIA GPU, in two commands
# that each fit 10 minutes on an H100/H200 (logs and JSON under $OUT, default
# ./gpu_check_logs):
#
#   bash tools/gpu_check.sh          # 1. build for sm_90a only; the test suite with the
#                                    #    GPU required; the main job; ptxas/cuobjdump
#                                    #    figures; the A/B benchmark of every CUDA kernel
#                                    #    variant beside XLA, torch.compile and the copy
#   bash tools/gpu_check.sh deep     # 2. (optional) compute-sanitizer's four tools over
#                                    #    every variant, and Nsight Compute per variant
#   bash tools/gpu_check.sh training # 3. (optional) the backward against XLA's autodiff
#                                    #    and each recipe's two layouts against its
#                                    #    rowwise op: as `auto` picks, then one launch
#                                    #    (warp_rows) against two kernels (block_shared);
#                                    #    FP4 training's kernels (the quantisers, per-row
#                                    #    global scales, the columnwise transform, the
#                                    #    layer with every part) against their twins on the
#                                    #    GPU; one layer's training step (bench.layer)
#
# Budgets (seconds, each a hard `timeout`; what ran before a timeout is kept): build
# BUILD_SECONDS=120 (+30 to import it), tests TEST_SECONDS=180 (FUZZ_EXAMPLES=100 per
# platform), main job 60, all-reduce methods 30, resource usage 30, benchmark
# BENCH_SECONDS=140: 590 in all;
# deep: SANITIZE_SECONDS=360, NCU_SECONDS=180; training: TRAINING_SECONDS=90 for each of
# its five runs. ARCHS overrides the CUDA architectures (default 90a-real). `deep` and
# `training` rebuild only when the package is not installed. Exits non-zero when any
# step failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-check}
OUT=${OUT:-gpu_check_logs}
ARCHS=${ARCHS:-90a-real}
mkdir -p "$OUT"
status=0
start=$SECONDS

step() {  # <name> <seconds> <log> <command...>: runs it under a timeout, tails the log
  local name=$1 seconds=$2 log=$3
  shift 3
  echo "== $name (at most $seconds s; $((SECONDS - start)) s so far)"
  timeout "$seconds" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  tail -n "${TAIL:-8}" "$OUT/$log"
  if [ $rc -ne 0 ]; then
    echo "!! $name: exit code $rc$([ $rc -eq 124 ] && echo ' (timed out)')"
    status=1
  fi
  return $rc
}

{ nvidia-smi; python3 -c "import jax; print(jax.__version__, jax.devices())"; } \
  > "$OUT/machine.txt" 2>&1

if [ "$MODE" = check ] || ! python3 -c "import jax_fp8norm_kernels._fp8norm_cuda" 2> /dev/null; then
  step "build (CUDA architectures $ARCHS)" "${BUILD_SECONDS:-120}" build.log \
    env FP8NORM_CUDA=ON CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" \
    python3 -m pip install --no-build-isolation --no-deps . || exit 1
  step "the CUDA module" 30 build_check.log python3 -c \
    "import jax_fp8norm as f; assert f.built_with_cuda(); print(f.cuda_kernel_variants())" \
    || exit 1
fi

if [ "$MODE" = check ]; then
  # The emulation's tests (the simt platforms, the emulated launch path and kernel
  # selection) are CI's; here the GPU runs are the point.
  # How the GPU's XLA holds FP4 buffers, first: the FP4 kernels write the layout
  # jax_fp8norm/_ffi.py's FP4_LAYOUTS says.
  TAIL=6 step "FP4 layout on the GPU" 60 fp4_layout.log \
    env FP8NORM_REQUIRE_GPU=1 python3 -m pytest -q -rfE -n 0 -p no:cacheprovider \
    tests/test_fp4.py -k "layout_of_the_gpu_backend"
  TAIL=6 step "tests, GPU required" "${TEST_SECONDS:-180}" pytest.log \
    env FP8NORM_REQUIRE_GPU=1 FP8NORM_FUZZ_EXAMPLES="${FUZZ_EXAMPLES:-100}" \
    python3 -m pytest -q -rfE -n 0 -p no:cacheprovider \
    -k "not simt and not test_cuda_device_setup and not test_environment_switches"
  step "main job" 60 main_job.log python3 -m jax_fp8norm
  # The one-kernel all-reduce's methods against XLA's on every GPU (one GPU: the n = 1
  # path and the set-up cost); its bits against the twin ran in the tests above.
  TAIL=20 step "all-reduce methods" 30 allreduce_bench.log \
    python3 -m jax_fp8norm.bench.allreduce --rows 1,8,32,128 --rounds 20
  step "kernel resources" 30 resource_usage.txt sh -c "cuobjdump --dump-resource-usage \
    \$(python3 -c 'import jax_fp8norm_kernels._fp8norm_cuda as m; print(m.__file__)')"
  TAIL=60 step "A/B benchmark: every variant" "${BENCH_SECONDS:-140}" bench.log \
    python3 -m jax_fp8norm.bench --variants all --dtypes bfloat16 \
    --ops rms_norm_fp8,add_rms_norm_fp8 \
    --rows 1,16,64,256,4096,16384 --hidden 2048,4096,8192,16384 --repeats 5 \
    --json "$OUT/bench.json" --png "$OUT/bench.png"
elif [ "$MODE" = deep ]; then
  step "compute-sanitizer, every variant" "${SANITIZE_SECONDS:-360}" sanitize.log \
    env OUT="$OUT" bash tools/gpu/sanitize_gpu.sh
  if command -v ncu > /dev/null; then
    step "Nsight Compute: each variant at 16 and 4096 rows x 4096 bf16" \
      "${NCU_SECONDS:-180}" ncu.log ncu --set full -k "regex:Kernel" -c 12 -o "$OUT/ncu" \
      python3 -c "
import jax, jax.numpy as jnp, jax_fp8norm as f
g = jnp.ones((4096,), jnp.bfloat16)
for rows in (16, 4096):
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, 4096), jnp.bfloat16)
    for v in f.cuda_kernel_variants()[1:]:
        with f.use_cuda_kernel(v):
            jax.block_until_ready(jax.jit(f.rms_norm_fp8)(x, g))
"
  else
    echo "ncu not found: no profile"
  fi
elif [ "$MODE" = training ]; then
  for kernel in auto warp_rows block_shared; do
    TAIL=30 step "backward and columnwise, FP8NORM_CUDA_KERNEL=$kernel" \
      "${TRAINING_SECONDS:-90}" "bench_training_$kernel.log" \
      env FP8NORM_CUDA_KERNEL=$kernel python3 -m jax_fp8norm.bench.backward --rounds 20
  done
  TAIL=20 step "FP4 training's kernels against their twins, GPU required" \
    "${TRAINING_SECONDS:-90}" fp4_training.log \
    env FP8NORM_REQUIRE_GPU=1 python3 -m pytest -q -rfE -n 0 -p no:cacheprovider \
    tests/test_quantize_gradient.py tests/test_quantize_weight.py \
    tests/test_per_row_global_scale.py tests/test_columnwise_hadamard.py \
    tests/test_layer_bits.py -k gpu
  TAIL=30 step "one layer's training step, fused against by hand" \
    "${TRAINING_SECONDS:-90}" "bench_layer.log" \
    python3 -m jax_fp8norm.bench.layer --rows 8192 --hidden 4096 --features 4096 --rounds 10 \
    --recipes fp8_row,fp8_group128,mxfp8,nvfp4,mxfp4
else
  echo "usage: bash tools/gpu_check.sh [check|deep|training]"
  exit 2
fi
echo "== done in $((SECONDS - start)) s, status $status"
exit $status
