#!/usr/bin/env bash
# compute-sanitizer over the CUDA kernels: memcheck, racecheck, initcheck and synccheck,
# each on the odd shapes of tools/gpu/sanitize_cases.py. Only this project's kernels are
# instrumented (kns=fp8norm, the namespace in their mangled names), not XLA's own.
# Passes when every tool reports zero errors and every result matches the reference.
# Run from the repository root after installing the package.
# Usage: OUT=/some/dir bash tools/gpu/sanitize_gpu.sh [tool ...]   (default: all four)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-sanitize_logs}
mkdir -p "$OUT"
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck initcheck synccheck)

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -z "$sanitizer" ]; then
  echo "compute-sanitizer not found (it ships with the CUDA toolkit)"
  exit 2
fi

# Every buffer its own cudaMalloc, none preallocated: out-of-bounds accesses inside XLA's
# memory pool would otherwise land in memory memcheck considers valid.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_ALLOCATOR=platform

status=0
for tool in "${tools[@]}"; do
  echo "== $tool"
  "$sanitizer" --tool "$tool" --error-exitcode 86 --print-limit 20 \
    --kernel-name kns=fp8norm \
    python3 tools/gpu/sanitize_cases.py > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  tail -4 "$OUT/sanitize_$tool.log"
  if [ $rc -ne 0 ]; then
    echo "$tool: exit code $rc (86: the tool found errors)"
    status=1
  fi
done
exit $status
