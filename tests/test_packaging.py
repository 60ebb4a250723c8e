"""The package as a user meets it: imported from a clone's root, where the source tree
comes first on sys.path, and the compiled modules' version check."""

from __future__ import annotations

import os
import subprocess
import sys

import jax_fp8norm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_from_the_source_tree_root():
    # `python -c` from the root puts the root first on sys.path, as `python -m` does: the
    # source package is the one imported, and it must find the installed compiled modules.
    script = (
        "import jax, jax.numpy as jnp, jax_fp8norm as f;"
        "print(f.__file__);"
        "x = jnp.arange(16, dtype=jnp.bfloat16).reshape(2, 8); g = jnp.ones((8,), jnp.bfloat16);"
        "got, want = f.rms_norm_fp8(x, g), f.reference.rms_norm_fp8(x, g);"
        "print(all(bool((a == b).all()) for a, b in zip(got, want)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    module_file, same = result.stdout.split()
    assert os.path.dirname(os.path.dirname(module_file)) == REPO_ROOT
    assert same == "True"


def test_compiled_modules_carry_the_package_version():
    from jax_fp8norm_kernels import _fp8norm_cpu

    assert _fp8norm_cpu.version == jax_fp8norm.__version__
    if jax_fp8norm.built_with_cuda():
        from jax_fp8norm_kernels import _fp8norm_cuda

        assert _fp8norm_cuda.version == jax_fp8norm.__version__
