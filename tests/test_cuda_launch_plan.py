"""The CUDA launch plan (src/cuda/cuda_launch_plan.h), the one host function behind every
launch decision, with injected device limits: the kernel variant, vectorised or scalar,
threads, blocks, rows per block, the row cached in shared memory or re-read, and the
opt-in. Runs without a GPU."""

from __future__ import annotations

import pytest
from jax_fp8norm_kernels import _fp8norm_simt as host_logic

F32, F16, BF16 = (
    host_logic.FloatType.float32,
    host_logic.FloatType.float16,
    host_logic.FloatType.bfloat16,
)
H100_OPTIN = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90
STATIC = 400  # block_shared's SharedScratch, as ptxas reports it
VARIANTS = host_logic.kernel_variants()
PLAN_FIELDS = (
    "variant", "vectorized", "vector_width", "threads", "blocks", "cached",
    "dynamic_shared_bytes", "opt_in", "threads_per_row", "rows_per_block", "vectors_per_thread",
)  # fmt: skip


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
    variant="block_shared",
    **limits,
):
    """The plan as a dict, with an H100's limits but for those given."""
    device = host_logic.DeviceLimits()
    device.optin_shared_bytes = optin
    device.static_shared_bytes = static
    device.max_blocks = max_blocks
    for name, value in limits.items():
        setattr(device, name, value)
    kernel = getattr(host_logic.KernelVariant, variant)
    p = host_logic.plan_launch(rows, hidden, dtype, residual, gamma, misalign, device, kernel)
    return {name: getattr(p, name) for name in PLAN_FIELDS}


def test_model_sized_row_is_vectorised_and_cached_without_opt_in():
    p = plan(4096, 4096)
    assert p == {
        "variant": "block_shared",
        "vectorized": True,
        "vector_width": 8,
        "threads": 512,  # one 16-byte load per thread
        "blocks": 4096,
        "cached": True,
        "dynamic_shared_bytes": 4096 * 4,
        "opt_in": False,
        "threads_per_row": 512,
        "rows_per_block": 1,
        "vectors_per_thread": 0,
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


# ---------------------------------------------------------------- the real static size


def test_a_row_that_fits_only_without_the_padding_is_re_read():
    # 12189 float32 = 48756 bytes: beside the 396 bytes of SharedScratch they would fit
    # 48 KiB, beside the 400 ptxas lays out they do not. The plan counts what
    # cudaFuncGetAttributes reports, so a device without opt-in re-reads the row.
    assert plan(4, 12189, F32, optin=48 * 1024, static=396)["cached"]
    assert not plan(4, 12189, F32, optin=48 * 1024, static=400)["cached"]


def test_the_row_cache_keeps_to_the_attribute_the_setup_left():
    # The driver refused the opt-in attribute: the kernel allows 48 KiB less its static
    # size, and rows beyond it are re-read instead of failing to launch.
    p = plan(4, 12188, F32, max_dynamic_shared_bytes=48 * 1024 - STATIC)
    assert p["cached"] and not p["opt_in"]
    p = plan(4, 20000, F32, max_dynamic_shared_bytes=48 * 1024 - STATIC)
    assert not p["cached"] and p["dynamic_shared_bytes"] == 0


def test_the_reserved_shared_memory_counts_per_multiprocessor():
    # A device whose SM holds 227 KiB + 1 KiB: a 227 KiB block fits with the reservation,
    # one byte more does not.
    limits = dict(reserved_shared_bytes=1024, multiprocessor_shared_bytes=H100_OPTIN + 1024)
    assert plan(4, 58012, F32, optin=H100_OPTIN + 4, **limits)["cached"]
    assert not plan(4, 58013, F32, optin=H100_OPTIN + 4, **limits)["cached"]


# ---------------------------------------------------------------- variants


def test_variant_names():
    assert VARIANTS == ["auto", "block_shared", "warp_rows", "block_registers"]


@pytest.mark.parametrize(
    ("hidden", "dtype", "threads_per_row", "vectors"),
    [
        (64, BF16, 32, 1),  # 8 vectors: one warp, lanes 8-31 idle
        (1024, BF16, 32, 4),  # 128 vectors: a warp of 4 each
        (2048, BF16, 64, 4),
        (4096, BF16, 128, 4),
        (8192, BF16, 256, 4),
        (1000, F32, 64, 4),  # 250 vectors
    ],
)
def test_warp_rows_layout(hidden, dtype, threads_per_row, vectors):
    p = plan(1000, hidden, dtype, variant="warp_rows")
    assert p["variant"] == "warp_rows"
    assert (p["threads_per_row"], p["vectors_per_thread"]) == (threads_per_row, vectors)
    assert p["threads"] == 256 and p["rows_per_block"] == 256 // threads_per_row
    assert p["blocks"] == -(-1000 // p["rows_per_block"])
    assert p["dynamic_shared_bytes"] == 0
    # Every vector of the row has a slot, and a warp's worth fewer would not do.
    vecs = hidden // p["vector_width"]
    assert threads_per_row * vectors >= vecs


@pytest.mark.parametrize(
    ("hidden", "dtype", "threads", "vectors"),
    [
        (64, BF16, 32, 2),
        (4096, BF16, 256, 2),
        (8192, BF16, 512, 2),
        (16384, BF16, 512, 4),
        (8192, F32, 512, 4),
    ],
)
def test_block_registers_layout(hidden, dtype, threads, vectors):
    p = plan(7, hidden, dtype, variant="block_registers")
    assert p["variant"] == "block_registers"
    assert (p["threads"], p["vectors_per_thread"], p["rows_per_block"]) == (threads, vectors, 1)
    assert p["blocks"] == 7 and p["dynamic_shared_bytes"] == 0


@pytest.mark.parametrize("variant", ["warp_rows", "block_registers"])
def test_a_register_variant_that_cannot_hold_the_row_runs_block_shared(variant):
    assert plan(4, 4096 + 1, BF16, variant=variant)["variant"] == "block_shared"  # scalar
    assert plan(4, 4096, BF16, misalign=2, variant=variant)["variant"] == "block_shared"
    too_long = {"warp_rows": 8192 + 8, "block_registers": 16384 + 8}[variant]
    assert plan(4, too_long, BF16, variant=variant)["variant"] == "block_shared"


@pytest.mark.parametrize(
    ("rows", "hidden", "dtype", "misalign", "variant"),
    [
        (4096, 4096, BF16, 0, "warp_rows"),  # many rows: a few warps per row
        (64, 4096, BF16, 0, "block_registers"),  # few rows: a block per row
        (4096, 16384, BF16, 0, "block_registers"),  # longer than warp_rows holds
        (4096, 65536, BF16, 0, "block_shared"),  # longer than registers hold
        (4096, 4097, BF16, 0, "block_shared"),  # scalar path
        (4096, 4096, BF16, 2, "block_shared"),  # misaligned
    ],
)
def test_auto_table(rows, hidden, dtype, misalign, variant):
    assert plan(rows, hidden, dtype, misalign=misalign, variant="auto")["variant"] == variant
