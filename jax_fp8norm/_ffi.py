"""Loads the compiled extension modules and registers their XLA FFI targets.

The modules live in a package of their own, ``jax_fp8norm_kernels``, installed beside
``jax_fp8norm`` (as jaxlib beside jax). A source tree that comes first on ``sys.path``, as
with ``python -m jax_fp8norm`` from a clone's root, then still finds the installed ones.
"""

from __future__ import annotations

import jax

from jax_fp8norm._version import __version__

try:
    from jax_fp8norm_kernels import _fp8norm_cpu
except ImportError as _error:
    raise ImportError(
        "jax_fp8norm's compiled modules (jax_fp8norm_kernels) are not installed: run "
        "`python -m pip install .` in the jax_fp8norm source tree"
    ) from _error

if _fp8norm_cpu.version != __version__:
    raise ImportError(
        f"jax_fp8norm {__version__} found compiled modules of version "
        f"{_fp8norm_cpu.version} ({_fp8norm_cpu.__file__}): reinstall with "
        "`python -m pip install .` from the source tree you import"
    )

for _name, _capsule in _fp8norm_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

try:
    from jax_fp8norm_kernels import _fp8norm_cuda
except ImportError as _error:
    _fp8norm_cuda = None
    CUDA_UNAVAILABLE_REASON = (
        "jax_fp8norm was built without CUDA support, so its ops cannot run on a GPU "
        f"({_error}). Rebuild on a machine with the CUDA toolkit (nvcc), e.g. "
        "`FP8NORM_CUDA=ON pip install --no-build-isolation .`, or run on the CPU backend."
    )
else:
    CUDA_UNAVAILABLE_REASON = ""
    for _name, _capsule in _fp8norm_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def cpu_kernel_variant() -> str:
    """The instruction-set variant of the CPU kernel on this machine: "avx2" (AVX2 + FMA +
    F16C, x86-64 built with GCC) or "baseline". ``FP8NORM_CPU_ISA=baseline`` in the
    environment before the first call forces the baseline; both give the same bits."""
    return _fp8norm_cpu.cpu_kernel_variant()


def built_with_cuda() -> bool:
    """Whether this build of jax_fp8norm carries the CUDA kernels."""
    return _fp8norm_cuda is not None
