#!/usr/bin/env bash
# The emulated CUDA kernels under the sanitizers, then the mutation check (docs/simt.md):
#   1. AddressSanitizer + UndefinedBehaviorSanitizer over every launch path
#      (tests/simt/kernel_check: exact-size buffers, so one element past the end is an error),
#      in one shard per core (a path or all-reduce property that no shard reached fails);
#   2. tools/mutants/simt_mutants.py --tsan: first the unmutated kernels, plain over every
#      launch path and under ThreadSanitizer over the block-level paths in one shard per
#      core (kernel_check --quick: every path at shorter rows; each emulated thread is a
#      TSan thread of its own), then planted bugs, each of which must be caught.
# Any report or surviving mutant fails the script. Run by .ci/run; needs cmake and a C++
# compiler with the sanitizers (GCC or Clang), no GPU. BUILD sets the build directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${BUILD:-build/simt-check}"
jobs="$(nproc 2>/dev/null || echo 2)"

configure_and_build() {  # <dir> <sanitizers>
  cmake -S tests/simt -B "$build/$1" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFP8NORM_SANITIZE="$2" > /dev/null
  cmake --build "$build/$1" -j "$jobs" > "$build/$1.build.log" 2>&1 || {
    tail -40 "$build/$1.build.log"
    return 1
  }
}

mkdir -p "$build"
echo "== simt: AddressSanitizer + UndefinedBehaviorSanitizer, every launch path"
configure_and_build asan "address,undefined"
# One shard of the checks per core: the emulation runs a launch on one core.
pids=()
for ((k = 0; k < jobs; k++)); do
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    "$build/asan/kernel_check" --shard "$k/$jobs" > "$build/asan.shard$k.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((k = 0; k < jobs; k++)); do
  wait "${pids[k]}" || failed=1
  cat "$build/asan.shard$k.log"
done
[[ $failed == 0 ]] || { echo "FAILED: a shard of the AddressSanitizer run"; exit 1; }
# A launch path or all-reduce property that every shard names as unseen was never checked.
unseen=$(for ((k = 0; k < jobs; k++)); do sed -n 's/^UNSEEN //p' "$build/asan.shard$k.log"; done |
  sort | uniq -c | awk -v n="$jobs" '$1 == n { sub(/^ *[0-9]+ /, ""); print }')
if [[ -n $unseen ]]; then
  printf 'FAILED: in no shard of the AddressSanitizer run:\n%s\n' "$unseen"
  exit 1
fi

echo "== simt: ThreadSanitizer over the block-level paths, then the mutation check"
python tools/mutants/simt_mutants.py --build "$build/mutants" --tsan
echo "== simt: done in ${SECONDS} s"
