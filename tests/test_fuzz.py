"""Property-based tests: random shapes, dtypes, constants, values and every keyword
(hypothesis), every kernel held to the reference: bit for bit on cpu and simt, by the
spec's accuracy rule on a GPU. Each example draws one scaling mode (MODES): per-row
scales, groups (a size dividing the drawn hidden size), power-of-two scales (as floats or
e8m0), a static scale, NVFP4 with its global scale or MXFP4, each with the keywords the
spec lets it take.

The default tier runs a small budget, the extended tier (CI) the full one;
FP8NORM_FUZZ_EXAMPLES sets the full budget (tools/gpu_check.sh runs a larger one on the
GPU) and FP8NORM_FUZZ_MAX_ELEMENTS raises the size cap of one example.
A failure prints the example and a `@reproduce_failure` blob that replays it.
"""

from __future__ import annotations

import os
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from exact import exact_sum_of_squares, nearest_float32  # noqa: E402
from helpers import (  # noqa: E402
    EXTENDED,
    FLOATS,
    FP8S,
    RECIPE_NAMES,
    SIMT_PLATFORMS,
    assert_kernel_matches,
    is_simt,
    layout,
    reference_on_cpu,
    run_on,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax_fp8norm as fp8norm  # noqa: E402
from jax_fp8norm._params import NORM_KEYWORDS  # noqa: E402
from jax_fp8norm.recipes import apply_recipe  # noqa: E402
from jax_fp8norm.testing import assert_matches_reference  # noqa: E402

EXAMPLES = int(os.environ.get("FP8NORM_FUZZ_EXAMPLES", "300"))
MAX_ELEMENTS = int(os.environ.get("FP8NORM_FUZZ_MAX_ELEMENTS", str(1 << 19)))
MAX_ROWS = 5000
MAX_HIDDEN = 70000

F4 = jnp.float4_e2m1fn
E4M3 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu
SMALLEST_NORMAL_F32 = 2.0**-126

# The scaling modes an example draws (docs/spec.md, "Block scaling and static scales" and
# "FP4 outputs"): "row" is the per-row nearest scale, "group" nearest scales per group,
# "power_of_two" power_of_two_scales=True with float32 or bfloat16 scales, "e8m0" the
# float8_e8m0fnu scale dtype (per row or per group), "static" a calibrated scale, "nvfp4"
# and "mxfp4" the FP4 outputs, "recipe" a recipe= with the keywords it leaves free.
MODES = ("row", "group", "power_of_two", "e8m0", "static", "nvfp4", "mxfp4", "recipe")
# Group sizes the formats and models use, drawn more often where they divide N.
USUAL_GROUPS = (16, 32, 64, 128)

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
def shapes(draw, even: bool = False) -> tuple[int, ...]:
    """A shape; with ``even``, an even hidden size (FP4 groups are even)."""
    rank = draw(st.integers(1, 4))
    hidden = draw(
        st.one_of(st.integers(1, 64), st.integers(1, MAX_HIDDEN), st.sampled_from(AWKWARD_HIDDEN))
    )
    if even and hidden % 2:
        hidden = hidden + 1 if hidden < MAX_HIDDEN else hidden - 1
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
        # Small but normal: float16's smallest normals; otherwise magnitudes from 2^-64 to
        # 2^-40, where squares fall below float32's smallest normal and their rounding
        # errors are subnormal. Compared bit for bit except where the kernels' flushing of
        # those errors may change the sum of squares (flushing_rows).
        if dtype == np.float16:
            return normal * float(finfo.tiny) * 4
        return normal * 2.0 ** rng.uniform(-64, -40)
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
    """Rows the spec's flushing rule exempts (docs/spec.md, "Edge cases"): rows made only
    of magnitudes below float32's smallest normal (2^-126), some of them nonzero, which a
    kernel may flush to zero. Never float16 rows (every float16 is a normal float32);
    never a row of zeros, and never a row holding anything of 2^-126 or more: those are
    compared bit for bit on cpu and simt."""
    rows = h.reshape(-1, h.shape[-1])
    if np.dtype(x_dtype) == np.float16:
        return np.zeros(rows.shape[0], bool)
    magnitude = np.abs(rows)
    with np.errstate(invalid="ignore"):
        return np.all(magnitude < SMALLEST_NORMAL_F32, axis=-1) & np.any(magnitude > 0, axis=-1)


def flushing_rows(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sensitive, loose): the rows whose sum of squares the kernels' denormal flushing may
    change, and those of them it may change by more than the accuracy rule can absorb.

    Sensitive (docs/spec.md, "The sum of squares", "Flushing"): a square of |x| below 2^-40
    can have a rounding error, and its addition a TwoSum error, below 2^-126, which a kernel
    running with denormals flushed loses (less than 2^-126 each). With k such elements (of
    2^-64 or more: smaller ones have squares that count as zero everywhere) the kernel's sum
    lies within k * 2^-125 of the exact one, so only a row whose exact sum lies within that
    distance (twice it here, for margin) of a float32 rounding boundary may see a different
    ss. Those rows are held to the accuracy rule, every other row to the reference's bits.

    Loose: a bound k * 2^-124 above 2^-21 of the sum itself (a sum of squares made mostly
    of elements below 2^-40) can move r, and so the scales, by more than 4 ulps where eps is
    small beside the mean square. The spec promises only the bound there; these rows are
    exempt, as rows made only of subnormals are.

    Exact: tests/exact.py's integer sum, no floating-point addition, once per row."""
    rows = h.reshape(-1, h.shape[-1]).astype(np.float32)
    sensitive = np.zeros(rows.shape[0], bool)
    loose = np.zeros(rows.shape[0], bool)
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(rows)
        small = np.sum((magnitude >= 2.0**-64) & (magnitude < 2.0**-40), axis=-1)
        finite = np.isfinite(rows).all(axis=-1)
    for i in np.nonzero((small > 0) & finite)[0]:
        exact = exact_sum_of_squares(rows[i])
        nearest = nearest_float32(exact)
        bound = int(small[i]) * Fraction(2) ** -124
        loose[i] = bound > nearest * Fraction(2) ** -21
        if nearest == 0:
            sensitive[i] = True
            continue
        if abs(nearest) > Fraction(2) ** 128:
            continue  # overflows: NaN everywhere
        exponent = nearest.numerator.bit_length() - nearest.denominator.bit_length()
        if Fraction(2) ** exponent > nearest:
            exponent -= 1
        ulp = Fraction(2) ** (max(exponent, -126) - 23)
        to_boundary = abs(abs(exact - nearest) - ulp / 2)
        sensitive[i] = to_boundary <= bound
    return sensitive, loose


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


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def group_sizes(hidden: int, even: bool = False):
    """A group size dividing ``hidden`` (even ones only with ``even``): the usual sizes
    where they divide it, or any divisor."""
    every = [g for g in divisors(hidden) if not even or g % 2 == 0]
    usual = [g for g in USUAL_GROUPS if g in every]
    return (
        st.one_of(st.sampled_from(usual), st.sampled_from(every))
        if usual
        else st.sampled_from(every)
    )


def _as_scale_argument(value: float):
    """A per-tensor scale as the spec lets a caller pass it: a Python float, or a float32
    array of shape () or (1,)."""
    return st.sampled_from([value, np.asarray(value, np.float32), np.full((1,), value, np.float32)])


def per_tensor_scales():
    """A static or global scale: mostly a positive one from 10^-8 to 10^3, sometimes one
    the spec says makes every output NaN (0, negative, NaN, Inf) or a subnormal."""
    good = st.floats(-8, 3).map(lambda e: float(10.0**e))
    bad = st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e-40, 2e-38])
    return st.one_of(good, good, good, bad).flatmap(_as_scale_argument)


