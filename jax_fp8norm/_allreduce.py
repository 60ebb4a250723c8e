"""How ``allreduce_residual_rms_norm_fp8`` sums its partials: the ``method=`` keyword
(docs/spec.md, "One-kernel all-reduce"), where each method can run, ``auto``'s table, and
XLA's all-reduce (the ``"xla"`` method's sum, which the reference twin states too). The
method is decided here, once, when the call is lowered (``select``); every refusal's
wording is here.

``"xla"`` is XLA's all-reduce followed by the fused add + norm kernel. ``"one_shot"`` and
``"two_shot"`` are one kernel per device that reads its peers' memory and meets them
through flags in device memory (src/cuda/allreduce.cu). They need every device of the
axis in this process, with peer access: the CUDA backend, or the SIMT emulation on the
CPU backend, where each virtual CPU device stands for one GPU.
"""

from __future__ import annotations

import jax

from jax_fp8norm import _ffi

METHODS = ("auto", "xla", "one_shot", "two_shot")
ONE_KERNEL_METHODS = ("one_shot", "two_shot")
# The kernel's own names for its methods (src/cuda/peer_allreduce.h, AllReduceMethod), as
# the loaded CUDA modules export them with their codes: the keyword's names.
if _ffi.ALLREDUCE_METHOD_CODES and set(_ffi.ALLREDUCE_METHOD_CODES) != set(ONE_KERNEL_METHODS):
    raise ImportError(
        f"the compiled all-reduce kernel's methods {sorted(_ffi.ALLREDUCE_METHOD_CODES)} are "
        f"not the method= keyword's {list(ONE_KERNEL_METHODS)}: reinstall with "
        "`python -m pip install .`"
    )

# auto's table (docs/performance.md, "The one-kernel all-reduce"): for each group size, the
# largest payload (bytes of one device's partial x) for which one_shot is picked; beyond
# it, two_shot, at every size. auto never turns to XLA's all-reduce by size: the two
# one-kernel methods give the same bits, XLA's all-reduce others (docs/spec.md,
# "Invariance"), so a row's bits would depend on the rows around it. Provisional:
# computed from the bytes each method moves and the peers' published crossovers, not
# measured on a machine with several GPUs. On two devices two-shot moves more bytes than
# one-shot with twice the meetings, so one_shot is picked at every size there.
KIB = 1024
AUTO_ONE_SHOT_MAX = {
    2: None,  # every size
    4: 768 * KIB,
    8: 192 * KIB,
}

# The one switch that lets auto pick a one-kernel method on real GPUs, once AUTO_ONE_SHOT_MAX has
# been measured on such a machine. Until then auto runs "xla" on GPUs: a kernel no GPU has
# run is opt-in, never a default. The emulated devices follow the table, so that the
# selection itself is tested.
AUTO_ON_GPUS = False


def method_code(method: str) -> int:
    """The kernel's code for the one-kernel method ``method`` (the call's ``method``
    attribute), from the loaded CUDA modules."""
    if not _ffi.ALLREDUCE_METHOD_CODES:
        raise RuntimeError(
            "this build of jax_fp8norm has neither the CUDA kernels nor the SIMT emulation, "
            "so it has no one-kernel all-reduce"
        )
    return _ffi.ALLREDUCE_METHOD_CODES[method]


def check_method(method) -> str:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    return method


def unavailable_reason(
    *,
    platform: str,
    emulating: bool,
    cuda_built: bool,
    processes: int,
    num_devices: int | None,
    axes: tuple = ("axis",),
) -> str:
    """Why a one-kernel method cannot run here; "" when it can. ``num_devices`` is None
    without a mesh of concrete devices (an abstract mesh, jax.export)."""
    if len(axes) != 1:
        return f"it reduces over one mesh axis, and axis_name is {axes!r}"
    if num_devices is None:
        return f"it needs jax.shard_map over a mesh of concrete devices with the axis {axes[0]!r}"
    if processes > 1:
        return (
            "the devices are driven by several processes, whose memory the kernel cannot "
            "reach (it needs every device of the axis in one process)"
        )
    # Without a CUDA module (no limit known) a check below says why the kernel cannot run.
    max_devices = _ffi.MAX_PEERS
    if max_devices is not None and num_devices > max_devices:
        return f"the axis has {num_devices} devices; the kernel takes at most {max_devices}"
    if platform == "cpu" and not emulating:
        return (
            "the CPU backend has no one-kernel all-reduce (its all-reduce is XLA's); the "
            "CUDA kernel runs there only under the SIMT emulation (jax_fp8norm.simt)"
        )
    if platform == "cuda" and not cuda_built:
        return "this build of jax_fp8norm has no CUDA kernels"
    if platform not in ("cpu", "cuda"):
        return f"the {platform!r} backend has no one-kernel all-reduce"
    return ""


def select(
    method: str,
    *,
    platform: str,
    emulating: bool,
    cuda_built: bool,
    processes: int,
    num_devices: int | None,
    payload_bytes: int,
    axes: tuple = ("axis",),
) -> str:
    """The method a call runs: ``method`` itself when it is explicit (a ValueError that
    says why when a one-kernel method cannot run here), or auto's choice: ``"xla"`` at
    every size where a one-kernel method cannot run (and for one device), else one_shot or
    two_shot by size, which give the same bits."""
    method = check_method(method)
    if method == "xla":
        return method
    reason = unavailable_reason(
        platform=platform,
        emulating=emulating,
        cuda_built=cuda_built,
        processes=processes,
        num_devices=num_devices,
        axes=axes,
    )
    if method in ONE_KERNEL_METHODS:
        if reason:
            raise ValueError(f"method={method!r} cannot run here: {reason}")
        return method
    if reason or num_devices < 2 or (platform == "cuda" and not AUTO_ON_GPUS):
        return "xla"
    one_shot_max = AUTO_ONE_SHOT_MAX[min(t for t in AUTO_ONE_SHOT_MAX if t >= num_devices)]
    if one_shot_max is None or payload_bytes <= one_shot_max:
        return "one_shot"
    return "two_shot"


def xla_sum(x: jax.Array, axes: tuple, reduce_dtype=None) -> jax.Array:
    """The ``"xla"`` method's sum: XLA's all-reduce of ``x`` over the bound ``axes``, in
    ``x.dtype`` (``reduce_dtype`` None) or ``reduce_dtype`` (checked: float32)."""
    return jax.lax.psum(x.astype(reduce_dtype or x.dtype), axes)
