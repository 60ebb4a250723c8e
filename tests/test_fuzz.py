"""Property-based tests: random shapes, dtypes, constants and values (hypothesis), every
kernel held to the reference: bit for bit on cpu and simt, by the spec's accuracy rule on
a GPU.

The default tier runs a small budget, the extended tier (CI) the full one;
FP8NORM_FUZZ_EXAMPLES sets the full budget (tools/gpu_check.sh runs a larger one on the
GPU) and FP8NORM_FUZZ_MAX_ELEMENTS raises the size cap of one example.
A failure prints the example and a `@reproduce_failure` blob that replays it.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from helpers import (  # noqa: E402
    EXTENDED,
    SIMT_PLATFORMS,
    assert_kernel_matches,
    is_simt,
    reference_on_cpu,
    run_on,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax_fp8norm as fp8norm  # noqa: E402
from jax_fp8norm.testing import assert_matches_reference  # noqa: E402

EXAMPLES = int(os.environ.get("FP8NORM_FUZZ_EXAMPLES", "300"))
MAX_ELEMENTS = int(os.environ.get("FP8NORM_FUZZ_MAX_ELEMENTS", str(1 << 19)))
MAX_ROWS = 5000
MAX_HIDDEN = 70000

FLOATS = [jnp.float32, jnp.float16, jnp.bfloat16]
FP8S = [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz]
SMALLEST_NORMAL_F32 = 2.0**-126

# What one row holds; every row of an example draws its own kind.
ROW_KINDS = (
    "normal",
    "tiny",
    "huge",
    "subnormal",
    "mixed_sign",
    "outlier",
    "constant",
    "zeros",
    "non_finite",
)

# Hidden sizes where the kernels change path: vector widths, the CPU lane count, the
# GPU block size and its shared-memory row cache (about 56k float32 on an H200).
AWKWARD_HIDDEN = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 127, 1023, 1024, 1025, 8191, 8193]
AWKWARD_HIDDEN += [16383, 16385, 32767, 32769, 56319, 56321, 57343, 57345, 65535, 65537, 70000]


@st.composite
def shapes(draw) -> tuple[int, ...]:
    rank = draw(st.integers(1, 4))
    hidden = draw(
        st.one_of(st.integers(1, 64), st.integers(1, MAX_HIDDEN), st.sampled_from(AWKWARD_HIDDEN))
    )
    if rank == 1:
        return (hidden,)
    max_rows = min(MAX_ROWS, MAX_ELEMENTS // hidden)
    lead = [draw(st.integers(1, 3)) for _ in range(rank - 2)]
    fixed = int(np.prod(lead))
    last = draw(st.integers(0, max_rows // fixed))
    return (*lead, last, hidden)


def _row_values(rng: np.random.Generator, kind: str, n: int, dtype: np.dtype) -> np.ndarray:
    finfo = jnp.finfo(dtype)
    normal = rng.standard_normal(n)
    if kind == "normal":
        return normal * 10.0 ** rng.uniform(-3, 3)
    if kind == "tiny":
        # Small but with float32-normal squares: float16's smallest normals, 1e-15 otherwise.
        return normal * (float(finfo.tiny) * 4 if dtype == np.float16 else 1e-15)
    if kind == "huge":
        # Near the dtype's top: the sum of squares may overflow float32 (a NaN row).
        return np.clip(normal, -4, 4) * float(finfo.max) / 8
    if kind == "subnormal":
        # Subnormal values of the input dtype, mixed into a row with normal ones.
        sub = rng.uniform(-1, 1, n) * float(finfo.smallest_normal)
        return np.where(rng.random(n) < 0.5, sub, normal)
    if kind == "mixed_sign":
        signs = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
        return signs * 10.0 ** rng.uniform(-3, 3, n)
    if kind == "outlier":
        row = normal.copy()
        row[rng.integers(n)] *= 1e4
        return row
    if kind == "constant":
        return np.full(n, rng.choice([-1, 1]) * 10.0 ** rng.uniform(-3, 3))
    if kind == "zeros":
        return np.zeros(n)
    row = normal.copy()  # non_finite
    row[rng.integers(n)] = rng.choice([np.nan, np.inf, -np.inf])
    return row


def values(seed: int, shape: tuple[int, ...], dtype, kinds: list[str]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    n = shape[-1]
    rows = int(np.prod(shape[:-1]))
    out = np.empty((rows, n), np.float64)
    for row in range(rows):
        out[row] = _row_values(rng, kinds[row % len(kinds)], n, dtype)
    with np.errstate(over="ignore"):
        return out.astype(np.float32).astype(dtype).reshape(shape)


def exempt_rows(h: np.ndarray, x_dtype) -> np.ndarray:
    """Rows the accuracy rule does not cover (docs/spec.md): only magnitudes below float32's
    smallest normal, which a kernel may flush to zero. Never float16 rows."""
    rows = h.reshape(-1, h.shape[-1])
    if np.dtype(x_dtype) == np.float16:
        return np.zeros(rows.shape[0], bool)
    with np.errstate(invalid="ignore"):
        return np.all(np.abs(rows) < SMALLEST_NORMAL_F32, axis=-1)


def flushed_rows(h: np.ndarray) -> np.ndarray:
    """Rows whose last bits of the sum of squares may depend on denormal flushing
    (docs/spec.md, "The sum of squares"): a sum below N * 2^-101, where the squares'
    rounding errors below 2^-126 that a kernel may flush can reach its last bit. They are
    held to the accuracy rule, not to bits."""
    rows = h.reshape(-1, h.shape[-1]).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        ss = np.sum(rows * rows, axis=-1)
    return ss < rows.shape[-1] * 2.0**-96  # with margin


def _keep_rows(outputs, keep: np.ndarray):
    if keep.all():
        return outputs
    return tuple(o.reshape(keep.shape[0], -1)[keep] for o in outputs)


def scale_ub_for(scale_dtype):
    # From about the smallest value the scale dtype holds to beyond its range (inf).
    low = -4 if np.dtype(scale_dtype) == np.float16 else -30
    return st.one_of(
        st.none(),
        st.just(float("inf")),
        st.floats(low, 30).map(lambda e: float(10.0**e)),
    )


@st.composite
def cases(draw):
    shape = draw(shapes())
    x_dtype = draw(st.sampled_from(FLOATS))
    scale_dtype = draw(st.sampled_from(FLOATS))
    keywords = dict(
        out_dtype=draw(st.sampled_from(FP8S)),
        scale_dtype=scale_dtype,
        eps=draw(st.one_of(st.just(1e-6), st.just(0.0), st.just(1e-8), st.floats(0.0, 1.0))),
        weight_offset=draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(-4.0, 4.0))),
        scale_ub=draw(scale_ub_for(scale_dtype)),
    )
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=1, max_size=len(ROW_KINDS)))
    return dict(
        op=draw(st.sampled_from(["rms_norm_fp8", "add_rms_norm_fp8"])),
        shape=shape,
        x_dtype=x_dtype,
        gamma_dtype=draw(st.sampled_from(FLOATS)),
        kinds=kinds,
        residual_kinds=draw(st.lists(st.sampled_from(ROW_KINDS), min_size=1, max_size=3)),
        seed=draw(st.integers(0, 2**32 - 1)),
        keywords=keywords,
    )


def _check_case(platform, case):
    shape, x_dtype, kw = case["shape"], case["x_dtype"], case["keywords"]
    x = values(case["seed"], shape, x_dtype, case["kinds"])
    rng = np.random.default_rng(case["seed"] + 1)
    gamma = (rng.uniform(-2, 2, shape[-1]) * 10.0 ** rng.uniform(-1, 1)).astype(
        jnp.dtype(case["gamma_dtype"])
    )
    if case["op"] == "rms_norm_fp8":
        args = (x, gamma)
        h = x.astype(np.float32)
    else:
        residual = values(case["seed"] + 2, shape, x_dtype, case["residual_kinds"])
        args = (x, residual, gamma)
        with np.errstate(over="ignore", invalid="ignore"):
            h = x.astype(np.float32) + residual.astype(np.float32)
    out = run_on(platform, getattr(fp8norm, case["op"]), *args, **kw)
    ref = reference_on_cpu(getattr(fp8norm.reference, case["op"]), *args, **kw)
    keep = ~exempt_rows(h, x_dtype)
    assert out[0].shape == shape and out[1].shape == shape[:-1] + (1,)
    flushed = flushed_rows(h) & keep
    bits = keep & ~flushed
    assert_kernel_matches(platform, _keep_rows(out, bits), _keep_rows(ref, bits))
    if flushed.any():
        assert_matches_reference(_keep_rows(out, flushed), _keep_rows(ref, flushed))


def _checker(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(given(case=cases())(_check_case))


# The emulated kernel variants share one budget: each is a third of the emulation's cost.
# The default tier's budget reaches every row kind and op in a few seconds a platform.
QUICK_EXAMPLES = 15
_checkers = {
    (quick, emulated): _checker(
        max(1, (QUICK_EXAMPLES if quick else EXAMPLES) // (len(SIMT_PLATFORMS) if emulated else 1))
    )
    for quick in (True, False)
    for emulated in (True, False)
}


def test_kernel_matches_reference_on_random_cases(platform):
    _checkers[True, is_simt(platform)](platform)


@EXTENDED
def test_kernel_matches_reference_on_the_full_budget(platform):
    _checkers[False, is_simt(platform)](platform)
