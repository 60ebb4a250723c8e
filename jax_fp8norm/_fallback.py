"""Where the ops have no kernel of ours: the platforms jax lowers to that this build has no
kernel for (TPU, ROCm, a GPU when the package was built without CUDA kernels). There each
op lowers to its reference twin (jax_fp8norm.reference: the spec's math in jnp, several
XLA fusions instead of one pass), with one warning per platform and process;
``FP8NORM_FALLBACK=error`` makes it an error instead."""

from __future__ import annotations

import os
import warnings

from jax_fp8norm import _ffi

FALLBACK_ENV = "FP8NORM_FALLBACK"
_POLICIES = ("twin", "error")


class KernelFallbackWarning(UserWarning):
    """An op of jax_fp8norm was lowered to its reference twin: no kernel of ours runs on
    that platform. Filter it with ``warnings.filterwarnings("ignore",
    category=jax_fp8norm.KernelFallbackWarning)``."""


def policy(environ=os.environ) -> str:
    """``FP8NORM_FALLBACK``: unset, "" or "twin" lowers to the twin; "error" refuses."""
    value = environ.get(FALLBACK_ENV, "").strip().lower() or "twin"
    if value not in _POLICIES:
        raise ValueError(
            f"{FALLBACK_ENV} must be one of {list(_POLICIES)} (or unset), got "
            f"{environ[FALLBACK_ENV]!r}"
        )
    return value


def reason(platform: str) -> str:
    """Why ``platform`` has no kernel of ours, and the way to one."""
    if platform == "cuda":
        return _ffi.CUDA_UNAVAILABLE_REASON
    return (
        f"jax_fp8norm has kernels for the CPU and for NVIDIA GPUs (CUDA), none for the "
        f"{platform!r} backend; run on one of those for the fused kernels"
    )


_warned: set[str] = set()


def lower_to_twin(op: str, platforms) -> None:
    """Called by a lowering rule about to lower ``op`` to its twin for ``platforms``: warns
    once per platform and process, or raises under ``FP8NORM_FALLBACK=error``."""
    for platform in platforms:
        if policy() == "error":
            raise RuntimeError(
                f"jax_fp8norm.{op} has no kernel for platform {platform!r}: {reason(platform)} "
                f"({FALLBACK_ENV}=error; unset it to run the op's exact jnp twin there)"
            )
        if platform in _warned:
            continue
        warnings.warn(
            f"jax_fp8norm's ops run as their jnp twins on platform {platform!r} (the spec's "
            f"math, not fused, slower): {reason(platform)}. Set "
            f"{FALLBACK_ENV}=error to make this an error.",
            KernelFallbackWarning,
            stacklevel=2,
        )
        _warned.add(platform)
