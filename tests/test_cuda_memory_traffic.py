"""The CUDA kernels' launch paths and memory traffic, through the SIMT emulation
(jax_fp8norm.simt, docs/simt.md).

Each launch path is reached at a small size by giving the emulated device small limits, the
result is held to the reference bit for bit, and the emulator's memory accounting is held
to what each kernel variant's design promises: on block_shared's cached path and in the
register variants x and the residual are read once and gamma once per row, every output
is written once, and every warp-wide access touches the fewest 32-byte sectors that can
hold it. The block_shared tests ask for that variant; auto would pick another for most.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_against_reference, random_gamma, random_rows

import jax_fp8norm as fp8norm
from jax_fp8norm import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason="built without the emulation")

F32_STATIC_SHARED = 300  # more than the kernel's own __shared__ scratch


def run(op: str, *args, variant: str = "block_shared"):
    """Runs `op` on the emulated kernels of `variant`, checks it against the reference and
    returns the outputs and the op's launch."""
    with simt.kernels(), fp8norm.use_cuda_kernel(variant):
        simt.take_launches()
        out, _ = check_against_reference("simt", op, *args)
        launches = [launch for launch in simt.take_launches() if "x" in launch["buffers"]]
    assert launches, "no emulated launch of the kernel was recorded"
    assert launches[-1]["error"] == ""
    return out, launches[-1]


def inputs(rows, hidden, dtype, *, residual=False, gamma_dtype=jnp.float32, seed=0):
    x = random_rows(seed, (rows, hidden), dtype)
    gamma = random_gamma(seed + 1, hidden, gamma_dtype)
    if residual:
        return "add_rms_norm_fp8", (x, random_rows(seed + 2, (rows, hidden), dtype), gamma)
    return "rms_norm_fp8", (x, gamma)


def nbytes(a) -> int:
    return np.asarray(a).nbytes


def assert_every_byte_moved_once(buffers, args, out, rows, residual):
    """x and the residual read once, gamma once per row, every output written once; inputs
    never written and outputs never read."""
    assert buffers["x"]["bytes_read"] == nbytes(args[0])
    assert buffers["gamma"]["bytes_read"] == rows * nbytes(args[-1])
    assert buffers["y"]["bytes_written"] == nbytes(out[0])
    assert buffers["scales"]["bytes_written"] == nbytes(out[1])
    if residual:
        assert buffers["residual"]["bytes_read"] == nbytes(args[1])
        assert buffers["residual_out"]["bytes_written"] == nbytes(out[2])
    for name, stats in buffers.items():
        other = "bytes_written" if name in ("x", "residual", "gamma") else "bytes_read"
        assert stats[other] == 0, name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_cached_path_reads_inputs_once_and_writes_outputs_once(dtype, residual):
    rows, hidden = 6, 4096
    op, args = inputs(rows, hidden, dtype, residual=residual)
    out, launch = run(op, *args)
    buffers = launch["buffers"]
    assert launch["kernel"] == "block_shared"
    assert launch["dynamic_shared_bytes"] == hidden * 4  # the row cached as float32
    assert_every_byte_moved_once(buffers, args, out, rows, residual)


def test_rows_too_long_for_shared_memory_are_read_three_times():
    rows, hidden = 4, 2048  # 8 KiB of float32 per row; the device opts in to 4 KiB
    op, args = inputs(rows, hidden, jnp.float32, residual=True)
    with simt.device(shared_per_block=4096, shared_per_block_optin=4096):
        out, launch = run(op, *args)
    buffers = launch["buffers"]
    assert launch["dynamic_shared_bytes"] == 0
    assert buffers["x"]["bytes_read"] == 3 * nbytes(args[0])  # one per sweep
    assert buffers["residual"]["bytes_read"] == 3 * nbytes(args[1])
    assert buffers["gamma"]["bytes_read"] == 2 * rows * nbytes(args[2])  # sweeps 2 and 3
    assert buffers["residual_out"]["bytes_written"] == nbytes(out[2])


@pytest.mark.parametrize(
    "hidden,dtype,width",
    [(4096, jnp.bfloat16, 16), (2048, jnp.float32, 16), (1000, jnp.float16, 16)],
)
def test_vectorised_accesses_are_fully_coalesced(hidden, dtype, width):
    op, args = inputs(5, hidden, dtype, residual=True, gamma_dtype=dtype)
    _, launch = run(op, *args)
    for name, stats in launch["buffers"].items():
        assert stats["requests"] > 0, name
        assert stats["sectors"] == stats["min_sectors"], (name, stats)
    assert launch["buffers"]["x"]["widest_access"] == width  # 16-byte loads
    assert launch["buffers"]["y"]["widest_access"] == width // np.dtype(dtype).itemsize


