"""The training forms and the fused backward (docs/spec.md, "Training: the backward
pass"): the exact sums against an oracle in fractions, the kernels' bits against the twins,
invariance to the batch and the thread count, the custom_vjp against jax.grad of the
float32 formula, and bad input."""

from __future__ import annotations

import warnings

import exact
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BACKWARD_PLATFORMS,
    check_against_reference,
    random_gamma,
    random_rows,
    recipe,
    reference_on_cpu,
    run_on,
    same_bits,
)

import jax_fp8norm as fp8norm
from jax_fp8norm import _training, reference


def cancelling_terms(seed: int, rows: int, k: int) -> np.ndarray:
    """float32 rows whose sums cancel: pairs t, -t(1 + small), magnitudes over 2^-140 ..
    2^120, so that a float32 sum in any fixed order loses most of the result."""
    rng = np.random.default_rng(seed)
    half = rng.standard_normal((rows, k // 2)) * 2.0 ** rng.integers(-140, 120, (rows, k // 2))
    wobble = 1 + rng.integers(-3, 4, (rows, k // 2)) * 2.0**-23
    terms = np.concatenate([half, -half * wobble], axis=1).astype(np.float32)
    return rng.permuted(terms, axis=1)


def test_exact_sum_against_fractions():
    """The twin's order-free sum is the float32 nearest to the exact sum of its terms, on rows
    built to cancel and at the edges (overflow, results and terms below 2^-126, infinities,
    NaN); a float32 sum in a fixed order gets many of them wrong."""
    rows = exact_sum_cases()
    width = max(len(r) for r in rows)
    padded = np.stack([np.pad(r, (0, width - len(r))) for r in rows])
    got = np.asarray(jax.jit(reference.exact_sum)(padded))
    want = np.array([exact.backward_sum(r) for r in rows], np.float32)
    same_bits(got, want)
    with np.errstate(over="ignore", invalid="ignore"):
        forward = np.array([np.cumsum(r, dtype=np.float32)[-1] for r in rows[:40]])
        backward = np.array([np.cumsum(r[::-1], dtype=np.float32)[-1] for r in rows[:40]])
    assert np.sum(forward != want[:40]) > 10 and np.sum(forward != backward) > 10


def exact_sum_cases() -> list[np.ndarray]:
    """Rows of float32 terms whose exact sums cancel, overflow, tie, sit just above a tie,
    fall below 2^-126, or hold infinities and NaN."""
    big = np.float32(2.0**127)
    return [
        *cancelling_terms(0, 40, 40),
        np.array([big, big, -big, big * 0.5], np.float32),  # past float32 on the way only
        np.array([big, big, big], np.float32),  # overflows: +inf
        np.array([2.0**-126, -(2.0**-126) * (1 - 2**-23), 3e-39], np.float32),  # below 2^-126
        np.array([-(2.0**-126), (2.0**-126) * (1 - 2**-23)], np.float32),  # below, negative: +0
        np.array([1.0, 2.0**-24, 2.0**-70], np.float32),  # above the tie: rounds up
        np.array([1.0, 2.0**-24], np.float32),  # the tie: to even
        np.array([1.0 + 2**-23, 2.0**-24], np.float32),  # the tie, odd: up
        np.array([np.inf, 1.0, -3.0], np.float32),
        np.array([np.inf, -np.inf, 1.0], np.float32),
        np.array([np.nan, 1.0], np.float32),
        np.zeros(5, np.float32),
    ]


@BACKWARD_PLATFORMS
def test_kernel_sums_are_exact(platform):
    """The kernels' two sums against the oracle: with x = 1 and r = 1, u = 1, so that
    dgamma_j is the exact sum of column j of dn, and c that of a row of dn (gamma = 1)."""
    cases = exact_sum_cases()
    k = max(len(c) for c in cases)
    columns = np.stack([np.pad(c, (0, k - len(c))) for c in cases], axis=1)  # [k, cases]
    x = np.ones(columns.shape, np.float32)
    gamma = np.ones(columns.shape[1], np.float32)
    r = np.ones((k, 1), np.float32)
    dx, dgamma = run_on(platform, _training.rms_norm_backward, columns, x, gamma, r)
    # The terms dn_j * 1, flushed as every product is (|t| <= 2^-126 is zero).
    want = [exact.backward_sum(exact.flushed(c)) for c in columns.T]
    same_bits(dgamma, np.array(want, np.float32))
    rows = np.stack([np.pad(c, (0, k - len(c))) for c in cases])  # [cases, k]
    ones = np.ones(rows.shape, np.float32)
    dx, _ = run_on(
        platform,
        _training.rms_norm_backward,
        rows,
        ones,
        np.ones(k, np.float32),
        np.ones((len(cases), 1), np.float32),
    )
    want, _ = exact.backward_rows(rows, ones, np.ones(k, np.float32), np.ones(len(cases)))
    same_bits(dx, want)


@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_backward_against_the_oracle(add):
    """dx and dgamma of the CPU kernel and of the twin, against the spec's backward one
    float32 operation at a time with the sums in fractions, on rows whose c and dgamma
    cancel (dn chosen so that a_j * u_j and dn_j * u_j come in near-opposite pairs)."""
    rows, n = 12, 64
    rng = np.random.default_rng(1)
    x = random_rows(2, (rows, n), "float32", spread=12)  # squares within float32
    x[3] = 0.0  # a zero row: u = 0, dx = r * a
    x[5, :8] = 1e-39  # float32 subnormals in, flushed
    gamma = random_gamma(3, n, "float32")
    half = rng.standard_normal((rows, n // 2)) * 2.0 ** rng.integers(-30, 30, (rows, 1))
    dn = np.concatenate([half, -half], axis=1).astype(np.float32)
    dn[:, n // 2 :] *= (gamma[: n // 2] * x[:, : n // 2]) / (
        gamma[n // 2 :] * x[:, n // 2 :] + 1e-30
    )
    dn = np.nan_to_num(dn, posinf=1.0, neginf=-1.0).astype(np.float32)
    _, _, r = _training.rms_norm_fp8_training(x, gamma)
    assert np.all(np.isfinite(np.asarray(r)))  # finite arithmetic: no NaN row to hide in
    if add:
        residual = np.zeros_like(x)
        d_residual_out = random_rows(4, (rows, n), "float32")
        got = _training.add_rms_norm_backward(dn, d_residual_out, x, residual, gamma, r)
        twin = reference_on_cpu(
            reference.add_rms_norm_backward, dn, d_residual_out, x, residual, gamma, r
        )
    else:
        got = _training.rms_norm_backward(dn, x, gamma, r)
        twin = reference_on_cpu(reference.rms_norm_backward, dn, x, gamma, r)
    dx, dgamma = exact.backward_rows(dn, x, gamma, np.asarray(r))
    if add:
        dh = exact.flushed(dx + exact.flushed(d_residual_out))
        want = (dh, dh, dgamma)
    else:
        want = (dx, dgamma)
    for g, t, w in zip(got, twin, want, strict=True):
        assert np.all(np.isfinite(w))
        same_bits(g, w)
        same_bits(t, w)
    # The cancelling columns: dgamma in float32 in row order misses the exact sums.
    terms = exact.flushed(exact.flushed(dn) * exact.flushed(exact.flushed(x) * np.asarray(r)))
    assert np.sum(np.cumsum(terms, axis=0, dtype=np.float32)[-1] != want[-1]) > n // 4


SHAPES = [(2, 3, 33), (1, 1), (17, 1000), (0, 8), (3, 0)]
DTYPE_CASES = [
    # (x, dn, gamma)
    (jnp.float32, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    (jnp.float16, jnp.float16, jnp.float32),
    (jnp.float16, jnp.float32, jnp.float16),
]


@pytest.mark.sampled(16)
@BACKWARD_PLATFORMS
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=lambda d: "-".join(t.__name__ for t in d))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_backward_kernels_give_the_twins_bits(platform, add, dtypes, shape, weight_offset):
    """The CPU kernel and the emulated CUDA kernels (bits) and a GPU's (the accuracy rule)
    against the twin, for every dtype combination, odd and empty shapes."""
    x_dtype, dn_dtype, gamma_dtype = dtypes
    n = shape[-1]
    x = random_rows(10, shape, x_dtype)
    gamma = random_gamma(11, n, gamma_dtype)
    dn = random_rows(12, shape, dn_dtype)
    kw = dict(weight_offset=weight_offset)
    if add:
        residual = random_rows(13, shape, x_dtype)
        d_residual_out = random_rows(14, shape, x_dtype)
        *_, r = jax.jit(lambda *a: _training.add_rms_norm_fp8_training(*a, **kw))(
            x, residual, gamma
        )
        args = (dn, d_residual_out, x, residual, gamma, np.asarray(r))
        got, _ = check_against_reference(platform, "add_rms_norm_backward", *args, **kw)
    else:
        *_, r = jax.jit(lambda *a: _training.rms_norm_fp8_training(*a, **kw))(x, gamma)
        args = (dn, x, gamma, np.asarray(r))
        got, _ = check_against_reference(platform, "rms_norm_backward", *args, **kw)
    assert got[-1].shape == (n,) and got[0].dtype == np.dtype(x_dtype)


TRAINING_LAYOUTS = ["fp8_row", "fp8_group128", "mxfp8", "nvfp4", "mxfp4", "fp8_static"]


@pytest.mark.sampled(6)
@pytest.mark.default_platforms("cpu", "simt-block_shared", "simt-warp_rows")
@pytest.mark.parametrize("name", TRAINING_LAYOUTS)
@pytest.mark.parametrize("shape", [(5, 256), (3, 4, 1024), (2, 0)], ids=str)
def test_training_forms_save_r_and_keep_the_ops_bits(platform, name, shape):
    """Every kernel (CPU, each emulated CUDA variant) returns the twin's r and, beside it,
    exactly the plain op's outputs."""
    x = random_rows(20, shape, jnp.bfloat16)
    residual = random_rows(21, shape, jnp.bfloat16)
    gamma = random_gamma(22, shape[-1], jnp.float32)
    kw = recipe(name)
    out, _ = check_against_reference(platform, "rms_norm_fp8_training", x, gamma, **kw)
    plain, _ = check_against_reference(platform, "rms_norm_fp8", x, gamma, **kw)
    for a, b in zip(out[:2], plain, strict=True):
        same_bits(a, b)
    out, _ = check_against_reference(
        platform, "add_rms_norm_fp8_training", x, residual, gamma, **kw
    )
    assert out[-1].shape == shape[:-1] + (1,) and out[-1].dtype == np.float32


@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_gradients_match_float32_autodiff(add):
    """jax.grad through the dequantised ops (the fused backward) against jax.grad of the
    float32 formula, with a loss linear in the output so that both get the same cotangent:
    within 1e-5 of the largest gradient (the two differ only in float32 rounding: the
    formula's mean and its order of operations against the spec's exact sums)."""
    rows, n = 64, 512
    x = random_rows(40, (rows, n), "float32", spread=1)
    residual = random_rows(41, (rows, n), "float32", spread=1)
    gamma = random_gamma(42, n, "float32")
    w = random_rows(43, (rows, n), "float32", spread=0)
    w_res = random_rows(44, (rows, n), "float32", spread=0)

    def formula(x, residual, gamma):
        h = x + residual if add else x
        n_ = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * gamma
        return jnp.sum(n_ * w) + (jnp.sum(h * w_res) if add else 0.0)

    def fused(x, residual, gamma):
        if add:
            out, residual_out = fp8norm.add_rms_norm_fp8_dequantized(x, residual, gamma)
            return jnp.sum(out * w) + jnp.sum(residual_out * w_res)
        return jnp.sum(fp8norm.rms_norm_fp8_dequantized(x, gamma) * w)

    got = jax.jit(jax.grad(fused, argnums=(0, 1, 2)))(x, residual, gamma)
    want = jax.jit(jax.grad(formula, argnums=(0, 1, 2)))(x, residual, gamma)
    for g, w_ in zip(got, want, strict=True):
        scale = float(jnp.max(jnp.abs(w_))) or 1.0
        assert float(jnp.max(jnp.abs(g - w_))) <= 1e-5 * scale


def test_vmap_gives_each_element_its_own_dgamma():
    x = random_rows(50, (3, 7, 40), "bfloat16")
    dn = random_rows(51, (3, 7, 40), "float32")
    gamma = random_gamma(52, 40, "float32")
    _, _, r = _training.rms_norm_fp8_training(x, gamma)
    dx, dgamma = jax.vmap(_training.rms_norm_backward, in_axes=(0, 0, None, 0))(dn, x, gamma, r)
    assert dgamma.shape == (3, 40)
    for i in range(3):
        want = _training.rms_norm_backward(dn[i], x[i], gamma, r[i])
        same_bits(dx[i], want[0])
        same_bits(dgamma[i], want[1])


def test_other_platforms_run_the_backwards_twin():
    """Lowered for a platform without the backward kernel, the backward is its twin (no
    custom call), with the fallback warning."""
    x = jax.ShapeDtypeStruct((4, 16), jnp.bfloat16)
    f32 = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    gamma = jax.ShapeDtypeStruct((16,), jnp.float32)
    r = jax.ShapeDtypeStruct((4, 1), jnp.float32)
    from jax_fp8norm import _fallback

    _fallback._warned.discard("tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = jax.export.export(jax.jit(_training.rms_norm_backward), platforms=("tpu",))(
            f32, x, gamma, r
        )
    assert "custom_call @fp8norm" not in exported.mlir_module()
    assert any(issubclass(w.category, fp8norm.KernelFallbackWarning) for w in caught)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(dn=np.ones((4, 16), np.int32)), TypeError, "dn must be"),
        (dict(dn=np.ones((4, 8), np.float32)), ValueError, "dn must have the shape"),
        (dict(inverse_rms=np.ones((4,), np.float32)), ValueError, "inverse_rms must have shape"),
        (dict(inverse_rms=np.ones((4, 1), np.float16)), TypeError, "inverse_rms must be float32"),
        (dict(gamma=np.ones((8,), np.float32)), ValueError, "gamma must have shape"),
        (dict(weight_offset=1e6), ValueError, "weight_offset must be finite"),
    ],
)
def test_backward_refuses_bad_input_by_name(change, error, words):
    args = (
        dict(
            dn=np.ones((4, 16), np.float32),
            x=np.ones((4, 16), jnp.float16),
            gamma=np.ones((16,), np.float32),
            inverse_rms=np.ones((4, 1), np.float32),
            weight_offset=0.0,
        )
        | change
    )
    with pytest.raises(error, match=words):
        _training.rms_norm_backward(**args)


def test_add_backward_refuses_a_mismatched_d_residual_out():
    x = np.ones((4, 16), jnp.bfloat16)
    r = np.ones((4, 1), np.float32)
    gamma = np.ones(16, np.float32)
    with pytest.raises(TypeError, match="d_residual_out must have the dtype"):
        _training.add_rms_norm_backward(x, np.ones((4, 16), np.float32), x, x, gamma, r)
    with pytest.raises(ValueError, match="d_residual_out must have the shape"):
        _training.add_rms_norm_backward(x, np.ones((4, 8), jnp.bfloat16), x, x, gamma, r)


@BACKWARD_PLATFORMS
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_non_finite_rows_give_the_twins_bits(platform, add):
    """NaN, Inf, overflowing and tiny rows (and a NaN or Inf in dn): r is NaN for the rows
    whose sum of squares is not finite, and the kernels write the twin's bits, every NaN
    the one quiet NaN."""
    x = random_rows(60, (8, 40), "float32")
    x[1, 3] = np.nan
    x[2, 0] = np.inf
    x[3] *= 3e37  # the sum of squares overflows
    x[4] *= 1e-39  # subnormal: flushed
    x[5] = 0.0
    dn = random_rows(61, (8, 40), "float32", spread=30)
    dn[6, 5] = np.inf
    dn[7, 9] = np.nan
    gamma = random_gamma(62, 40, "float32")
    residual = random_rows(63, (8, 40), "float32")
    if add:
        out, _ = check_against_reference(platform, "add_rms_norm_fp8_training", x, residual, gamma)
        args = (dn, dn, x, residual, gamma, out[-1])
        got, _ = check_against_reference(platform, "add_rms_norm_backward", *args)
    else:
        out, _ = check_against_reference(platform, "rms_norm_fp8_training", x, gamma)
        got, _ = check_against_reference(platform, "rms_norm_backward", dn, x, gamma, out[-1])
    r = out[-1].reshape(-1)
    assert np.all(r[1:4].view(np.uint32) == 0x7FC00000) and np.all(np.isfinite(r[4:]))
    nans = got[0][np.isnan(got[0])]
    assert nans.size and np.all(nans.view(np.uint32) == 0x7FC00000)


@BACKWARD_PLATFORMS
def test_products_that_round_to_the_smallest_normal_are_zero(platform):
    """a_j = dn_j * g_j of exact value (1 - 2^-24) * 2^-126: 2^-126 with gradual underflow
    (NumPy, GPUs), zero where tininess is detected before rounding (x86 with FTZ, XLA's CPU
    threads). The rule (|v| <= 2^-126 is zero) makes both zero, so the kernels agree with the
    oracle, which computes with gradual underflow."""
    n = 8
    dn = np.full((2, n), (1 - 2.0**-24) * 2.0**-63, np.float32)
    dn[1] *= -1
    x = np.ones((2, n), np.float32)
    gamma = np.full(n, 2.0**-63, np.float32)
    r = np.ones((2, 1), np.float32)
    assert np.float32(dn[0, 0]) * np.float32(gamma[0]) == np.float32(2.0**-126)  # NumPy: IEEE
    got = run_on(platform, _training.rms_norm_backward, dn, x, gamma, r)
    for g, w in zip(got, exact.backward_rows(dn, x, gamma, r), strict=True):
        same_bits(g, w)
    assert np.all(got[0] == 0)


@BACKWARD_PLATFORMS
@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16", "float16"])
def test_weight_offset_is_rounded_through_x_dtype(platform, x_dtype):
    """weight_offset = 0.1, which no 16-bit float holds: the kernels compute with
    f32(T(0.1)), T being x's dtype (the forward's rounding), and give the oracle's bits;
    the oracle with the offset unrounded gives other bits (checked), so a kernel that
    rounds it otherwise fails."""
    rows, n = 16, 80
    x = random_rows(70, (rows, n), x_dtype, spread=1)
    gamma = random_gamma(71, n, "float32")
    dn = random_rows(72, (rows, n), "float32", spread=3)
    *_, r = run_on(platform, _training.rms_norm_fp8_training, x, gamma, weight_offset=0.1)
    dx, dgamma = run_on(platform, _training.rms_norm_backward, dn, x, gamma, r, weight_offset=0.1)
    assert np.all(np.isfinite(r)) and np.all(np.isfinite(dx.astype(np.float32)))
    rounded = float(np.asarray(0.1, x_dtype).astype(np.float32))
    want_dx, want_dgamma = exact.backward_rows(dn, x.astype(np.float32), gamma, r, rounded)
    same_bits(dx, want_dx.astype(x_dtype))
    same_bits(dgamma, want_dgamma)
    if x_dtype != "float32":
        unrounded_dx, _ = exact.backward_rows(dn, x.astype(np.float32), gamma, r, 0.1)
        assert np.any(unrounded_dx.astype(x_dtype).view(np.uint16) != dx.view(np.uint16))


@BACKWARD_PLATFORMS
@pytest.mark.parametrize("x_dtype, nan_bits", [("bfloat16", 0x7FC0), ("float16", 0x7E00)])
def test_16_bit_gradients_write_the_one_quiet_nan(platform, x_dtype, nan_bits):
    """A NaN in x (and so r) or in dn, and a NaN in a 16-bit d_residual_out: every NaN of
    dx and dresidual is the format's one quiet NaN, whatever the NaN's sign or payload in."""
    rows, n = 6, 40
    x = random_rows(80, (rows, n), x_dtype)
    residual = random_rows(81, (rows, n), x_dtype)
    gamma = random_gamma(82, n, "float32")
    dn = random_rows(83, (rows, n), "float32")
    x[1, 3] = -np.nan
    dn[3, 7] = np.float32(np.uint32(0xFFC00123).view(np.float32))  # a negative NaN, payload
    d_residual_out = random_rows(84, (rows, n), x_dtype)
    d_residual_out[4, 0] = np.nan
    *_, r = run_on(platform, _training.add_rms_norm_fp8_training, x, residual, gamma)
    dx, dresidual, _ = run_on(
        platform, _training.add_rms_norm_backward, dn, d_residual_out, x, residual, gamma, r
    )
    plain_dx, _ = run_on(platform, _training.rms_norm_backward, dn, x, gamma, r)
    for got in (dx, dresidual, plain_dx):
        bits = got.view(np.uint16)
        nan = np.isnan(got.astype(np.float32))
        assert nan[1].all() and nan[3].all() and np.all(bits[nan] == nan_bits), hex(bits[nan][0])
        assert np.isfinite(got[[0, 2, 5]].astype(np.float32)).all()
    assert np.isnan(dx[4, 0].astype(np.float32)) and np.isnan(dresidual[4, 0].astype(np.float32))
