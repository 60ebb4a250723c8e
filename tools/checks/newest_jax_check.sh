#!/usr/bin/env bash
# The default tier on the newest jax and Python. This machine's Python (3.11) stops at jax
# 0.10.2, so the run happens in a Debian trixie root (Python 3.13) made with debootstrap:
# a fresh venv there installs the newest jax (pinned below, the newest release tested),
# builds the package from this checkout (the CPU and emulated modules: no toolkit there)
# and runs `pytest` with every deprecation warning an error, in the tests and in the
# processes they start. Run by .ci/run as root; needs network for debootstrap and pip.
# ROOT sets the root's folder (kept between runs: made once).
set -euo pipefail
cd "$(dirname "$0")/../.."
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
unshare -m --propagation private bash -s "$root" "$src" "$jax_version" <<'OUTER'
set -euo pipefail
root=$1 src=$2 jax_version=$3
for dir in proc dev sys; do mount --bind "/$dir" "$root/$dir"; done
mkdir -p "$root/src"
mount --bind "$src" "$root/src"
chroot "$root" env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
  JAX_VERSION="$jax_version" bash -s <<'INNER'
set -euo pipefail
cd /src
git config --global --add safe.directory /src
start=$SECONDS
rm -rf /venv
python3 -m venv /venv
. /venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "jax==$JAX_VERSION" -r tests/requirements.txt
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