def _recipe_keywords(draw, name: str) -> dict:
    """recipe=name and what it leaves to the caller: its data (a calibrated or global
    scale), scale_ub where the layout takes one, sometimes a keyword it sets, repeated."""
    keywords = {"recipe": name}
    spelled = layout(name)
    if name == "fp8_static":
        keywords["static_scale"] = draw(per_tensor_scales())
    elif name == "nvfp4":
        if draw(st.booleans()):
            keywords["global_scale"] = draw(per_tensor_scales())
    else:
        scale_dtype = spelled.get("scale_dtype", jnp.float32)
        keywords["scale_ub"] = draw(scale_ub_for(scale_dtype))
    if name.startswith("fp8_"):
        keywords["out_dtype"] = draw(st.sampled_from(FP8S))
    if draw(st.booleans()):
        keywords["group_size"] = spelled.get("group_size")  # consistent: accepted
    return keywords


def _fit_to_groups(shape: tuple[int, ...], group: int | None) -> tuple[int, ...]:
    """``shape`` with its hidden size rounded to a multiple of ``group`` (at least one
    group), its rows cut to keep the example's size."""
    if group is None:
        return shape
    hidden = max(group, shape[-1] // group * group)
    if len(shape) == 1:
        return (hidden,)
    lead = int(np.prod(shape[:-2]))
    rows = min(shape[-2], MAX_ELEMENTS // hidden // max(lead, 1))
    return (*shape[:-2], rows, hidden)


def _mode_keywords(draw, mode: str, hidden: int) -> dict:
    """The layout keywords of a scaling mode other than "recipe"."""
    fp4 = mode in ("nvfp4", "mxfp4")
    keywords = {}
    if fp4:
        keywords["out_dtype"] = F4
        keywords["group_size"] = draw(group_sizes(hidden, even=True))
    else:
        keywords["out_dtype"] = draw(st.sampled_from(FP8S))
    if mode == "nvfp4":
        keywords["scale_dtype"] = E4M3
        keywords["global_scale"] = draw(st.one_of(st.none(), per_tensor_scales()))
        if keywords["global_scale"] is None:
            del keywords["global_scale"]  # the default, 1.0
    elif mode == "mxfp4":
        keywords["scale_dtype"] = E8M0
        keywords["scale_ub"] = draw(scale_ub_for(E8M0))
    elif mode == "static":
        keywords["scale_dtype"] = draw(st.sampled_from(FLOATS))
        keywords["static_scale"] = draw(per_tensor_scales())
    else:
        if mode == "e8m0":
            keywords["scale_dtype"] = E8M0
        elif mode == "power_of_two":
            keywords["scale_dtype"] = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
            keywords["power_of_two_scales"] = True
        else:
            keywords["scale_dtype"] = draw(st.sampled_from(FLOATS))
        if mode == "group" or (mode != "row" and draw(st.booleans())):
            keywords["group_size"] = draw(group_sizes(hidden))
        keywords["scale_ub"] = draw(scale_ub_for(keywords["scale_dtype"]))
    return keywords


@st.composite
def cases(draw, modes=MODES):
    mode = draw(st.sampled_from(modes))
    shape = draw(shapes(even=mode in ("nvfp4", "mxfp4")))
    x_dtype = draw(st.sampled_from(FLOATS))
    keywords = dict(
        eps=draw(st.one_of(st.just(1e-6), st.just(0.0), st.just(1e-8), st.floats(0.0, 1.0))),
        weight_offset=draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(-4.0, 4.0))),
    )
    if mode == "recipe":
        name = draw(st.sampled_from(RECIPE_NAMES))
        keywords.update(_recipe_keywords(draw, name))
        shape = _fit_to_groups(shape, layout(name).get("group_size"))
    else:
        keywords.update(_mode_keywords(draw, mode, shape[-1]))
    kinds = draw(st.lists(st.sampled_from(ROW_KINDS), min_size=1, max_size=len(ROW_KINDS)))
    return dict(
        op=draw(st.sampled_from(["rms_norm_fp8", "add_rms_norm_fp8"])),
        mode=mode,
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
    sensitive, loose = flushing_rows(h)
    keep = ~exempt_rows(h, x_dtype) & ~loose
    flushed = sensitive & keep
    bits = keep & ~flushed
    spelled = {"out_dtype": jnp.float8_e4m3fn, "scale_dtype": jnp.float32, **apply_recipe(kw)}
    groups = shape[-1] // spelled["group_size"] if spelled.get("group_size") else 1
    assert out[0].shape == shape and out[0].dtype == np.dtype(spelled["out_dtype"])
    assert out[1].shape == shape[:-1] + (groups,)
    assert out[1].dtype == np.dtype(spelled["scale_dtype"])
    assert_kernel_matches(platform, _keep_rows(out, bits), _keep_rows(ref, bits), **kw)
    if flushed.any():
        power_of_two = spelled.get("power_of_two_scales") or None
        assert_matches_reference(
            _keep_rows(out, flushed), _keep_rows(ref, flushed), power_of_two=power_of_two
        )


def _checker(examples: int, modes=MODES):
    return settings(
        max_examples=examples,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(given(case=cases(modes))(_check_case))


# The default tier: an example of each mode on the CPU kernel, and each mode on one of
# the emulated variants (they take turns: each is a third of the emulation's cost), so that
# every keyword reaches both kernels in every run. The full budget draws any mode.
QUICK_PER_MODE = 1
_quick = {mode: _checker(QUICK_PER_MODE, (mode,)) for mode in MODES}
_full = {
    emulated: _checker(max(1, EXAMPLES // (len(SIMT_PLATFORMS) if emulated else 1)))
    for emulated in (True, False)
}


def quick_modes(platform: str) -> tuple[str, ...]:
    if not is_simt(platform):
        return MODES
    return MODES[SIMT_PLATFORMS.index(platform) :: len(SIMT_PLATFORMS)]


def test_kernel_matches_reference_on_random_cases(platform):
    for mode in quick_modes(platform):
        _quick[mode](platform)


def test_the_fuzz_draws_every_keyword_of_the_table():
    # A keyword added to the table (NORM_KEYWORDS) fails this until the fuzz draws it. The
    # draws are the same in every run (derandomize), so the verdict cannot change by chance.
    drawn = set()

    @settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @given(case=cases())
    def record(case):
        drawn.update(case["keywords"])

    record()
    assert drawn == set(NORM_KEYWORDS)


def test_the_default_tier_reaches_every_mode_on_both_kernels():
    emulated = [m for p in SIMT_PLATFORMS for m in quick_modes(p)]
    assert sorted(emulated) == sorted(MODES) == sorted(quick_modes("cpu"))


@EXTENDED
@pytest.mark.long_running
def test_kernel_matches_reference_on_the_full_budget(platform):
    _full[is_simt(platform)](platform)