def test_scalar_path_when_hidden_is_not_a_vector_multiple():
    op, args = inputs(3, 1001, jnp.bfloat16, residual=True)
    _, launch = run(op, *args)
    assert launch["buffers"]["x"]["widest_access"] == 2
    for name, stats in launch["buffers"].items():
        assert stats["sectors"] == stats["min_sectors"], (name, stats)  # still coalesced


@pytest.mark.parametrize("optin_kib,cached", [(48, False), (100, True)])
def test_a_64_kib_row_is_cached_only_where_the_device_allows(optin_kib, cached):
    op, args = inputs(2, 16384, jnp.float32)  # 64 KiB of float32 per row
    with simt.device(shared_per_block_optin=optin_kib * 1024):
        _, launch = run(op, *args)
    assert launch["dynamic_shared_bytes"] == (16384 * 4 if cached else 0)
    assert launch["buffers"]["x"]["bytes_read"] == (1 if cached else 3) * nbytes(args[0])


def test_more_dynamic_shared_memory_than_the_default_is_opted_into():
    op, args = inputs(3, 1000, jnp.float32)  # 4000 bytes cached, the default is 2 KiB
    with simt.device(shared_per_block=2048, shared_per_block_optin=16384):
        _, launch = run(op, *args)
    assert launch["dynamic_shared_bytes"] == 4000


@pytest.mark.parametrize("rows,hidden", [(1000, 40), (100, 4104)])
def test_a_grid_capped_at_three_blocks_strides_over_the_rows(rows, hidden):
    # Each block does many rows: every row's requests must still be told apart.
    op, args = inputs(rows, hidden, jnp.bfloat16, residual=True, gamma_dtype=jnp.bfloat16)
    with simt.device(max_grid_x=3, shared_per_block_optin=4096):  # 4104: re-read
        _, launch = run(op, *args)
    assert launch["blocks"] == 3
    for name, stats in launch["buffers"].items():
        assert stats["sectors"] == stats["min_sectors"], (name, stats)


def test_float32_gamma_beside_16bit_x_takes_two_requests_per_vector():
    # 8 bfloat16 per lane meet 8 float32 of gamma: 32 bytes, which a GPU thread loads as
    # two 16-byte pieces, each request spanning twice the sectors its bytes need.
    op, args = inputs(3, 4096, jnp.bfloat16)
    _, launch = run(op, *args)
    x, gamma = launch["buffers"]["x"], launch["buffers"]["gamma"]
    assert gamma["requests"] == 2 * x["requests"]
    # 32 lanes x 16 bytes 32 bytes apart: a sector each, where 16 (17 unaligned) would do.
    assert gamma["sectors"] == 32 * gamma["requests"]
    assert gamma["min_sectors"] <= 17 * gamma["requests"]
    assert x["sectors"] == x["min_sectors"]


def test_a_row_longer_than_a_block_is_strided_over_its_threads():
    op, args = inputs(2, 8200, jnp.bfloat16)  # 1025 vectors of 8
    _, launch = run(op, *args)
    assert launch["threads"] == 1024
    assert launch["buffers"]["x"]["bytes_read"] == nbytes(args[0])


def test_block_reductions_meet_at_every_barrier_and_shuffle():
    # 3 rows, 4 warps: per row two block reductions of two barriers each, and per warp
    # five shuffle steps per reduction (two values for the sum), plus warp 0's second pass.
    op, args = inputs(3, 1000, jnp.bfloat16)  # 125 vectors: 128 threads
    _, launch = run(op, *args)
    assert launch["threads"] == 128
    assert launch["barriers"] == 3 * 4
    assert launch["shuffles"] == 3 * (4 * (10 + 5) + (10 + 5))


def test_a_launch_the_device_refuses_raises_instead_of_crashing():
    op, args = inputs(2, 4096, jnp.bfloat16)  # the plan asks for 512 threads
    with (
        simt.kernels(),
        simt.device(max_threads_per_block=256),
        fp8norm.use_cuda_kernel("block_shared"),
    ):
        with pytest.raises(Exception, match="block of 512 threads"):
            jax.block_until_ready(jax.jit(getattr(fp8norm, op))(*args))
        assert simt.take_launches()[-1]["error"]
    # The emulation is usable again afterwards.
    run(op, *args)


