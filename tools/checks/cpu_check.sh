#!/usr/bin/env bash
# The CPU kernel's AVX2 vector arithmetic (src/cpu/cpu_avx2.h) against the scalar
# definitions of src/common/fp8norm_math.h on every float32 input, with and without
# denormal flushing (tests/cpu/rounding_check.cc; about 45 s on 2 cores). Run by
# .ci/run; needs cmake and a C++ compiler, and says so and passes on a CPU without AVX2.
# BUILD sets the build directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${BUILD:-build/cpu-check}"
case "$(uname -m)" in
  x86_64 | amd64) ;;
  *)
    echo "== cpu: no AVX2 variant on $(uname -m); nothing to check"
    exit 0
    ;;
esac
echo "== cpu: AVX2 vector roundings against the scalar ones, every float32 input"
cmake -S tests/cpu -B "$build" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" > "$build.build.log" 2>&1 || {
  tail -40 "$build.build.log"
  exit 1
}
"$build/rounding_check"
