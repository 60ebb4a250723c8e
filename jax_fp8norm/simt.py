"""The CUDA kernels on the CPU: the SIMT emulation, for tests (docs/simt.md).

The build compiles the CUDA kernels (``src/cuda/*.cu``) and the CUDA FFI handlers a second
time, with the host compiler, against an emulated CUDA runtime whose threads are fibers. Inside
``kernels()`` the ops lower to those on the CPU backend instead of the CPU kernels, so the
CUDA code runs, bit for bit comparable with the reference, on a machine without a GPU::

    with jax_fp8norm.simt.kernels(), jax_fp8norm.simt.device(shared_per_block_optin=48 * 1024):
        y, scales = jax.jit(jax_fp8norm.rms_norm_fp8)(x, gamma)
    launch = jax_fp8norm.simt.take_launches()[-1]  # blocks, threads, bytes and sectors

It shows logic, races and memory-access patterns; not speed, occupancy, registers or the
GPU's memory model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax_fp8norm import _ffi


def available() -> bool:
    """Whether this build has the emulated kernels (every build from source does)."""
    return _ffi.simt_module is not None


def active() -> bool:
    """Whether the ops lower to the emulated CUDA kernels on the CPU backend now."""
    return _ffi.emulating()


def kernels() -> contextlib.AbstractContextManager[None]:
    """Within the block, the ops on the CPU backend run the CUDA kernels, emulated (the FFI
    layer's one switch, which FP8NORM_EMULATE_CUDA=1 turns on for a whole process)."""
    return _ffi.emulate_cuda()


@contextlib.contextmanager
def device(
    *,
    shared_per_block_optin: int | None = None,
    max_grid_x: int | None = None,
    max_threads_per_block: int | None = None,
    shared_per_block: int | None = None,
) -> Iterator[dict]:
    """Within the block, the emulated device has the given limits (the others as before;
    by default an H100/H200's: 1024 threads, 48 KiB of shared memory per block, 227 KiB
    with opt-in). The launch plan reads them as it reads a GPU's, so small limits reach
    every launch path at small sizes. Yields the limits in force."""
    module = _require()
    before = module.device_limits()
    limits = dict(before)
    for name, value in (
        ("shared_per_block_optin", shared_per_block_optin),
        ("max_grid_x", max_grid_x),
        ("max_threads_per_block", max_threads_per_block),
        ("shared_per_block", shared_per_block),
    ):
        if value is not None:
            limits[name] = int(value)
    module.set_device_limits(**limits)
    try:
        yield dict(limits)
    finally:
        module.set_device_limits(**before)


def take_launches() -> list[dict]:
    """Every emulated launch since the last call, oldest first: ``blocks``, ``threads``,
    ``dynamic_shared_bytes``, completed ``barriers`` and ``shuffles``, ``error`` (empty on
    success) and, per global buffer by argument name, ``bytes_read``, ``bytes_written``,
    ``requests`` (warp-wide accesses), the 32-byte ``sectors`` they touched,
    ``min_sectors`` (the fewest that could hold the bytes asked for) and
    ``widest_access`` (bytes of the widest single load or store)."""
    return _require().take_launches()


def set_schedule_seed(seed: int) -> int:
    """Seeds the order in which the emulation resumes each block's threads; returns the
    seed it replaces."""
    return _require().set_schedule_seed(int(seed))


def forget_device_setups() -> None:
    """Forgets every emulated device's one-time preparation, as a device reset would: the
    next call prepares the device again."""
    _require().forget_device_setups()


@contextlib.contextmanager
def injected_error(function: str, error: int, count: int = 1) -> Iterator[None]:
    """Within the block, the next ``count`` calls of the emulated runtime's ``function``
    (e.g. ``"cudaFuncSetAttribute"``) fail with the cudaError_t code ``error``."""
    module = _require()
    module.inject_error(function, int(error), int(count))
    try:
        yield
    finally:
        module.inject_error(function, int(error), 0)


@contextlib.contextmanager
def captured() -> Iterator[None]:
    """Within the block, the emulated handlers run every call as inside CUDA graph
    capture: the runtime refuses what a capture refuses (attribute setting, module
    loading)."""
    module = _require()
    module.set_capture(True)
    try:
        yield
    finally:
        module.set_capture(False)


def stale_errors() -> int:
    """How many emulated calls have left a runtime error set for a later call to find."""
    return _require().stale_errors()


def kernel_variant() -> str:
    """The CUDA kernel variant the emulated launches use now (``"auto"`` unless chosen)."""
    return _require().kernel_variant()


def _require():
    return _ffi._require_simt()
