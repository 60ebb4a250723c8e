#!/usr/bin/env bash
# GPU check, to run on a machine with an NVIDIA GPU from the repository root:
#   builds the package for sm_90a against the installed jax, runs the whole test suite
#   with the GPU required, the main job and the tensor-parallel example, then the
#   benchmark (python -m jax_fp8norm.bench, GPU grid), the kernels' register / spill
#   report and SASS, and on request an Nsight Compute profile of the 4096 x 4096 calls.
#   The tests include the > 2^31-element case and a property-based budget of
#   FUZZ_EXAMPLES (default 300, as in CI) per platform; compute-sanitizer
#   (tools/sanitize_gpu.sh) follows them unless SANITIZE=0. The whole script has not been
#   timed on a GPU yet: where one command may run 10 minutes, split it, for example
#   BENCH_SECONDS=0 first, then SANITIZE=0 TESTS=0.
#   Logs go to $OUT (default ./gpu_check_logs).
# Usage: OUT=/some/dir bash tools/gpu_check.sh [CUDA architectures, default 90a-real]
#   BENCH_SECONDS (default 240) bounds the benchmark; what it measured so far is kept.
#   NCU=1 adds the Nsight Compute profile (about 4 minutes more).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_logs}
ARCHS=${1:-90a-real}
mkdir -p "$OUT"
status=0

{ nvidia-smi; python3 -c "import jax; print(jax.__version__, jax.devices())"; } \
  > "$OUT/machine.txt" 2>&1

echo "== build (CUDA architectures $ARCHS)"
if ! FP8NORM_CUDA=ON CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" \
    python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  exit 1
fi

if [ "${TESTS:-1}" = 1 ]; then
  echo "== tests (GPU required; the emulated simt runs are CI's, so skipped here)"
  FP8NORM_REQUIRE_GPU=1 FP8NORM_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-300} \
    python3 -m pytest -q -rfE -p no:cacheprovider -k "not simt" > "$OUT/pytest.log" 2>&1 \
    || status=1
  tail -5 "$OUT/pytest.log"
fi

if [ "${SANITIZE:-1}" = 1 ]; then
  echo "== compute-sanitizer"
  OUT="$OUT" bash tools/sanitize_gpu.sh || status=1
fi

echo "== main job"
python3 -m jax_fp8norm > "$OUT/main_job.log" 2>&1 || status=1
cat "$OUT/main_job.log"

echo "== tensor-parallel example on the GPU (tp=1)"
python3 -m jax_fp8norm --tp 1 > "$OUT/example_tp1.log" 2>&1 || status=1
cat "$OUT/example_tp1.log"

echo "== kernel resources and SASS"
so=$(python3 -c "import jax_fp8norm_kernels._fp8norm_cuda as m; print(m.__file__)")
cuobjdump --dump-resource-usage "$so" > "$OUT/resource_usage.txt" 2>&1 || true
cuobjdump --dump-sass "$so" > "$OUT/sass.txt" 2>&1 || true
grep -E "Function|REG|STACK|SHARED" "$OUT/resource_usage.txt" | head -40

if [ "${BENCH_SECONDS:-240}" != 0 ]; then
  echo "== benchmark (at most ${BENCH_SECONDS:-240} s)"
  timeout "${BENCH_SECONDS:-240}" python3 -m jax_fp8norm.bench \
    --json "$OUT/bench.json" --png "$OUT/bench.png" > "$OUT/bench.log" 2>&1 || status=1
  tail -60 "$OUT/bench.log"
fi

if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  echo "== Nsight Compute: both ops at 4096 x 4096 bf16"
  timeout 240 ncu --set full -k "regex:fp8norm|RmsNorm" -c 4 -o "$OUT/ncu" python3 -c "
import jax, jax.numpy as jnp, jax_fp8norm as f
x = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.bfloat16)
g = jnp.ones((4096,), jnp.bfloat16)
for _ in range(2):
    jax.block_until_ready(jax.jit(f.rms_norm_fp8)(x, g))
    jax.block_until_ready(jax.jit(f.add_rms_norm_fp8)(x, x, g))
" > "$OUT/ncu.log" 2>&1 || true
  tail -5 "$OUT/ncu.log"
fi

exit $status
