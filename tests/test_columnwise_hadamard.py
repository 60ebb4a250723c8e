"""The columnwise outputs' Hadamard transform (docs/spec.md, "Columnwise outputs"; the
keyword ``hadamard``): y_t and scales_t bits of the kernels (cpu, both ISA variants, and
every emulated CUDA variant) against the twin, for NVFP4 and MXFP4, the fixed signs, a
random mask and mask 0; the rowwise outputs unchanged; a planted error in the transform
changes the codes; the transform itself exact against float64 matrices, and the wgrad
identity (M X)^T (M G) / d = X^T G; bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import ffi_call, handler_target, sds
from helpers import (
    assert_kernel_matches,
    outputs_of_script,
    random_gamma,
    random_rows,
    recipe,
    reference_on_cpu,
    run_on,
)

import jax_fp8norm as fp8norm
from jax_fp8norm import _fp4_parts, _training, reference
from jax_fp8norm._fp4_parts import HADAMARD_SIGNS, hadamard_rows, signs
from jax_fp8norm.testing import assert_same_bits

FP4_RECIPES = ["nvfp4", "mxfp4"]
# A random sign mask per block size (from a fixed seed), beside the recipe's fixed signs
# (True) and the deterministic transform (0).
RANDOM_MASKS = {16: 0x9A3E, 32: 0x5C0FF1E7}
MASKS = ["fixed", "random", "zero"]
# NVFP4's layout in blocks of 64: FP4, but no transform's block.
FP4_64 = dict(out_dtype=jnp.float4_e2m1fn, scale_dtype=jnp.float8_e4m3fn, group_size=64)


def block_of(name: str) -> int:
    return 16 if name == "nvfp4" else 32


def hadamard_of(name: str, mask: str):
    return {"fixed": True, "random": RANDOM_MASKS[block_of(name)], "zero": 0}[mask]


def rows_with_specials(seed: int, shape, dtype) -> np.ndarray:
    """Rows of spread magnitudes, one holding a NaN, one an Inf, one all zeros: the blocks
    of the first two take the rule of a row that is not finite, untransformed."""
    x = random_rows(seed, shape, dtype).reshape(-1, shape[-1])
    x[3, 5] = np.nan
    x[40, -1] = np.inf
    x[70] = 0
    return x.reshape(shape)


def op_and_args(add: bool, shape, dtype, seed: int = 0):
    x = rows_with_specials(seed, shape, dtype)
    gamma = random_gamma(seed + 1, shape[-1], jnp.float32)
    if not add:
        return "rms_norm_fp8", (x, gamma)
    residual = random_rows(seed + 2, shape, dtype, spread=0.5)
    return "add_rms_norm_fp8", (x, residual, gamma)


@pytest.mark.sampled(6)
@pytest.mark.parametrize("name", FP4_RECIPES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(256, 96), (4, 32, 160)])
def test_kernels_give_the_twins_bits(platform, name, mask, add, dtype, shape):
    op, args = op_and_args(add, shape, dtype)
    kw = dict(recipe(name), columnwise=True, hadamard=hadamard_of(name, mask))
    out = run_on(platform, getattr(fp8norm, op), *args, **kw)
    ref = reference_on_cpu(getattr(reference, op), *args, **kw)
    rows = int(np.prod(shape[:-1]))
    assert out[-2].shape == (shape[-1], rows)
    assert out[-1].shape == (shape[-1], rows // block_of(name))
    assert_kernel_matches(platform, out, ref, **recipe(name))
    # The rowwise outputs are the op's without the transform; the columnwise ones are not.
    plain = run_on(platform, getattr(fp8norm, op), *args, **dict(kw, hadamard=None))
    assert_same_bits(out[:-2], plain[:-2])
    # Rows 96 on: finite blocks (those of the NaN and Inf rows have zero codes either way).
    changed = out[-2][:, 96:].view(np.uint8) != plain[-2][:, 96:].view(np.uint8)
    assert np.mean(changed) > 0.5


@pytest.mark.parametrize("platform", ["cpu", "simt-warp_rows", "gpu"], indirect=True)
@pytest.mark.parametrize("name", FP4_RECIPES)
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_training_forms(platform, name, add):
    """The training forms take the keyword too (warp_rows: both layouts in one launch)."""
    op, args = op_and_args(add, (2, 64, 128), jnp.bfloat16, seed=5)
    kw = dict(recipe(name), columnwise=True, hadamard=True)
    out = run_on(platform, getattr(_training, f"{op}_training"), *args, **kw)
    ref = reference_on_cpu(getattr(reference, f"{op}_training"), *args, **kw)
    assert_kernel_matches(platform, out, ref, **recipe(name))
    outs, _ = getattr(_training, f"{op}_vjp")(*args, **kw)
    assert_same_bits(outs, run_on("cpu", getattr(fp8norm, op), *args, **kw))


@pytest.mark.parametrize("platform", ["cpu", "simt-block_shared", "gpu"], indirect=True)
@pytest.mark.parametrize("name", FP4_RECIPES)
def test_columns_at_their_edges(platform, name):
    """Zero columns, n near the float32 limit whose transform overflows (Inf, and Inf - Inf
    = NaN, in a block of finite rows), tiny n, and 112 columns (a last 16 past the AVX2
    lanes' 96; MXFP4 128)."""
    hidden = 128 if name == "mxfp4" else 112
    rng = np.random.default_rng(51)
    x = rng.standard_normal((64, hidden)) * 10.0 ** rng.uniform(-3, 3, (64, 1))
    x[:, [0, 9, 101]] = 0
    gamma = rng.standard_normal(hidden) * 10.0 ** rng.uniform(-30, 30, hidden)
    gamma[37] = 3e38
    gamma[40:44] = 2e38
    x, gamma = jnp.asarray(x, jnp.bfloat16), jnp.asarray(gamma, jnp.float32)
    kw = dict(recipe(name), columnwise=True, hadamard=True)
    out = run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **kw)
    ref = reference_on_cpu(reference.rms_norm_fp8, x, gamma, **kw)
    assert_kernel_matches(platform, out, ref)