def test_schedule_seed_changes_the_order_not_the_bits():
    op, args = inputs(4, 3000, jnp.float16, residual=True)
    first, _ = run(op, *args)
    previous = simt.set_schedule_seed(12345)
    try:
        second, _ = run(op, *args)
    finally:
        assert simt.set_schedule_seed(previous) == 12345
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_outside_the_block_the_ops_use_the_cpu_kernels():
    _, args = inputs(2, 64, jnp.bfloat16)
    with simt.kernels():
        with simt.kernels():
            pass
        assert simt.active()  # leaving a nested block keeps the outer one's
        assert "fp8norm_simt_rms_norm_fp8" in jax.jit(fp8norm.rms_norm_fp8).lower(*args).as_text()
    assert not simt.active()
    assert "fp8norm_simt_" not in jax.jit(fp8norm.rms_norm_fp8).lower(*args).as_text()
    simt.take_launches()
    jax.block_until_ready(fp8norm.rms_norm_fp8(*args))
    assert simt.take_launches() == []


# ---------------------------------------------------------------- the register variants

REGISTER_VARIANTS = ["warp_rows", "block_registers"]


@pytest.mark.parametrize("variant", REGISTER_VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_register_variants_touch_every_byte_once_fully_coalesced(variant, dtype, residual):
    rows, hidden = 11, 2048
    op, args = inputs(rows, hidden, dtype, residual=residual, gamma_dtype=dtype)
    out, launch = run(op, *args, variant=variant)
    buffers = launch["buffers"]
    assert launch["kernel"] == variant and launch["dynamic_shared_bytes"] == 0
    assert_every_byte_moved_once(buffers, args, out, rows, residual)
    for name, stats in buffers.items():
        assert stats["sectors"] == stats["min_sectors"], (name, stats)
    assert buffers["x"]["widest_access"] == 16


def test_warp_rows_with_a_warp_per_row_meets_at_no_barrier():
    # 1024 bfloat16 = 128 vectors: a warp of 4 each, 8 rows per 256-thread block; 13 rows
    # leave 3 groups of the second block without a row, which still shuffle.
    op, args = inputs(13, 1024, jnp.bfloat16)
    _, launch = run(op, *args, variant="warp_rows")
    assert (launch["blocks"], launch["threads"]) == (2, 256)
    assert launch["barriers"] == 0
    assert launch["shuffles"] == 2 * 8 * (10 + 5)  # per warp: the sum's two values, the max


def test_warp_rows_with_several_warps_per_row_meets_once_per_reduction():
    # 4096 bfloat16 = 512 vectors: 128 threads of 4, 2 rows per block.
    op, args = inputs(5, 4096, jnp.bfloat16)
    _, launch = run(op, *args, variant="warp_rows")
    assert (launch["blocks"], launch["threads"]) == (3, 256)
    assert launch["barriers"] == 3 * 2
    assert launch["shuffles"] == 3 * 8 * 2 * (10 + 5)  # warp pass and group pass


def test_block_registers_meets_once_per_reduction():
    # 4096 bfloat16: 256 threads of 2 vectors; two barriers per row where block_shared
    # needs four.
    op, args = inputs(3, 4096, jnp.bfloat16)
    _, launch = run(op, *args, variant="block_registers")
    assert (launch["blocks"], launch["threads"]) == (3, 256)
    assert launch["barriers"] == 3 * 2
    assert launch["shuffles"] == 3 * 8 * 2 * (10 + 5)


@pytest.mark.parametrize("variant", REGISTER_VARIANTS)
def test_register_variants_stride_over_rows_on_a_capped_grid(variant):
    op, args = inputs(100, 1024, jnp.float16, residual=True, gamma_dtype=jnp.float16)
    with simt.device(max_grid_x=3):
        _, launch = run(op, *args, variant=variant)
    assert launch["blocks"] == 3
    assert launch["buffers"]["x"]["bytes_read"] == nbytes(args[0])
    for name, stats in launch["buffers"].items():
        assert stats["sectors"] == stats["min_sectors"], (name, stats)


@pytest.mark.parametrize("variant", REGISTER_VARIANTS)
def test_a_register_variant_that_cannot_hold_the_row_runs_block_shared(variant):
    op, args = inputs(2, 1001, jnp.bfloat16)  # not a vector multiple
    _, launch = run(op, *args, variant=variant)
    assert launch["kernel"] == "block_shared"
    assert launch["dynamic_shared_bytes"] == 1001 * 4  # its row cache
