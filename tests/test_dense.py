"""The layer, rms_norm_dense / add_rms_norm_dense: its value and gradients within a bound
derived from the formats' precision (against exact float64 math, no quantisation), each
row's bits independent of the batch, and the transforms a training program applies (jit,
vmap, remat, scan)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    EXTENDED,
    RECIPE_NAMES,
    device_of,
    random_gamma,
    random_rows,
    recipe,
    same_bits,
)

import jax_fp8norm as fp8norm
from jax_fp8norm import _vjp
from jax_fp8norm._primitives import bind_norm

# Quantisation error of one element v of a block whose largest magnitude is `amax`:
# |deq(q(v)) - v| <= rel * |v| + abs * amax, for blocks whose scale is a normal number.
#   E4M3 (3 mantissa bits): half an ulp, 2^-4 of |v|; below 2^-6 (subnormal) half of the
#     step 2^-9 of t = v / s, with s < amax / 224 (a power of two >= amax / 448, or
#     amax / 448 itself).
#   E5M2 (2 bits): 2^-3; subnormal step 2^-16 of t, s < amax / 28672.
#   E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6): at most 0.25 of t below 2 and 0.2 of |t| above; for
#     MXFP4 s < amax / 3 (a power of two >= amax / 6); for NVFP4 s is E4M3(amax / 6) (2^-4
#     from it), so t may reach 6 / (1 - 2^-4) and be clipped by 0.4 s.
FORMAT_ERRORS = {
    "e4m3": (2.0**-4, 2.0**-10 / 224),
    "e5m2": (2.0**-3, 2.0**-17 / 28672),
    "mxfp4": (0.2, 0.25 / 3),
    "nvfp4": (0.2, (0.25 + 0.4) * (1 + 2.0**-4) / 6),
}
# Float32 arithmetic (the normalisation, the scales' products, the accumulations) adds far
# less than this share of the magnitudes it works on.
FLOAT32_SLACK = 2.0**-18

# recipe -> (its codes' format, the gradient's format, the block along each GEMM's
# contraction axis: None for one scale per row or column)
LAYOUTS = {
    "fp8_row": ("e4m3", "e5m2", None),
    "fp8_static": ("e4m3", "e5m2", None),
    "fp8_group128": ("e4m3", "e5m2", 128),
    "fp8_group128_ue8m0": ("e4m3", "e5m2", 128),
    "mxfp8": ("e4m3", "e4m3", 32),
    "nvfp4": ("nvfp4", "nvfp4", 16),
    "mxfp4": ("mxfp4", "mxfp4", 32),
}
ROWS, K, F = 256, 256, 384
# The FP4 recipes' training parts off: the bounds and row invariance below are
# round-to-nearest's (stochastic rounding's bits are the element's place in the call;
# tests/test_fp4_training.py holds the parts). The Hadamard transform is off in every
# differentiated FP4 call until the norm's columnwise codes take it.
NEAREST = {"stochastic_rounding": False, "hadamard": False}
# Stochastic rounding with a fixed key, the transform off (as above).
KEYED = {"key": jax.random.key(0), "hadamard": False}


def quantisation_bound(v: np.ndarray, fmt: str, block: int | None, axis: int, amax=None):
    """The bound above for each element of ``v`` quantised in blocks of ``block`` along
    ``axis`` (the whole axis for None), or with a given ``amax`` (a calibrated scale)."""
    rel, absolute = FORMAT_ERRORS[fmt]
    a = np.abs(v)
    if amax is None:
        moved = np.moveaxis(a, axis, -1)
        size = moved.shape[-1] if block is None else block
        blocks = moved.reshape(*moved.shape[:-1], -1, size)
        amax = np.repeat(blocks.max(-1), size, axis=-1).reshape(moved.shape)
        amax = np.moveaxis(amax, -1, axis)
    return rel * a + absolute * amax + FLOAT32_SLACK * a


def product_bound(a, ea, b, eb):
    """|a_q @ b_q - a @ b| for |a_q - a| <= ea, |b_q - b| <= eb, float32 accumulation."""
    a, b = np.abs(a), np.abs(b)
    return ea @ b + a @ eb + ea @ eb + FLOAT32_SLACK * ((a + ea) @ (b + eb))


def _operands(seed=0, rows=ROWS):
    x = random_rows(seed, (rows, K), np.float32, spread=1.0)
    gamma = random_gamma(seed, K, np.float32)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, F)) / 16).astype(np.float32)
    g = rng.standard_normal((rows, F)).astype(np.float32)
    return x, gamma, w, g


def _exact(x, gamma, w, g, eps=1e-6):
    """The layer in float64 without quantisation: n, r, u, out and the gradients of
    sum(out * g)."""
    x, gamma, w, g = (np.asarray(a, np.float64) for a in (x, gamma, w, g))
    r = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    u = x * r
    n = u * gamma
    dn = g @ w.T
    dx = r * (gamma * dn - u * np.mean(u * gamma * dn, -1, keepdims=True))
    return dict(n=n, r=r, u=u, out=n @ w, dn=dn, dx=dx, dgamma=(u * dn).sum(0), dw=n.T @ g)


def _layer_gradients(platform, name, x, gamma, w, g, parts=NEAREST):
    """The layer's out, dx, dgamma, dw; the FP4 recipes with ``parts`` (FP8's ignore them)."""
    keywords = recipe(name, **(parts if fp8norm.RECIPES[name].fp4 else {}))

    def loss(x, gamma, w):
        out = fp8norm.rms_norm_dense(x, gamma, w, result_dtype=jnp.float32, **keywords)
        return jnp.sum(out * g), out

    device = device_of(platform)
    args = [jax.device_put(a, device) for a in (x, gamma, w)]
    grads, out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(*args)
    return np.asarray(out), *(np.asarray(d) for d in grads)


def _recipes(*default: str) -> list:
    """Every recipe, those not named in the extended tier only."""
    return [n if n in default else pytest.param(n, marks=EXTENDED) for n in RECIPE_NAMES]


# The CPU kernels, and the CUDA kernels' source emulated, in the variant that runs the
# columnwise form in one launch with the rows.
LAYER_PLATFORMS = pytest.mark.parametrize(
    "platform", ["cpu", pytest.param("simt-warp_rows", marks=EXTENDED), "gpu"], indirect=True
)


@LAYER_PLATFORMS
@pytest.mark.parametrize("name", _recipes("mxfp8", "nvfp4"))
def test_value_and_gradients_within_the_formats_bound(platform, name):
    x, gamma, w, g = _operands()
    out, dx, dgamma, dw = _layer_gradients(platform, name, x, gamma, w, g)
    e = _exact(x, gamma, w, g)
    fmt, grad_fmt, block = LAYOUTS[name]
    static = recipe(name).get("static_scale")
    amax = None if static is None else np.full(e["n"].shape, 448.0 * static)
    # Forward: n quantised along K by the norm, w along K.
    e_n = quantisation_bound(e["n"], fmt, block, axis=1, amax=amax)
    e_w = quantisation_bound(w, fmt, block, axis=0)
    bound = product_bound(e["n"], e_n, w, e_w)
    # dgrad: g quantised along F (by rows), w^T along F.
    e_g = quantisation_bound(g, grad_fmt, block, axis=1)
    e_wt = quantisation_bound(w.T, fmt, block, axis=0)
    e_dn = product_bound(g, e_g, w.T, e_wt)
    u, r, gamma_abs = np.abs(e["u"]), e["r"], np.abs(gamma)
    dn_abs = np.abs(e["dn"]) + e_dn
    e_dx = r * (gamma_abs * e_dn + u * np.mean(u * gamma_abs * e_dn, -1, keepdims=True))
    c_abs = np.mean(u * gamma_abs * dn_abs, -1, keepdims=True)
    e_dx += FLOAT32_SLACK * r * (gamma_abs * dn_abs + u * c_abs)
    e_dgamma = (u * e_dn).sum(0) + FLOAT32_SLACK * (u * dn_abs).sum(0)
    # wgrad: n quantised along the rows (the columnwise codes), g along the rows; the
    # per-row recipe keeps its rows' codes y and folds their scales s into g instead:
    # dw = y^T @ q(s * g), so |error| <= e_n^T |g| + |y|^T e(s * g).
    if name == "fp8_row":
        y, s = (np.asarray(a, np.float64) for a in fp8norm.rms_norm_fp8(x, gamma, recipe=name))
        e_sg = quantisation_bound(s * g, grad_fmt, None, axis=0)
        y_abs = np.abs(y).T
        e_dw = e_n.T @ np.abs(g) + y_abs @ e_sg + FLOAT32_SLACK * (y_abs @ np.abs(s * g))
    else:
        e_nt = quantisation_bound(e["n"], fmt, block, axis=0, amax=amax)
        e_gw = quantisation_bound(g, grad_fmt, block, axis=0)
        e_dw = product_bound(e["n"].T, e_nt.T, g, e_gw)
    for what, got, want, allowed in (
        ("out", out, e["out"], bound),
        ("dx", dx, e["dx"], e_dx),
        ("dgamma", dgamma, e["dgamma"], e_dgamma),
        ("dw", dw, e["dw"], e_dw),
    ):
        error = np.abs(got - want)
        assert np.all(np.isfinite(got)), what
        assert np.all(error <= allowed), (what, float((error / allowed).max()))
        # The quantisation is there (not a float32 layer that trivially meets the bound).
        assert error.max() > 1e-4 * np.abs(want).max(), what


@LAYER_PLATFORMS
@pytest.mark.parametrize("name", _recipes("fp8_row", "mxfp4"))
def test_rows_have_the_same_bits_in_every_batch(platform, name):
    """A row's output and dx depend on that row alone (the output gradient is quantised row
    by row, NVFP4's with a global scale per row; the GEMMs' rows are the CPU's tiles)."""
    x, gamma, w, g = _operands(1)
    full = _layer_gradients(platform, name, x, gamma, w, g)
    # The rows [size, 2 size) of the full batch alone, and between other rows: 32 rows
    # (128 for the recipes of 128-row blocks), where XLA's untiled dot gives them other bits
    # (the next test), and 96 (384).
    size = max(32, LAYOUTS[name][2] or 32)
    rows = slice(size, 2 * size)
    other_x, other_g = x[::-1][:size] * 3.0, g[:size] * 100.0
    batches = [
        (x[rows], g[rows], 0),
        (
            np.concatenate([other_x, x[rows], other_x]),
            np.concatenate([other_g, g[rows], other_g]),
            size,
        ),
    ]
    for xb, gb, start in batches:
        part = _layer_gradients(platform, name, xb, gamma, w, gb)
        for what, a, b in (("out", full[0], part[0]), ("dx", full[1], part[1])):
            got = b[start : start + size].view(np.uint32)
            np.testing.assert_array_equal(a[rows].view(np.uint32), got, what)