def test_baseline_cpu_variant_gives_the_twins_bits(tmp_path):
    """The CPU kernel's baseline instruction set (FP8NORM_CPU_ISA=baseline), whose column
    loops are the other compiled copy."""
    script = """
import sys, jax, numpy as np
import jax_fp8norm as fp8norm
from test_columnwise_hadamard import cases
jax.config.update("jax_platforms", "cpu")
outs = {"variant": np.frombuffer(fp8norm.cpu_kernel_variant().encode(), np.uint8)}
for key, (args, kw) in cases().items():
    for i, v in enumerate(fp8norm.rms_norm_fp8(*args, **kw)):
        outs[f"{key}-{i}"] = np.asarray(v).view(np.uint8)
np.savez(sys.argv[1], **outs)
"""
    got = outputs_of_script(script, tmp_path / "baseline.npz", FP8NORM_CPU_ISA="baseline")
    assert bytes(got.pop("variant")).decode() == "baseline"
    for key, (args, kw) in cases().items():
        want = reference_on_cpu(reference.rms_norm_fp8, *args, **kw)
        for i, w in enumerate(want):
            np.testing.assert_array_equal(got[f"{key}-{i}"], np.asarray(w).view(np.uint8), key)


def cases() -> dict:
    """The baseline variant's calls: each recipe, a random mask, widths of a lane tail."""
    out = {}
    for name in FP4_RECIPES:
        for hidden in (96, 160):
            x = rows_with_specials(hidden, (128, hidden), jnp.bfloat16)
            gamma = random_gamma(hidden + 1, hidden, jnp.float32)
            kw = dict(recipe(name), columnwise=True, hadamard=RANDOM_MASKS[block_of(name)])
            out[f"{name}-{hidden}"] = ((x, gamma), kw)
    return out


