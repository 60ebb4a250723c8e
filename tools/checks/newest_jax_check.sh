#!/usr/bin/env bash
# The default tier on the newest jax and Python. This machine's Python (3.11) stops at jax
# 0.10.2, so the run happens in a Debian trixie root (Python 3.13) made with debootstrap:
# a fresh venv there installs the newest jax (pinned below, the newest release tested),
# builds the package from this checkout (the CPU and emulated modules: no toolkit there)
# and runs `pytest` with every deprecation warning an error, in the tests and in the
# processes they start. Run by .ci/run as root; needs network for debootstrap and pip.
# ROOT sets the root's folder (kept between runs: made once).
#
#   newest_jax_check.sh [--prepare]
#     --prepare: only the root and a venv there with jax and the test requirements (network
#     and unpacking, few cores: .ci/run makes them in the background while it builds); a
#     later run without it reuses that venv if it holds the same jax and requirements.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=run
[ "${1:-}" = "--prepare" ] && mode=prepare
src="$PWD"
root="$(realpath -m "${ROOT:-build/trixie}")"
jax_version="$(python - <<'EOF'
import tomllib
print(tomllib.load(open("pyproject.toml", "rb"))["tool"]["jax_fp8norm"]["tested_jax"]["newest"])
EOF
)"

# A root is made once and marked when whole; a partial one is made again.
if [ ! -e "$root/.made" ]; then
  start=$SECONDS
  rm -rf "$root"
  mkdir -p "$(dirname "$root")"
  if ! command -v debootstrap > /dev/null; then
    apt-get install -y -q debootstrap > /dev/null 2>&1 \
      || { apt-get update -q > /dev/null && apt-get install -y -q debootstrap > /dev/null; }
  fi
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,g++,cmake,git,make,ca-certificates \
    trixie "$root" > "$root.debootstrap.log" 2>&1 || { tail -20 "$root.debootstrap.log"; exit 1; }
  touch "$root/.made"
  echo "== newest jax: the trixie root made in $((SECONDS - start)) s"
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# pip there checks certificates against the root's own store; this machine's knows the
# network's chain.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"

# The mounts live in a private mount namespace: they end with it.
unshare -m --propagation private bash -s "$root" "$src" "$jax_version" "$mode" <<'OUTER'
set -euo pipefail
root=$1 src=$2 jax_version=$3 mode=$4
for dir in proc dev sys; do mount --bind "/$dir" "$root/$dir"; done
mkdir -p "$root/src"
mount --bind "$src" "$root/src"
chroot "$root" env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
  JAX_VERSION="$jax_version" MODE="$mode" bash -s <<'INNER'
set -euo pipefail
cd /src
git config --global --add safe.directory /src
start=$SECONDS
# The venv is made again unless it holds this jax and these requirements.
holds="jax $JAX_VERSION, requirements $(sha256sum tests/requirements.txt | cut -c1-16)"
if [ "$(cat /venv/.holds 2>/dev/null)" != "$holds" ]; then
  rm -rf /venv
  python3 -m venv /venv
  /venv/bin/python -m pip install -q --upgrade pip
  /venv/bin/python -m pip install -q "jax==$JAX_VERSION" -r tests/requirements.txt
  echo "$holds" > /venv/.holds
  echo "== newest jax: venv with $holds made in $((SECONDS - start)) s"
fi
[ "$MODE" = prepare ] && exit 0
. /venv/bin/activate
FP8NORM_CUDA=OFF python -m pip install -q .
echo "== newest jax: installed in $((SECONDS - start)) s"
python -c "import sys, jax, jax_fp8norm; print('Python', sys.version.split()[0], '- jax', jax.__version__, '- jax_fp8norm', jax_fp8norm.__version__)"
# Every deprecation an error: pytest's filters for the tests, PYTHONWARNINGS for the
# processes they start.
export PYTHONWARNINGS="error::DeprecationWarning,error::PendingDeprecationWarning,error::FutureWarning"
python -m pytest -W error::DeprecationWarning \
  -W error::PendingDeprecationWarning -W error::FutureWarning
# The README's tensor-parallel example, on jax's default (Explicit) mesh axes.
python -m jax_fp8norm --tp 8
INNER
OUTER