def test_the_plain_cpu_product_depends_on_the_rows():
    """The invariance test above can fail: XLA's CPU dot, untiled, gives the 32 rows it
    takes other bits in a call of those rows alone, at the layer's shapes (dgrad's)."""
    a = random_rows(2, (ROWS, F), np.float32)
    b = random_rows(3, (F, K), np.float32)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
    full = np.asarray(dot(a, b))
    assert not np.array_equal(np.asarray(dot(a[32:64], b)), full[32:64])


def test_the_residual_form_is_the_layer_of_the_sum(platform="cpu"):
    """add_rms_norm_dense's gradients are rms_norm_dense's of h = x + residual, plus the
    cotangent of residual_out, bit for bit (float32 rows)."""
    x, gamma, w, g = _operands(2)
    residual = random_rows(4, x.shape, np.float32)
    d_res = random_rows(5, x.shape, np.float32)

    def add_loss(x, residual, gamma, w):
        out, residual_out = fp8norm.add_rms_norm_dense(x, residual, gamma, w, recipe="mxfp8")
        return jnp.sum(out.astype(jnp.float32) * g) + jnp.sum(residual_out * d_res)

    def loss(h, gamma, w):
        return jnp.sum(fp8norm.rms_norm_dense(h, gamma, w, recipe="mxfp8").astype(jnp.float32) * g)

    dx, dres, dgamma, dw = jax.jit(jax.grad(add_loss, (0, 1, 2, 3)))(x, residual, gamma, w)
    dh, dgamma1, dw1 = jax.jit(jax.grad(loss, (0, 1, 2)))(x + residual, gamma, w)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dh + d_res))
    np.testing.assert_array_equal(np.asarray(dres), np.asarray(dx))
    np.testing.assert_array_equal(np.asarray(dgamma), np.asarray(dgamma1))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw1))


