"""The CUDA launch plan (src/cuda_launch_plan.h), the one host function behind every
launch decision, with injected device limits: vectorised or scalar, threads, blocks, the
row cached in shared memory or re-read, and the opt-in. Runs without a GPU."""

from __future__ import annotations

import pytest
from jax_fp8norm_kernels import _fp8norm_cpu

F32, F16, BF16 = 0, 1, 2
H100_OPTIN = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90
STATIC = 400  # the kernel's SharedScratch, as ptxas reports it


def plan(
    rows,
    hidden,
    dtype=BF16,
    *,
    residual=False,
    gamma=F32,
    misalign=0,
    optin=H100_OPTIN,
    static=STATIC,
    max_blocks=1 << 30,
):
    return _fp8norm_cpu.plan_rms_norm_fp8_launch(
        rows, hidden, dtype, residual, gamma, misalign, optin, static, max_blocks
    )


def test_model_sized_row_is_vectorised_and_cached_without_opt_in():
    p = plan(4096, 4096)
    assert p == {
        "vectorized": True,
        "vector_width": 8,
        "threads": 512,  # one 16-byte load per thread
        "blocks": 4096,
        "cached": True,
        "dynamic_shared_bytes": 4096 * 4,
        "opt_in": False,
    }


@pytest.mark.parametrize(("dtype", "width"), [(F32, 4), (F16, 8), (BF16, 8)])
def test_vector_width_follows_the_input_dtype(dtype, width):
    assert plan(2, 64 * width, dtype)["vector_width"] == width
    # A hidden size that is not a multiple of the width takes the scalar path.
    p = plan(2, 64 * width + 1, dtype)
    assert not p["vectorized"] and p["vector_width"] == 1


@pytest.mark.parametrize("misalign", [2, 4, 8])
def test_misaligned_rows_take_the_scalar_path(misalign):
    assert plan(8, 4096, misalign=0)["vectorized"]
    assert not plan(8, 4096, misalign=misalign)["vectorized"]
    assert not plan(8, 4096, residual=True, misalign=misalign)["vectorized"]


@pytest.mark.parametrize(
    ("hidden", "dtype", "threads"),
    [
        (1, BF16, 32),
        (8, BF16, 32),
        (264, BF16, 64),
        (8192, BF16, 1024),
        (70001, BF16, 1024),
        (100, F32, 32),
        (1000, F32, 256),
    ],
)
def test_threads_are_whole_warps_up_to_the_block_limit(hidden, dtype, threads):
    p = plan(3, hidden, dtype)
    assert p["threads"] == threads
    assert p["threads"] % 32 == 0 and 32 <= p["threads"] <= 1024


def test_rows_beyond_the_grid_cap_are_strided():
    assert plan(1000, 256, max_blocks=3)["blocks"] == 3
    assert plan(2, 256, max_blocks=3)["blocks"] == 2
    assert plan(131073, 1)["blocks"] == 131073


@pytest.mark.parametrize(
    ("optin", "hidden", "cached", "opt_in"),
    [
        (48 * 1024, 12000, True, False),  # 48000 + 400 bytes fit the default 48 KiB
        (48 * 1024, 12189, False, False),  # 48756 + 400 do not: re-read, no opt-in
        (100 * 1024, 12189, True, True),  # a 100 KiB device opts in
        (100 * 1024, 25500, True, True),
        (100 * 1024, 25601, False, False),  # 102404 + 400 > 100 KiB
        (H100_OPTIN, 58012, True, True),  # 232048 + 400 bytes: exactly 227 KiB
        (H100_OPTIN, 58013, False, False),
    ],
)
def test_row_cache_and_opt_in_follow_the_shared_memory_limit(optin, hidden, cached, opt_in):
    p = plan(4, hidden, F32, optin=optin)
    assert (p["cached"], p["opt_in"]) == (cached, opt_in)
    assert p["dynamic_shared_bytes"] == (hidden * 4 if cached else 0)
    if p["cached"]:
        assert p["dynamic_shared_bytes"] + STATIC <= optin
