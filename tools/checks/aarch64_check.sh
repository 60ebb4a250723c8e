#!/usr/bin/env bash
# The CPU kernel built for aarch64 (GH200/GB200 hosts, which have only the baseline
# variant) against the x86-64 build's baseline variant: the timing driver
# benchmarks/cpu_kernel.cc is cross-built static with aarch64-linux-gnu-g++, run under
# qemu-aarch64 on shapes with partial blocks, groups, residuals and FP4, and its output
# hashes must equal those of the native build run with FP8NORM_CPU_ISA=baseline (about
# 5 s on 2 cores once the packages are there; installing them took 10 s more).
# Run by .ci/run; needs an x86-64 host with g++, and installs g++-aarch64-linux-gnu and
# qemu-user with apt-get when they are missing (as root or through sudo); says so and
# passes on another host. AARCH64_CXXFLAGS adds flags to the aarch64 build only.
# BUILD sets the build directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${BUILD:-build/aarch64-check}"
case "$(uname -m)" in
  x86_64 | amd64) ;;
  *)
    echo "== aarch64: not an x86-64 host ($(uname -m)); nothing to check"
    exit 0
    ;;
esac

qemu() { command -v qemu-aarch64 || command -v qemu-aarch64-static; }
missing=()
command -v aarch64-linux-gnu-g++ > /dev/null || missing+=(g++-aarch64-linux-gnu)
qemu > /dev/null || missing+=(qemu-user)
if ((${#missing[@]})); then
  if [[ "$(id -u)" == 0 ]]; then
    as_root=()
  elif command -v sudo > /dev/null && sudo -n true 2> /dev/null; then
    as_root=(sudo -n)
  else
    echo "== aarch64: FAIL: ${missing[*]} missing, and neither root nor password-less sudo" \
      "to install them (apt-get install ${missing[*]})" >&2
    exit 1
  fi
  if ! command -v apt-get > /dev/null; then
    echo "== aarch64: FAIL: ${missing[*]} missing and no apt-get to install them" >&2
    exit 1
  fi
  echo "== aarch64: installing ${missing[*]}"
  start=${SECONDS}
  mkdir -p "$build"
  {
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update &&
      "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${missing[@]}"
  } > "$build/install.log" 2>&1 || {
    tail -40 "$build/install.log"
    echo "== aarch64: FAIL: could not install ${missing[*]}" >&2
    exit 1
  }
  echo "== aarch64: installed in $((SECONDS - start)) s"
fi
qemu_aarch64="$(qemu)"

# The flags of tests/test_cpu_variants.py's build of the driver.
flags=(-std=c++17 -O2 -fno-math-errno -fno-trapping-math -ffp-contract=off -Isrc/common)
sources=(benchmarks/cpu_kernel.cc src/cpu/cpu_kernels.cc)
mkdir -p "$build"
echo "== aarch64: building the timing driver for x86-64 and for aarch64"
g++ "${flags[@]}" "${sources[@]}" -o "$build/cpu_kernel-x86_64" -lpthread
# shellcheck disable=SC2086  # AARCH64_CXXFLAGS is a list of flags
aarch64-linux-gnu-g++ "${flags[@]}" ${AARCH64_CXXFLAGS:-} "${sources[@]}" -static \
  -o "$build/cpu_kernel-aarch64" -lpthread

echo "== aarch64: output hashes under $(basename "$qemu_aarch64") against the x86-64 baseline"
# rows hidden dtype threads add group repeats [format]
cases=(
  "33 4096 bf16 2 1 16 1 nvfp4"
  "33 2880 f16 2 0 32 1 mxfp4"
  "100 4099 bf16 2 1 0 1"
  "37 384 f16 2 0 128 1"
  "70 4096 f32 2 1 32 1"
)
failed=0
for case in "${cases[@]}"; do
  # shellcheck disable=SC2086  # a case is a list of arguments
  x86=$(FP8NORM_CPU_ISA=baseline "$build/cpu_kernel-x86_64" $case) || {
    echo "== aarch64: FAIL: the x86-64 driver failed on $case" >&2
    exit 1
  }
  # shellcheck disable=SC2086
  arm=$("$qemu_aarch64" "$build/cpu_kernel-aarch64" $case) || {
    echo "== aarch64: FAIL: the aarch64 driver failed under qemu on $case" >&2
    exit 1
  }
  # "<variant> <shape...>: best <ms> ms of <repeats>, outputs <hash>": the variant and
  # the hash are compared, the time is not.
  read -r x86_variant _ <<< "$x86"
  read -r arm_variant _ <<< "$arm"
  x86_hash=${x86##* }
  arm_hash=${arm##* }
  verdict=same
  if [[ "$x86_variant" != baseline || "$arm_variant" != baseline ]]; then
    verdict="FAIL: variants $x86_variant (x86-64) and $arm_variant (aarch64), not baseline"
    failed=1
  elif [[ "$x86_hash" != "$arm_hash" ]]; then
    verdict="FAIL: the outputs differ"
    failed=1
  fi
  shape=${x86#* }
  printf '%-42s x86-64 baseline %s, aarch64 %s %s: %s\n' "${shape%%: best*}" \
    "$x86_hash" "$arm_variant" "$arm_hash" "$verdict"
done
if ((failed)); then
  echo "== aarch64: FAIL: the aarch64 build does not give the x86-64 baseline's outputs" >&2
  exit 1
fi
echo "== aarch64: done in ${SECONDS} s"