def _same_but_for_sums(got, want):
    """Within 2^-16 of the largest value: a reordered float32 sum, where a wrong rule (a
    missing batch element, a gradient not passed through) is off by far more."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max()
    assert scale > 0 and np.abs(got - want).max() <= 2.0**-16 * scale


@pytest.mark.parametrize(
    "name",
    ["nvfp4", pytest.param("mxfp8", marks=EXTENDED), pytest.param("fp8_row", marks=EXTENDED)],
)
def test_transforms(name):
    """vmap over a batch axis, remat and scan over layers give the plain call's gradients.
    Equal but for the order of the GEMMs' float32 sums, which XLA may change with the
    program (docs/spec.md, "The layer"). The FP4 recipe's gradient is rounded
    stochastically with one key: the bits are the element's place, the same in each."""
    keywords = recipe(name, **(KEYED if fp8norm.RECIPES[name].fp4 else {}))
    x, gamma, w, g = _operands(3, rows=128)
    xb, gb = x.reshape(2, 64, K), g.reshape(2, 64, F)

    def loss(x, gamma, w, g):
        return jnp.sum(fp8norm.rms_norm_dense(x, gamma, w, **keywords).astype(jnp.float32) * g)

    grad = jax.grad(loss, (0, 1, 2))
    each = [jax.jit(grad)(xb[i], gamma, w, gb[i]) for i in range(2)]
    mapped = jax.jit(jax.vmap(grad, (0, None, None, 0)))(xb, gamma, w, gb)
    for i in range(2):
        for a, b in zip(mapped, each[i], strict=True):
            _same_but_for_sums(a[i], b)
    plain = jax.jit(grad)(x, gamma, w, g)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), (0, 1, 2)))(x, gamma, w, g)
    for a, b in zip(remat, plain, strict=True):
        _same_but_for_sums(a, b)

    # Two layers of [K, K] weights, a python loop against lax.scan.
    ws = jnp.stack([jnp.asarray(w[:, :K]), jnp.asarray(w[:, F - K :][:, ::-1])])
    gammas = jnp.stack([gamma, gamma[::-1]])

    def stack_loop(x, gammas, ws):
        for i in range(2):
            x = x + fp8norm.rms_norm_dense(x, gammas[i], ws[i], **keywords)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    def stack_scan(x, gammas, ws):
        def layer(x, p):
            return x + fp8norm.rms_norm_dense(x, p[0], p[1], **keywords), None

        return jnp.sum(jax.lax.scan(layer, x, (gammas, ws))[0].astype(jnp.float32) ** 2)

    looped = jax.jit(jax.grad(stack_loop, (0, 1, 2)))(x, gammas, ws)
    scanned = jax.jit(jax.grad(stack_scan, (0, 1, 2)))(x, gammas, ws)
    for a, b in zip(looped, scanned, strict=True):
        _same_but_for_sums(a, b)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(w=np.ones((K, F), np.int32)), TypeError, "w must be float32"),
        (dict(w=np.ones((K + 1, F), np.float32)), ValueError, r"w must have shape \(x.shape"),
        (dict(w=np.ones((K,), np.float32)), ValueError, "w must have shape"),
        (dict(result_dtype=jnp.int8), TypeError, "result_dtype must be"),
        (dict(x=np.ones((64, K), np.int32)), TypeError, "x must be"),
    ],
)
def test_bad_input(change, error, match):
    args = dict(x=np.ones((64, K), np.float32), gamma=np.ones(K, np.float32))
    args["w"] = np.ones((K, F), np.float32)
    args.update(change)
    with pytest.raises(error, match=match):
        fp8norm.rms_norm_dense(**args, recipe="mxfp8")