def skipped_stage(stage: int):
    """hadamard_rows with its stage ``stage`` left out: a planted error."""

    def transform(v, d, mask):
        rows, cols = v.shape
        b = v.reshape(rows // d, d, cols) * signs(d, mask)[None, :, None]
        span = 1
        while span < d:
            if span != 1 << stage:
                b = b.reshape(rows // d, d // (2 * span), 2, span, cols)
                top, bottom = b[:, :, 0], b[:, :, 1]
                b = jnp.stack([top + bottom, top - bottom], axis=2)
            span *= 2
        return b.reshape(rows, cols)

    return transform


def flipped_sign(row: int):
    """hadamard_rows with the sign of row ``row`` of each block flipped: a planted error."""
    return lambda v, d, mask: hadamard_rows(v, d, mask ^ (1 << row))


@pytest.mark.parametrize("name", FP4_RECIPES)
@pytest.mark.parametrize(
    "planted", [skipped_stage(0), skipped_stage(3), flipped_sign(0), flipped_sign(13)]
)
def test_a_planted_error_in_the_transform_gives_other_codes(monkeypatch, name, planted):
    """The bits comparison can fail: the twin with one stage skipped or one sign flipped
    gives codes other than the kernel's, which the twin as it is gives exactly."""
    _, (x, gamma) = op_and_args(False, (128, 64), jnp.bfloat16, seed=7)
    kw = dict(recipe(name), columnwise=True, hadamard=True)
    out = run_on("cpu", fp8norm.rms_norm_fp8, x, gamma, **kw)
    twin = jax.jit(lambda x, g: reference.rms_norm_fp8(x, g, **kw))
    assert_same_bits(out, twin(x, gamma))
    monkeypatch.setattr(reference, "hadamard_rows", planted)
    wrong = jax.jit(lambda x, g: reference.rms_norm_fp8(x, g, **kw))(x, gamma)
    assert np.mean(np.asarray(wrong[-2]).view(np.uint8) != out[-2].view(np.uint8)) > 0.1


def hadamard_matrix(d: int) -> np.ndarray:
    """H_d of Sylvester's construction, float64: H[i, j] = (-1)^popcount(i & j)."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("d, mask", [(16, 0), (16, HADAMARD_SIGNS[16]), (32, RANDOM_MASKS[32])])
def test_the_transform_is_h_times_the_signs(d, mask):
    """hadamard_rows is H_d diag(s) per block of each column: exactly, where float32
    holds every partial sum (small integers), and to float32 rounding elsewhere."""
    rng = np.random.default_rng(d + mask)
    m = hadamard_matrix(d) @ np.diag(signs(d, mask).astype(np.float64))
    transform = jax.jit(lambda v: hadamard_rows(v, d, mask))
    integers = rng.integers(-1000, 1000, (4 * d, 24)).astype(np.float32)
    want = np.einsum("ij,bjc->bic", m, integers.astype(np.float64).reshape(4, d, 24))
    np.testing.assert_array_equal(np.asarray(transform(integers)), want.reshape(4 * d, 24))
    floats = (rng.standard_normal((4 * d, 24)) * 10.0 ** rng.uniform(-3, 3, (1, 24))).astype(
        np.float32
    )
    want = np.einsum("ij,bjc->bic", m, floats.astype(np.float64).reshape(4, d, 24))
    # Each of the log2(d) stages rounds once, a partial sum at most the block's sum of |v|.
    bound = np.log2(d) * 2.0**-24 * np.abs(floats).reshape(4, d, 24).sum(axis=1, keepdims=True)
    error = np.abs(np.asarray(transform(floats), np.float64).reshape(4, d, 24) - want)
    assert np.all(error <= bound) and np.any(error > 0)


@pytest.mark.parametrize("d", [16, 32])
def test_the_wgrad_gemm_of_transformed_operands_is_d_times_the_plain_one(d):
    """(M X)^T (M G) / d = X^T G, M = H_d S block-diagonal over the rows: to float32
    rounding, each side in float32 against the float64 product."""
    rng = np.random.default_rng(d)
    x = rng.standard_normal((8 * d, 48)).astype(np.float32)
    g = rng.standard_normal((8 * d, 40)).astype(np.float32)
    mask = HADAMARD_SIGNS[d]
    f = jax.jit(
        lambda x, g: (
            jnp.matmul(
                hadamard_rows(x, d, mask).T,
                hadamard_rows(g, d, mask),
                precision=jax.lax.Precision.HIGHEST,
            )
            / d
        )
    )
    want = x.astype(np.float64).T @ g.astype(np.float64)
    scale = np.abs(x).T.astype(np.float64) @ np.abs(g).astype(np.float64)
    got = np.asarray(f(x, g), np.float64)
    assert np.all(np.abs(got - want) <= 8 * d * 2.0**-24 * scale)
    assert not np.array_equal(np.asarray(hadamard_rows(x, d, mask)), x)


@pytest.mark.parametrize(
    "kw, error, words",
    [
        (dict(recipe="mxfp4", rows=48), ValueError, "must be a multiple of it"),
        (dict(recipe="mxfp8"), ValueError, "hadamard needs an FP4 recipe"),
        (dict(recipe="fp8_static"), ValueError, "hadamard needs an FP4 recipe"),
        (dict(**FP4_64), ValueError, "hadamard needs an FP4 recipe"),
        (dict(recipe="nvfp4", columnwise=False), ValueError, "it needs columnwise=True"),
        (dict(recipe="nvfp4", hadamard=1 << 16), ValueError, "hadamard's sign mask"),
        (dict(recipe="mxfp4", hadamard=1 << 32), ValueError, "hadamard's sign mask"),
        (dict(recipe="mxfp4", hadamard=-1), ValueError, "hadamard's sign mask"),
        (dict(recipe="mxfp4", hadamard=1.0), TypeError, "hadamard must be None, a bool"),
        (dict(recipe="mxfp4", hadamard="yes"), TypeError, "hadamard must be None, a bool"),
        (dict(recipe="mxfp4", hadamard=np.uint32(3)), None, None),
        (dict(recipe="nvfp4", hadamard=False, columnwise=False), None, None),
    ],
)
def test_bad_hadamard_is_refused(kw, error, words):
    kw = dict(kw)
    rows = kw.pop("rows", 64)
    kw.setdefault("columnwise", True)
    kw.setdefault("hadamard", True)
    if "recipe" in kw:
        kw.update({k: v for k, v in recipe(kw["recipe"]).items() if k not in kw})
    x = jnp.ones((rows, 128), jnp.bfloat16)
    gamma = jnp.ones(128, jnp.float32)
    calls = [
        lambda: fp8norm.rms_norm_fp8(x, gamma, **kw),
        lambda: reference.rms_norm_fp8(x, gamma, **kw),
        lambda: _training.rms_norm_fp8_training(x, gamma, **kw),
        lambda: _training.rms_norm_fp8_vjp(x, gamma, **kw),
        lambda: fp8norm.add_rms_norm_fp8(x, x, gamma, **kw),
        lambda: reference.add_rms_norm_fp8_training(x, x, gamma, **kw),
    ]
    for call in calls:
        if error is None:
            call()
            continue
        with pytest.raises(error, match=words):
            call()


def test_the_fixed_signs_are_the_modules():
    """True takes the block's fixed signs: the same bits as their mask given as an int."""
    _, (x, gamma) = op_and_args(False, (128, 32), jnp.bfloat16, seed=9)
    for name in FP4_RECIPES:
        kw = dict(recipe(name), columnwise=True)
        fixed = fp8norm.rms_norm_fp8(x, gamma, hadamard=True, **kw)
        mask = _fp4_parts.HADAMARD_SIGNS[block_of(name)]
        assert_same_bits(fixed, fp8norm.rms_norm_fp8(x, gamma, hadamard=mask, **kw))


def handler_outs(y=jnp.float4_e2m1fn, scales=jnp.float8_e8m0fnu, rows=32, group=16):
    """The columnwise form's results for x of rows x 32 in blocks of ``group``."""
    return (
        sds((rows, 32), y),
        sds((rows, 32 // group), scales),
        sds((rows, 1), jnp.float32),
        sds((32, rows), y),
        sds((32, rows // group), scales),
    )


@pytest.mark.parametrize(
    "outs, kw, match",
    [
        (handler_outs(), dict(hadamard_mask=0xFFFF), None),
        (handler_outs(), dict(hadamard_mask=1 << 16), "hadamard_mask must be -1 .* or a mask"),
        (handler_outs(), dict(hadamard_mask=-2), "hadamard_mask must be -1 .* or a mask"),
        (handler_outs(rows=64, group=32), dict(group_size=32, hadamard_mask=1 << 31), None),
        (handler_outs(rows=64, group=32), dict(group_size=32, hadamard_mask=1 << 32), "a mask"),
        (handler_outs(group=8), dict(group_size=8), "in blocks of 16 or 32 rows"),
        (handler_outs(y=jnp.float8_e4m3fn), {}, "hadamard_mask needs float4_e2m1fn"),
        (handler_outs()[:3], dict(columnwise=False), "it needs columnwise"),
    ],
    ids=["16 bits", "17 bits", "negative", "32 bits", "33 bits", "block 8", "fp8", "rowwise"],
)
@pytest.mark.parametrize("handler", ["cpu", "simt"])
def test_handlers_refuse_a_transform_they_cannot_make(handler, outs, kw, match):
    """A call that bypasses the Python checks: the handlers check hadamard_mask against
    the form, the format, the block and the mask's width."""
    target = handler_target(handler, "rms_norm_fp8")
    x = jnp.asarray(random_rows(3, (outs[0].shape[0], 32), jnp.bfloat16))
    gamma = jnp.ones(32, jnp.float32)
    base = dict(group_size=16, power_of_two_scales=True, with_inverse_rms=True, columnwise=True)
    kw = {**base, "hadamard_mask": 0, **kw}
    with jax.default_device(jax.devices("cpu")[0]):
        if match is None:
            got = ffi_call(target, outs, x, gamma, **kw)
            assert len(got) == len(outs)
            return
        with pytest.raises(Exception, match=match) as info:
            jax.block_until_ready(ffi_call(target, outs, x, gamma, **kw))
    assert "jax_fp8norm" in str(info.value)


def test_vmap_transforms_each_elements_own_blocks():
    x = random_rows(11, (2, 64, 96), jnp.bfloat16)
    gamma = random_gamma(12, 96, jnp.float32)
    fn = lambda x: fp8norm.rms_norm_fp8(x, gamma, recipe="mxfp4", columnwise=True, hadamard=True)  # noqa: E731
    batched = jax.jit(jax.vmap(fn))(x)
    for i in range(2):
        assert_same_bits([b[i] for b in batched], jax.jit(fn)(x[i]))
