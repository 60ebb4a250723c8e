#!/usr/bin/env bash
# The wheel a GPU user without a CUDA toolkit gets (README, "Build options"):
#   1. `FP8NORM_CUDA=ON python -m pip wheel .` with every nvcc of this machine hidden (a
#      private mount namespace puts an empty folder over the toolkit's install folder, and
#      PATH loses the folders that hold an nvcc), so the build backend must take nvcc from
#      PyPI (backend/fp8norm_build.py); CMake's message names the nvcc it used;
#   2. the wheel holds the CPU, emulated and CUDA modules, the CUDA one with code for every
#      architecture of the default list (cuobjdump, from PyPI too);
#   3. `auditwheel show` names the manylinux policy the wheel meets, and each of its modules
#      needs only glibc, libstdc++, libgcc_s and the driver's libcuda, with no RUNPATH but
#      $ORIGIN (tools/checks/wheel_libraries.py, on the unpacked wheel's ELF files);
#   4. it installs and imports in a fresh venv with the toolkit hidden as in 1 (its folder,
#      its nvcc, LD_LIBRARY_PATH) and the C and C++ compilers too, and its ops give the
#      reference's bits there.
# With --ptxas it also holds the ptxas table (registers, spills, shared memory per kernel,
# tools/reports/ptxas_report.py) of the PyPI nvcc to the system toolkit's. Run by .ci/run; needs
# unshare (root), network or a pip cache. OUT sets the output folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(realpath -m "${OUT:-build/wheel-check}")"
rm -rf "$out"
mkdir -p "$out/dist" "$out/empty"
ptxas=0
[ "${1:-}" = "--ptxas" ] && ptxas=1

# PATH without the folders that hold an nvcc; the toolkit's install folder, resolved.
hidden_path=""
IFS=: read -r -a path_dirs <<< "$PATH"
for dir in "${path_dirs[@]}"; do
  if [ -n "$dir" ] && [ ! -e "$dir/nvcc" ]; then hidden_path+="${hidden_path:+:}$dir"; fi
done
toolkit=$(realpath -m /usr/local/cuda)

without_toolkit() {  # <command...>: runs the command with no nvcc in sight
  unshare -m --propagation private bash -c '
    set -euo pipefail
    [ -d "$1" ] && mount --bind "$2" "$1"
    shift 2
    exec env -u CUDACXX -u CUDA_HOME -u CUDA_PATH PATH="$HIDDEN_PATH" "$@"
  ' bash "$toolkit" "$out/empty" "$@"
}
export HIDDEN_PATH="$hidden_path"

echo "== wheel: nvcc hidden: $(without_toolkit bash -c 'command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo none')"
start=$SECONDS
# A build folder of its own: the cached one of a local build would keep its compiler.
without_toolkit env FP8NORM_CUDA=ON python -m pip wheel . --no-deps -w "$out/dist" -v \
  --config-settings=build-dir="$out/build" > "$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
grep -o "jax_fp8norm: building CUDA kernels.*" "$out/build.log"
wheel=$(ls "$out"/dist/jax_fp8norm-*.whl)
echo "== wheel: built in $((SECONDS - start)) s: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB"

echo "== wheel: its modules and the CUDA module's architectures"
python -m pip install -q --target "$out/cuobjdump" "nvidia-cuda-cuobjdump==13.*"
PATH="$out/cuobjdump/nvidia/cu13/bin:$PATH" python - "$wheel" "$out/unpacked" <<'EOF'
import re, subprocess, sys, zipfile
from pathlib import Path

