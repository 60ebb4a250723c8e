"""The CUDA launch path's host logic on the emulated device (jax_fp8norm.simt): the real
static shared size, errors that must not outlive their call, the dynamic-size attribute
set once per device, the one-time work outside graph capture, and a sweep of hidden sizes
around every boundary the launch plan has, for every input dtype and kernel variant.

The emulated runtime refuses what a GPU refuses (static + dynamic + reserved shared memory
against the default and opt-in limits, the attribute as last set), fails named runtime
calls on request and behaves as in graph capture on request, so each of these tests
fails on the launch path as it was before its fix.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SIMT_VARIANTS, assert_same_bits, random_gamma, random_rows, reference_on_cpu

import jax_fp8norm as fp8norm
from jax_fp8norm import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason="built without the emulation")

H100_OPTIN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90
STATIC = 400  # block_shared's static shared memory as ptxas lays it out (396 declared)
DEFAULT = 48 * 1024

# The emulated runtime's error codes (src/simt/include/cuda_runtime.h).
INVALID_VALUE = 1
INVALID_DEVICE_FUNCTION = 98
CAPTURE_UNSUPPORTED = 900


@contextlib.contextmanager
def fresh_device(**limits):
    """An emulated device nobody has prepared yet (another device, as after a reset)."""
    with simt.device(**limits):
        yield
    simt.forget_device_setups()


def reference(op, *args):
    return reference_on_cpu(getattr(fp8norm.reference, op), *args)


def launches_of_the_op():
    return [launch for launch in simt.take_launches() if "x" in launch["buffers"]]


def norm_inputs(rows, hidden, dtype, seed=0):
    return random_rows(seed, (rows, hidden), dtype), random_gamma(seed + 1, hidden, jnp.float32)


# ---------------------------------------------------------------- 1. the real static size


@pytest.mark.parametrize(
    ("hidden", "cached"),
    [
        (58012, True),  # 232048 + 400 static: exactly the opt-in limit
        (58013, False),  # 4 bytes over it with the padding: re-read, not a failed launch
    ],
)
def test_rows_at_the_opt_in_limit_launch_with_the_real_static_size(hidden, cached):
    x, gamma = norm_inputs(2, hidden, jnp.float32)
    with fresh_device(), simt.kernels(), fp8norm.use_cuda_kernel("block_shared"):
        simt.take_launches()
        out = jax.block_until_ready(jax.jit(fp8norm.rms_norm_fp8)(x, gamma))
        (launch,) = launches_of_the_op()
    assert launch["error"] == ""
    assert launch["static_shared_bytes"] == STATIC
    assert launch["dynamic_shared_bytes"] == (hidden * 4 if cached else 0)
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


def test_a_refused_attribute_leaves_rows_past_the_default_re_read():
    # bf16 hidden 12189: 48756 cached bytes, which fit the 48 KiB default beside the 396
    # bytes of the scratch struct but not beside the 400 the kernel really has. With the
    # opt-in attribute refused the row is re-read instead of launching and failing.
    x, gamma = norm_inputs(3, 12189, jnp.bfloat16)
    with fresh_device(), simt.kernels(), fp8norm.use_cuda_kernel("block_shared"):
        with simt.injected_error("cudaFuncSetAttribute", INVALID_VALUE, count=100):
            simt.take_launches()
            out = jax.block_until_ready(jax.jit(fp8norm.rms_norm_fp8)(x, gamma))
            (launch,) = launches_of_the_op()
    assert launch["error"] == "" and launch["dynamic_shared_bytes"] == 0
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


def test_a_cached_launch_the_gpu_refuses_is_retried_re_reading_the_row():
    x, gamma = norm_inputs(3, 20000, jnp.float32)
    before = simt.stale_errors()
    with fresh_device(), simt.kernels(), fp8norm.use_cuda_kernel("block_shared"):
        fn = jax.jit(fp8norm.rms_norm_fp8)
        fn.lower(x, gamma).compile()
        with simt.injected_error("cudaLaunchKernelEx", INVALID_VALUE):
            simt.take_launches()
            out = jax.block_until_ready(fn(x, gamma))
            launches = launches_of_the_op()
    assert [launch["dynamic_shared_bytes"] for launch in launches] == [0]
    assert simt.stale_errors() == before
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


# ---------------------------------------------------------------- 2. no error outlives its call


@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
@pytest.mark.parametrize(
    "function", ["cudaDeviceGetAttribute", "cudaFuncGetAttributes", "cudaLaunchKernelEx"]
)
def test_a_failed_call_leaves_no_error_for_the_next(function):
    x, gamma = norm_inputs(2, 4096, jnp.bfloat16)
    before = simt.stale_errors()
    with fresh_device(), simt.kernels():
        fn = jax.jit(fp8norm.rms_norm_fp8)
        if function == "cudaLaunchKernelEx":
            fn.lower(x, gamma).compile()  # prepared: the launch itself fails
        else:
            simt.forget_device_setups()
        # Every call of `function` in the block fails: a program from jax's persistent
        # compilation cache (tests/conftest.py) is prepared as it is read, where jax turns
        # the failure into a warning and compiles it again, which must fail too.
        with simt.injected_error(function, INVALID_DEVICE_FUNCTION, count=1000):
            with pytest.raises(Exception, match="invalid device function"):
                jax.block_until_ready(fn(x, gamma))
        assert simt.stale_errors() == before  # the handler cleared it
        # The next call is not failed by the previous one's error.
        out = jax.block_until_ready(fn(x, gamma))
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


# ---------------------------------------------------------------- 3. the attribute, once


def test_the_attribute_is_set_once_per_device_to_the_most_any_call_uses():
    # After the device is prepared no call sets the attribute again: with every later
    # cudaFuncSetAttribute failing, calls of every size still launch, cached with opt-in
    # where they need it, so no call's launch depends on another call's attribute.
    with fresh_device(), simt.kernels(), fp8norm.use_cuda_kernel("block_shared"):
        x0, g0 = norm_inputs(1, 64, jnp.float32)
        jax.block_until_ready(jax.jit(fp8norm.rms_norm_fp8)(x0, g0))  # prepares the device
        with simt.injected_error("cudaFuncSetAttribute", INVALID_VALUE, count=1000):
            for hidden in (50000, 1000, 30000):
                x, gamma = norm_inputs(2, hidden, jnp.float32, seed=hidden)
                simt.take_launches()
                out = jax.block_until_ready(jax.jit(fp8norm.rms_norm_fp8)(x, gamma))
                (launch,) = launches_of_the_op()
                assert launch["error"] == "" and launch["dynamic_shared_bytes"] == hidden * 4
                assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


# ---------------------------------------------------------------- 4. outside graph capture


def test_the_one_time_work_runs_before_execution_not_in_capture():
    # Every execution runs "captured" (the attribute and module-load calls refused, as by
    # drivers before R545); the stage before execution prepares the device beforehand
    # (initialize on a GPU; XLA's CPU backend has only instantiate, which stands in).
    x, gamma = norm_inputs(2, 20000, jnp.float32)
    with fresh_device(), simt.kernels(), fp8norm.use_cuda_kernel("block_shared"):
        with simt.captured():
            simt.take_launches()
            out = jax.block_until_ready(jax.jit(fp8norm.rms_norm_fp8)(x, gamma))
            (launch,) = launches_of_the_op()
    assert launch["dynamic_shared_bytes"] == 20000 * 4  # opted in, before execution
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


def test_an_attribute_refused_in_capture_is_set_by_the_next_call():
    # The lazy preparation of a device first used inside capture: the attribute refused
    # there is not kept as "refused for good", so the next call opts in.
    x, gamma = norm_inputs(2, 20000, jnp.float32)
    with fresh_device(), simt.kernels(), fp8norm.use_cuda_kernel("block_shared"):
        fn = jax.jit(fp8norm.rms_norm_fp8)
        fn.lower(x, gamma).compile()
        simt.forget_device_setups()
        with simt.injected_error("cudaFuncSetAttribute", CAPTURE_UNSUPPORTED):
            with pytest.raises(Exception, match="capturing"):
                jax.block_until_ready(fn(x, gamma))
        simt.take_launches()
        out = jax.block_until_ready(fn(x, gamma))
        (launch,) = launches_of_the_op()
    assert launch["dynamic_shared_bytes"] == 20000 * 4
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


def test_an_unprepared_device_in_capture_fails_the_call_and_the_next_prepares_it():
    x, gamma = norm_inputs(2, 256, jnp.bfloat16)
    with fresh_device(), simt.kernels():
        fn = jax.jit(fp8norm.rms_norm_fp8)
        fn.lower(x, gamma).compile()
        simt.forget_device_setups()  # a device reset after compilation
        with simt.captured(), pytest.raises(Exception, match="capturing"):
            jax.block_until_ready(fn(x, gamma))
        out = jax.block_until_ready(fn(x, gamma))
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


# ---------------------------------------------------------------- 5. offsets


@pytest.mark.parametrize("offset", [1, 3])
def test_a_slice_at_an_element_offset_reaches_the_kernel_aligned(offset):
    # Why the GPU sanitizer's cases cover the scalar path by hidden sizes, not offsets:
    # XLA gives the custom call the slice as a buffer of its own, aligned, so the 16-byte
    # vector path runs.
    rows, hidden = 5, 512
    flat = np.linspace(-3, 3, rows * hidden + 16).astype(jnp.bfloat16)
    gamma = np.ones(hidden, np.float32)

    def sliced(flat, gamma):
        x = jax.lax.slice(flat, (offset,), (offset + rows * hidden,)).reshape(rows, hidden)
        return fp8norm.rms_norm_fp8(x, gamma)

    with simt.kernels(), fp8norm.use_cuda_kernel("block_shared"):
        simt.take_launches()
        out = jax.block_until_ready(jax.jit(sliced)(flat, gamma))
        (launch,) = launches_of_the_op()
    assert launch["buffers"]["x"]["widest_access"] == 16
    x = flat[offset : offset + rows * hidden].reshape(rows, hidden)
    assert_same_bits(out, reference("rms_norm_fp8", x, gamma))


# ---------------------------------------------------------------- the boundary sweep


def _boundaries() -> list[tuple[str, int]]:
    """(what, hidden) at and beside every boundary of the launch plan on an H100/H200."""
    cases = []
    for name, bytes_limit in (("48 KiB default", DEFAULT), ("opt-in limit", H100_OPTIN)):
        last = (bytes_limit - STATIC) // 4  # the longest row cached beside the static part
        cases += [(f"{name}, last cached", last), (f"{name}, first past", last + 1)]
        cases += [(f"{name}, vector multiple below", last // 8 * 8)]
        cases += [(f"{name}, vector multiple above", (last + 8) // 8 * 8)]
    cases += [("one element", 1), ("one vector less one", 7), ("one vector", 8)]
    cases += [("one vector more one", 9), ("a warp of vectors", 256), ("and one more", 264)]
    # warp_rows' and block_registers' register capacities (vectors of the 16-bit and the
    # float32 inputs), block_shared's one vector per thread.
    cases += [("warp_rows full", 8192), ("warp_rows full float32", 4096)]
    cases += [("warp_rows past", 8200), ("block_registers full", 16384)]
    cases += [("block_registers past", 16392), ("1024 threads of one vector", 8192 + 8)]
    return sorted(set(cases), key=lambda c: c[1])


BOUNDARIES = _boundaries()
# Vectors a register variant holds (src/cuda/cuda_launch_plan.h).
REGISTER_CAPACITY = {"warp_rows": 256 * 4, "block_registers": 512 * 4}


def expected_kernel(variant: str, hidden: int, dtype) -> str:
    """The kernel a variant runs for an aligned row: a register variant runs block_shared
    for rows it cannot hold (not a whole number of 16-byte vectors, or too many)."""
    if variant == "block_shared":
        return variant
    width = 16 // jnp.dtype(dtype).itemsize
    fits = hidden % width == 0 and hidden // width <= REGISTER_CAPACITY[variant]
    return variant if fits else "block_shared"


@pytest.mark.sampled(56)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=str)
@pytest.mark.parametrize(("what", "hidden"), BOUNDARIES, ids=[f"{h}" for _, h in BOUNDARIES])
def test_boundary_sweep_every_variant_launches_and_matches_the_reference(what, hidden, dtype):
    rows = 3  # an odd count: warp_rows has groups past the last row
    x = random_rows(hidden, (rows, hidden), dtype)
    residual = random_rows(hidden + 1, (rows, hidden), dtype)
    gamma = random_gamma(hidden + 2, hidden, dtype)
    want = reference("add_rms_norm_fp8", x, residual, gamma)
    with simt.kernels():
        fn = jax.jit(fp8norm.add_rms_norm_fp8)
        for variant in ("auto", *SIMT_VARIANTS):
            with fp8norm.use_cuda_kernel(variant):
                simt.take_launches()
                got = jax.block_until_ready(fn(x, residual, gamma))
                launches = launches_of_the_op()
            assert [launch["error"] for launch in launches] == [""], (what, variant)
            if variant != "auto":
                assert launches[0]["kernel"] == expected_kernel(variant, hidden, dtype), what
            assert_same_bits(got, want)
    assert np.isfinite(np.asarray(want[1])).all()