@pytest.mark.parametrize("name", ["fp8_row", "nvfp4", pytest.param("mxfp8", marks=EXTENDED)])
def test_tiny_gradient_rows_stay_finite(name):
    """A row of the output gradient of magnitude 1e-36 (its amax / 57344 or / 2688 below the
    normal range) gets a scale of at least 2^-126, not a zero one and Inf codes."""
    x, gamma, w, g = _operands(6, rows=64)
    g = g.copy()
    g[0] = 1e-36
    g[1] = 3e-38
    _, dx, dgamma, dw = _layer_gradients("cpu", name, x, gamma, w, g, KEYED)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dgamma)) and np.all(np.isfinite(dw))
    assert np.abs(dx[0]).max() < 1e-30


def test_empty_rows_and_output_features_the_gradient_cannot_block():
    """No rows: an empty output and zero gradients. Output features that are not whole
    blocks of dgrad's: a ValueError when differentiated, fine in an inference call."""
    x, gamma, w, _ = _operands(7, rows=48)

    def loss(x, gamma, w):
        return jnp.sum(fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8") ** 2)

    assert fp8norm.rms_norm_dense(x[:32], gamma, w[:, :40], recipe="mxfp8").shape == (32, 40)
    with pytest.raises(ValueError, match="output features"):
        jax.grad(loss)(x[:32], gamma, w[:, :40])
    dx, dgamma, dw = jax.grad(loss, (0, 1, 2))(x[:0], gamma, w)
    assert dx.shape == (0, K) and not np.asarray(dgamma).any() and not np.asarray(dw).any()


def _padded_layer(name, rows, x, gamma, w, g, residual, d_res):
    """out, dx (, dresidual), dgamma, dw of the layer (the add layer with a residual) on
    ``x [..., K]`` and the cotangents ``g`` (and ``d_res``) of its first ``rows`` rows'
    outputs: the other rows' cotangents are zero, as a padding of the user's own gives.
    The FP4 gradient rounded stochastically with one key: the padded rows are the same
    rows of the operand either way."""
    keywords = recipe(name, **(KEYED if fp8norm.RECIPES[name].fp4 else {}))

    def loss(x, residual, gamma, w):
        if residual is None:
            out = fp8norm.rms_norm_dense(x, gamma, w, result_dtype=jnp.float32, **keywords)
            extra = 0.0
        else:
            out, residual_out = fp8norm.add_rms_norm_dense(
                x, residual, gamma, w, result_dtype=jnp.float32, **keywords
            )
            extra = jnp.sum(residual_out.reshape(-1, K)[:rows] * d_res)
        return jnp.sum(out.reshape(-1, F)[:rows] * g) + extra, out

    argnums = (0, 2, 3) if residual is None else (0, 1, 2, 3)
    # On the CPU, whose GEMMs give a row the same bits in any batch (a GPU's need not).
    with jax.default_device(device_of("cpu")):
        grads, out = jax.jit(jax.grad(loss, argnums, has_aux=True))(x, residual, gamma, w)
    flat = [np.asarray(out).reshape(-1, F)] + [np.asarray(d) for d in grads]
    return [
        v.reshape(-1, v.shape[-1])[:rows] if v.ndim > 1 and i < len(flat) - 2 else v
        for i, v in enumerate(flat)
    ]


@pytest.mark.parametrize(
    ("name", "shape", "add"),
    [
        ("mxfp8", (3, 16), False),  # 48 rows, blocks of 32
        ("fp8_group128", (64,), True),  # 64 rows, blocks of 128
        pytest.param("nvfp4", (5, 8), True, marks=EXTENDED),  # 40 rows, blocks of 16
        pytest.param("mxfp4", (33,), False, marks=EXTENDED),
    ],
)
def test_rows_are_padded_to_the_gradients_blocks(name, shape, add):
    """Rows that are not whole blocks of the columnwise codes are padded with zero rows
    under differentiation. Against the same rows padded by hand (zero rows, whose
    cotangents are zero): every output's bits, dgamma and dw included (a zero row changes
    no block's amax and adds zero to every sum); and against the rows as the first of a
    larger batch of other data: out and dx (and dresidual), which depend on their own
    rows alone."""
    block = LAYOUTS[name][2]
    rows = int(np.prod(shape))
    padded_rows = -(-rows // block) * block
    x, gamma, w, g = _operands(11, rows=padded_rows)
    # One large element in each row: the others' normalised values are small, so that a
    # padding row that is not zero (or other rows of a larger batch) raises the columnwise
    # blocks' scales and coarsens these rows' codes, which dw would show.
    x[np.arange(padded_rows), (np.arange(padded_rows) * 7) % K] *= 1000.0
    residual = random_rows(12, x.shape, np.float32) if add else None
    d_res = random_rows(13, (rows, K), np.float32)
    g = g[:rows].copy()
    # The last partial block's cotangent small: a padding of g that is not zero (ones, or
    # copies of other rows) raises that block's amax in dw's GEMM and pushes its rows'
    # codes into the format's subnormals (E5M2's wide range takes a far smaller factor).
    g[rows - rows % block :] *= 2.0**-34 if LAYOUTS[name][1] == "e5m2" else 1e-3
    zeros = np.zeros((padded_rows - rows, K), np.float32)
    own = (
        x[:rows].reshape(*shape, K),
        None if residual is None else residual[:rows].reshape(*shape, K),
    )
    by_hand = (np.concatenate([x[:rows], zeros]),)
    by_hand += (None if residual is None else np.concatenate([residual[:rows], zeros]),)
    larger = x, residual
    got = _padded_layer(name, rows, *own[:1], gamma, w, g, own[1], d_res)
    want = _padded_layer(name, rows, by_hand[0], gamma, w, g, by_hand[1], d_res)
    other = _padded_layer(name, rows, larger[0], gamma, w, g, larger[1], d_res)
    names = ["out", "dx"] + (["dresidual"] if add else []) + ["dgamma", "dw"]
    for what, a, b, c in zip(names, got, want, other, strict=True):
        assert np.all(np.isfinite(b)), what
        same_bits(a, b, what)
        if what not in ("dgamma", "dw"):
            same_bits(a, c, what)
    # The larger batch's other rows do change dw (the comparison with zero rows can fail).
    assert (got[-1] != other[-1]).any()


def test_rows_are_padded_only_where_the_gradient_needs_it(monkeypatch):
    """The norm runs on the caller's rows, in their shape, where they are whole blocks,
    where the recipe has no blocks of rows (one scale per row, a static scale) and where
    the layer is not differentiated; on zero-padded rows where the gradient needs them."""
    shapes = []

    def recording(call, rows, gamma, **form):
        shapes.append(rows[0].shape)
        return bind_norm(call, rows, gamma, **form)

    monkeypatch.setattr(_vjp, "bind_norm", recording)
    x, gamma, w, _ = _operands(14, rows=48)

    def norm_rows(x, differentiated=True, **keywords):
        def loss(x, gamma, w):
            return jnp.sum(fp8norm.rms_norm_dense(x, gamma, w, **keywords) ** 2)

        shapes.clear()
        jax.make_jaxpr(jax.grad(loss, (0, 1, 2)) if differentiated else loss)(x, gamma, w)
        return shapes[0]

    assert norm_rows(x, recipe="mxfp8") == (64, K)
    assert norm_rows(x.reshape(3, 16, K), recipe="mxfp8") == (64, K)
    assert norm_rows(x[:32].reshape(2, 16, K), recipe="mxfp8") == (2, 16, K)
    assert norm_rows(x, recipe="fp8_row") == (48, K)
    assert norm_rows(x, **recipe("fp8_static")) == (48, K)
    assert norm_rows(x, differentiated=False, recipe="mxfp8") == (48, K)
    # The dequantised twin's head takes no columnwise codes: its rows are never padded.
    shapes.clear()
    twin = fp8norm.rms_norm_fp8_dequantized
    jax.make_jaxpr(jax.grad(lambda x: jnp.sum(twin(x, gamma, recipe="mxfp8"))))(x)
    assert shapes[0] == (48, K)


def test_fp4_blocks_other_than_the_formats_are_refused():
    x, gamma, w, _ = _operands(8, rows=64)
    nvfp4_32 = dict(out_dtype=jnp.float4_e2m1fn, scale_dtype=jnp.float8_e4m3fn, group_size=32)
    with pytest.raises(ValueError, match="group_size=32"):
        fp8norm.rms_norm_dense(x, gamma, w, **nvfp4_32)


@pytest.mark.parametrize("name", ["mxfp8", "fp8_row", pytest.param("nvfp4", marks=EXTENDED)])
def test_a_weight_of_several_output_axes_is_the_flattened_call(name):
    """w [K, 8, 48] (an einsum weight "...k,kf->...f", the blocks of dgrad's 32 crossing
    the 48s) gives the [K, 384] call reshaped, bit for bit: out [..., 8, 48] and every
    gradient (dw in w's shape), the add layer's too; x of rank 3. The FP4 gradient's
    random bits are those of the flattened operand's elements."""
    keywords = recipe(name, **(KEYED if fp8norm.RECIPES[name].fp4 else {}))
    x, gamma, w, g = _operands(9, rows=64)
    x, g = x.reshape(2, 32, K), g.reshape(2, 32, F)
    residual = random_rows(10, x.shape, np.float32)
    w3, g3 = w.reshape(K, 8, 48), g.reshape(2, 32, 8, 48)

    def grads(w, g):
        def loss(x, residual, gamma, w):
            out, residual_out = fp8norm.add_rms_norm_dense(x, residual, gamma, w, **keywords)
            plain = fp8norm.rms_norm_dense(x, gamma, w, **keywords)
            assert out.shape == plain.shape == x.shape[:-1] + w.shape[1:]
            return jnp.sum(out * g) + jnp.sum(plain * g * 0.5) + jnp.sum(residual_out**2), out

        return jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(x, residual, gamma, w)

    (dx3, dres3, dgamma3, dw3), out3 = grads(w3, g3)
    (dx, dres, dgamma, dw), out = grads(w, g)
    assert dw3.shape == w3.shape
    for what, a, b in (
        ("out", out3, out.reshape(out3.shape)),
        ("dx", dx3, dx),
        ("dresidual", dres3, dres),
        ("dgamma", dgamma3, dgamma),
        ("dw", dw3, dw.reshape(w3.shape)),
    ):
        assert np.all(np.isfinite(np.asarray(b))), what
        same_bits(a, b, what)


def test_no_gamma_and_a_broadcast_gamma():
    """gamma=None is a weight of exactly 1 (whatever weight_offset), gamma (1, K) the
    gamma (K,): the same bits of out, dx, dresidual and dw, and dgamma in gamma's shape."""
    x, gamma, w, g = _operands(15, rows=48)
    residual = random_rows(16, x.shape, np.float32)

    def grads(gamma, gamma_grad, **keywords):
        def loss(x, residual, gamma, w):
            out, residual_out = fp8norm.add_rms_norm_dense(
                x, residual, gamma, w, recipe="mxfp8", **keywords
            )
            plain = fp8norm.rms_norm_dense(x, gamma, w, recipe="mxfp8", **keywords)
            return jnp.sum((out + plain) * g) + jnp.sum(residual_out**2), out

        argnums = (0, 1, 2, 3) if gamma_grad else (0, 1, 3)
        grads, out = jax.jit(jax.grad(loss, argnums, has_aux=True))(x, residual, gamma, w)
        return [out, *grads]

    ones = grads(np.ones(K, np.float32), False)
    for what, a, b in zip(["out", "dx", "dres", "dw"], grads(None, False), ones, strict=True):
        assert np.all(np.isfinite(np.asarray(b))), what
        same_bits(a, b, what)
    offset = grads(None, False, weight_offset=1.0)
    for what, a, b in zip(["out", "dx", "dres", "dw"], offset, ones, strict=True):
        same_bits(a, b, what)
    flat = grads(gamma, True)
    broadcast = grads(gamma.reshape(1, K), True)
    assert broadcast[3].shape == (1, K)
    for what, a, b in zip(["out", "dx", "dres", "dgamma", "dw"], broadcast, flat, strict=True):
        same_bits(np.asarray(a).reshape(np.shape(b)), b, what)
