"""A row's bits depend on that row alone (docs/spec.md, "Invariance"): not on the number of
rows in the call, the kernel variant or grid that number selects, or the platform. The same
600 rows are normalised in calls of their first 1, 3, 17, 255, 256, 257 and 600, on the CPU
kernel and on the emulated CUDA kernels as the shape chooses them (``simt-auto``) and as
each variant is forced, per recipe, at hidden sizes of real models (2880: gpt-oss, 4224,
5120: Qwen, Mistral) that are not powers of two. The all-reduce's invariance over methods,
meshes and devices is the all-reduce modules' (tests/test_allreduce_*.py)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from helpers import (
    EXTENDED,
    SIMT_PLATFORMS,
    assert_same_bits,
    check_against_reference,
    kernels_of,
    layout,
    random_gamma,
    random_rows,
    run_on,
)

import jax_fp8norm as fp8norm
import jax_fp8norm.simt

ROW_COUNTS = (1, 3, 17, 255, 256, 257, 600)
RECIPES = {
    "row": layout("fp8_row"),
    "group128": layout("fp8_group128"),
    "mxfp8": layout("mxfp8"),
    "nvfp4": layout("nvfp4", global_scale=0.01),
}
HIDDEN = (2880, 4224, 5120)
CASES = [
    (hidden, recipe)
    for hidden in HIDDEN
    for recipe, kw in RECIPES.items()
    if hidden % kw.get("group_size", 1) == 0  # 2880 is not a multiple of 128
]
# The CPU kernel and the CUDA kernels as the shape picks them in the default tier; each
# forced variant in the extended one.
PLATFORMS = ["cpu", "simt-auto", *(pytest.param(p, marks=EXTENDED) for p in SIMT_PLATFORMS)]


def _pool(hidden: int):
    """600 rows of bfloat16 over four decades, a gamma, and a residual."""
    x = random_rows(hidden, (600, hidden), jnp.bfloat16)
    residual = random_rows(hidden + 1, (600, hidden), jnp.bfloat16)
    return x, residual, random_gamma(hidden + 2, hidden, jnp.float32)


@pytest.mark.sampled(32)
@pytest.mark.parametrize("hidden,recipe", CASES, ids=[f"{h}-{r}" for h, r in CASES])
@pytest.mark.parametrize("op", ["rms_norm_fp8", "add_rms_norm_fp8"])
@pytest.mark.parametrize("where", PLATFORMS)
def test_a_rows_bits_do_not_depend_on_the_row_count(where, op, hidden, recipe):
    kw = RECIPES[recipe]
    x, residual, gamma = _pool(hidden)

    def first(count):
        return (x[:count], gamma) if op == "rms_norm_fp8" else (x[:count], residual[:count], gamma)

    emulated = where.startswith("simt")
    with kernels_of(where):
        if emulated:
            jax_fp8norm.simt.take_launches()
        # All 600 rows: the reference's bits, which ties the platforms together.
        everything, _ = check_against_reference(where, op, *first(600), **kw)
        for count in ROW_COUNTS[:-1]:
            got = run_on(where, getattr(fp8norm, op), *first(count), **kw)
            assert_same_bits(got, [o[:count] for o in everything])
        kernels = (
            {launch["kernel"] for launch in jax_fp8norm.simt.take_launches()} if emulated else set()
        )
    if where == "simt-auto" and hidden != 2880:
        # The counts reach two variants (block_registers for the few rows, warp_rows for
        # 600; 2880 takes block_registers at every count): the bits held across a change
        # of kernel, not only of grid.
        assert len(kernels) == 2, kernels
