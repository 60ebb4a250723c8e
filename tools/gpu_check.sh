#!/usr/bin/env bash
# GPU check, to run on a machine with an NVIDIA GPU from the repository root:
#   builds the package for sm_90a against the installed jax, runs the whole test suite
#   with the GPU required, and runs the main job and the tensor-parallel example.
#   Logs go to $OUT (default ./gpu_check_logs).
# Usage: OUT=/some/dir bash tools/gpu_check.sh [CUDA architectures, default 90a-real]
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

echo "== tests (GPU required)"
# From tests/: python3 -m pytest puts the working directory first on sys.path, and the
# source tree has no compiled modules.
(cd tests && FP8NORM_REQUIRE_GPU=1 python3 -m pytest -q -rfE -p no:cacheprovider) \
  > "$OUT/pytest.log" 2>&1 || status=1
tail -5 "$OUT/pytest.log"

echo "== main job"
python3 -m jax_fp8norm > "$OUT/main_job.log" 2>&1 || status=1
cat "$OUT/main_job.log"

echo "== tensor-parallel example on the GPU (tp=1)"
python3 -m jax_fp8norm --tp 1 > "$OUT/example_tp1.log" 2>&1 || status=1
cat "$OUT/example_tp1.log"

exit $status