wheel, unpacked = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    z.extractall(unpacked)
modules = sorted(re.sub(r"\..*", "", Path(n).name) for n in names if n.endswith(".so"))
print("modules:", modules)
assert modules == ["_fp8norm_cpu", "_fp8norm_cuda", "_fp8norm_simt"], modules
(cuda,) = [unpacked / n for n in names if "_fp8norm_cuda" in n]
text = Path("CMakeLists.txt").read_text()
default = re.search(r'set\(CMAKE_CUDA_ARCHITECTURES "([^"]*)"\)', text).group(1).split(";")
want_sass = sorted("sm_" + a.split("-")[0] for a in default if a.endswith("-real"))
want_ptx = sorted("sm_" + a.split("-")[0] for a in default if a.endswith("-virtual"))
elf = subprocess.run(["cuobjdump", "--list-elf", str(cuda)], capture_output=True, text=True)
ptx = subprocess.run(["cuobjdump", "--list-ptx", str(cuda)], capture_output=True, text=True)
sass = sorted(set(re.findall(r"\.(sm_\w+)\.cubin", elf.stdout)))
ptxs = sorted(set(re.findall(r"\.(sm_\w+)\.ptx", ptx.stdout)))
print("SASS:", sass, " PTX:", ptxs)
assert sass == want_sass and ptxs == want_ptx, (sass, want_sass, ptxs, want_ptx)
EOF

echo "== wheel: auditwheel show, and the libraries its modules need"
python -m pip install -q auditwheel
python -m auditwheel show "$wheel" | tee "$out/auditwheel.txt"
python tools/checks/wheel_libraries.py "$out/unpacked"

echo "== wheel: a fresh venv with the toolkit and the compilers hidden"
python -m venv "$out/venv"
without_toolkit "$out/venv/bin/python" -m pip install -q "$wheel"
# The compilers as found inside without_toolkit (the toolkit's nvcc is gone there already).
compilers=$(without_toolkit bash -c \
  'for c in gcc g++ cc c++ clang clang++ nvcc; do command -v "$c" || true; done' | sort -u)
without_toolkit env -u LD_LIBRARY_PATH unshare -m --propagation private bash -c '
  set -euo pipefail
  venv=$1 toolkit=$2; shift 2
  for c in "$@"; do mount --bind /dev/null "$(realpath "$c")"; done
  for c in gcc g++ cc c++ nvcc; do
    if "$c" --version > /dev/null 2>&1; then echo "$c still runs" >&2; exit 1; fi
  done
  if [ -n "$(ls -A "$toolkit" 2>/dev/null)" ]; then echo "$toolkit is not hidden" >&2; exit 1; fi
  cd /
  "$venv/bin/python" - <<EOF
import jax, jax.numpy as jnp, numpy as np
import jax_fp8norm as fp8norm
assert fp8norm.built_with_cuda() and fp8norm.simt.available()
x = jax.random.normal(jax.random.key(0), (8, 512), jnp.bfloat16)
gamma = jnp.ones((512,), jnp.float32)
for recipe in ("fp8_row", "mxfp8", "mxfp4"):
    got = fp8norm.rms_norm_fp8(x, gamma, recipe=recipe)
    want = fp8norm.reference.rms_norm_fp8(x, gamma, recipe=recipe)
    fp8norm.testing.assert_same_bits(got, want)
print("imported from", fp8norm.__file__, "- CUDA kernels built:", fp8norm.built_with_cuda(),
      "- the CPU kernel gives the reference bits")
EOF
' bash "$out/venv" "$toolkit" $compilers

if [ "$ptxas" = 1 ]; then
  echo "== wheel: ptxas tables, PyPI nvcc against the system's"
  # The wheels the build backend asks for, as it spells them.
  read -r -a wheels <<< "$(python -c 'import sys; sys.path.insert(0, "backend")
import fp8norm_build; print(" ".join(fp8norm_build.PYPI_NVCC[13]))')"
  python -m pip install -q --target "$out/pypi-nvcc" "${wheels[@]}"
  # ptxas_report.py exits 1 where a kernel spills: the tables are compared, not judged.
  without_toolkit python tools/reports/ptxas_report.py \
    --nvcc "$out/pypi-nvcc/nvidia/cu13/bin/nvcc" > "$out/ptxas_pypi.txt" || true
  python tools/reports/ptxas_report.py --nvcc "$toolkit/bin/nvcc" > "$out/ptxas_system.txt" \
    || true
  "$out/pypi-nvcc/nvidia/cu13/bin/nvcc" --version | tail -2
  "$toolkit/bin/nvcc" --version | tail -2
  if diff "$out/ptxas_system.txt" "$out/ptxas_pypi.txt"; then
    echo "ptxas tables identical"
  else
    echo "ptxas tables differ (above)"
    exit 1
  fi
fi
echo "== wheel: done in ${SECONDS} s"
