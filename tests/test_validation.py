"""Bad input (docs/spec.md): a TypeError or ValueError naming the argument, raised at trace
time by the public ops and the reference alike; the C++ handlers refuse what slips past."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
    BAD_ARRAYS,
    BAD_KEYWORDS,
    GAMMA,
    GOOD_OUTS,
    HANDLER_CASES,
    X,
    ffi_call,
    handler_target,
    sds,
)
from helpers import SIMT_PLATFORMS, random_rows

import jax_fp8norm as fp8norm
from jax_fp8norm.testing import assert_same_bits


def _rms(impl, x=X, gamma=GAMMA, **kw):
    return impl.rms_norm_fp8(x, gamma, **kw)


def _add(impl, x=X, residual=X, gamma=GAMMA, **kw):
    return impl.add_rms_norm_fp8(x, residual, gamma, **kw)


IMPLS = pytest.mark.parametrize("impl", [fp8norm, fp8norm.reference], ids=["ops", "reference"])
OPS = pytest.mark.parametrize("op", [_rms, _add], ids=["rms_norm_fp8", "add_rms_norm_fp8"])


@IMPLS
@OPS
@pytest.mark.parametrize("kw,error,match", BAD_ARRAYS + BAD_KEYWORDS, ids=repr)
def test_bad_input_names_the_argument(impl, op, kw, error, match):
    with pytest.raises(error, match=match):
        op(impl, **kw)


@IMPLS
@pytest.mark.parametrize("name", ["eps", "weight_offset"])
def test_constant_overflowing_the_input_dtype(impl, name):
    x = jnp.ones((4, 16), jnp.float16)
    with pytest.raises(ValueError, match=f"{name}=.* overflows the input dtype float16"):
        impl.rms_norm_fp8(x, GAMMA, **{name: 1e6})


@IMPLS
@pytest.mark.parametrize(
    "residual,error,match",
    [
        (jnp.ones((4, 17), jnp.bfloat16), ValueError, "residual must have the shape"),
        (jnp.ones((16,), jnp.bfloat16), ValueError, "residual must have the shape"),
        (jnp.ones((4, 16), jnp.float32), TypeError, "residual must have the dtype"),
        ("residual", TypeError, "residual must be an array"),
    ],
    ids=repr,
)
def test_bad_residual(impl, residual, error, match):
    with pytest.raises(error, match=match):
        impl.add_rms_norm_fp8(X, residual, GAMMA)


def test_traced_keyword_is_refused_under_jit():
    @jax.jit
    def f(x, gamma, eps):
        return fp8norm.rms_norm_fp8(x, gamma, eps=eps)

    with pytest.raises(TypeError, match=r"eps is static .* got a traced value"):
        f(X, GAMMA, 1e-6)


@pytest.mark.parametrize(
    "eps", [jnp.asarray(1e-5, jnp.float32), np.asarray(1e-5), jnp.bfloat16(1e-5)], ids=repr
)
def test_a_concrete_0d_array_is_a_static_keyword(eps):
    """As penzai keeps its epsilon: the value it holds, rounded as a float would be. Rows
    small enough that eps moves their bits."""
    x = (random_rows(3, (4, 16), jnp.float32) * 3e-3).astype(jnp.bfloat16)
    want = fp8norm.rms_norm_fp8(x, GAMMA, eps=float(eps))
    assert_same_bits(fp8norm.rms_norm_fp8(x, GAMMA, eps=eps), want)
    with pytest.raises(AssertionError):
        assert_same_bits(fp8norm.rms_norm_fp8(x, GAMMA), want)


class _SelfConverting:
    """What a Keras variable or a framework's parameter looks like to the ops: dtype and
    shape attributes, and __jax_array__."""

    def __init__(self, value):
        self.value = jnp.asarray(value)
        self.dtype, self.shape = self.value.dtype.name, self.value.shape

    def __jax_array__(self):
        return self.value


class _Opaque:
    dtype, shape = "float32", (16,)


def test_an_array_that_converts_itself_is_converted():
    want = fp8norm.add_rms_norm_fp8(X, X, GAMMA)
    got = fp8norm.add_rms_norm_fp8(_SelfConverting(X), X, _SelfConverting(GAMMA))
    assert_same_bits(got, want)
    gamma = _SelfConverting(GAMMA)  # held by a jitted function, as a model holds its weights
    got = jax.jit(lambda x: fp8norm.add_rms_norm_fp8(x, x, gamma))(X)
    assert_same_bits(got, want)


def test_an_object_with_dtype_and_shape_but_no_array_is_refused_by_name():
    with pytest.raises(TypeError, match=r"gamma must be an array .*got _Opaque"):
        fp8norm.rms_norm_fp8(X, _Opaque())


def test_valid_keywords_are_accepted():
    y, scales = fp8norm.rms_norm_fp8(
        X,
        GAMMA,
        eps=0,
        weight_offset=1,
        scale_ub=float("inf"),
        out_dtype="float8_e4m3fnuz",
        scale_dtype=np.dtype("float16"),
    )
    assert y.dtype == jnp.float8_e4m3fnuz and scales.dtype == jnp.float16


def test_handler_target_of_every_platform():
    assert handler_target("cpu", "rms_norm_fp8") == "fp8norm_rms_norm_fp8"
    for platform in ("simt", *SIMT_PLATFORMS):
        assert handler_target(platform, "rms_norm_fp8") == "fp8norm_simt_rms_norm_fp8"


@pytest.mark.parametrize("handler", ["cpu", "simt"])
@pytest.mark.parametrize("outs,args,kw,match", HANDLER_CASES)
def test_handler_refuses_inconsistent_buffers(handler, outs, args, kw, match):
    target = handler_target(handler, "rms_norm_fp8")
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(Exception, match=match) as info:
            jax.block_until_ready(ffi_call(target, outs, *args, **kw))
    assert "jax_fp8norm" in str(info.value)


@pytest.mark.parametrize(
    "residual,match",
    [
        (X.astype(jnp.float32), "residual must have the dtype of x"),
        (jnp.ones((4, 8), jnp.bfloat16), "residual must have the shape of x"),
    ],
)
@pytest.mark.parametrize("handler", ["cpu", "simt"])
def test_handler_refuses_mismatched_residual(handler, residual, match):
    outs = GOOD_OUTS + (sds(residual.shape, residual.dtype),)
    target = handler_target(handler, "add_rms_norm_fp8")
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(ffi_call(target, outs, X, residual, GAMMA))


def test_the_keyword_types_cover_the_keyword_table():
    """NormKeywords (the typed ``**keywords``) names exactly NORM_KEYWORDS, in order."""
    from jax_fp8norm._params import NORM_KEYWORDS, AllReduceKeywords, NormKeywords

    assert tuple(NormKeywords.__annotations__) == tuple(NORM_KEYWORDS)
    assert set(AllReduceKeywords.__annotations__) == {
        *NORM_KEYWORDS,
        "reduce_dtype",
        "method",
        "columnwise",
    }


def _columnwise_outs(y=jnp.float8_e4m3fn, scales=jnp.float32, y_t=None, scales_t=None):
    """The columnwise form's results for X (4 x 16) in blocks of 2 rows (group_size=2)."""
    return (
        sds((4, 16), y),
        sds((4, 8), scales),
        sds((4, 1), jnp.float32),
        y_t or sds((16, 4), y),
        scales_t or sds((16, 2), scales),
    )


@pytest.mark.parametrize(
    "outs,kw,match",
    [
        (_columnwise_outs(y_t=sds((16, 4), jnp.float8_e4m3fnuz)), {}, "y_t must have the dtype"),
        (_columnwise_outs(scales_t=sds((16, 2), jnp.bfloat16)), {}, "scales_t must have the dtype"),
        (_columnwise_outs(y_t=sds((4, 16), jnp.float8_e4m3fn)), {}, "y_t must have shape"),
        (_columnwise_outs(scales_t=sds((16, 1), jnp.float32)), {}, "scales_t must have shape"),
        (
            (sds((4, 16), jnp.float8_e4m3fn), sds((4, 2), jnp.float32), sds((4, 1), jnp.float32))
            + (sds((16, 4), jnp.float8_e4m3fn), sds((16, 1), jnp.float32)),
            dict(group_size=8),
            "positive divisor of rows",
        ),
        # The form's attributes and the results: in number, and columnwise needs r.
        (_columnwise_outs()[:3], {}, "columnwise=1: the form has 3 results .*, the call 1"),
        (_columnwise_outs(), dict(columnwise=False), "the form has 1 results .*, the call 3"),
        (
            _columnwise_outs(),
            dict(with_inverse_rms=False),
            "columnwise form needs with_inverse_rms",
        ),
        (_columnwise_outs()[:2], dict(with_inverse_rms=False, columnwise=False), None),
        (
            (*_columnwise_outs()[:2], sds((4, 1), jnp.bfloat16), *_columnwise_outs()[3:]),
            {},
            "inverse_rms must be float32",
        ),
    ],
    ids=[
        "y_t dtype",
        "scales_t dtype",
        "y_t shape",
        "scales_t shape",
        "block",
        "too few",
        "too many",
        "columnwise alone",
        "plain form",
        "r dtype",
    ],
)
@pytest.mark.parametrize("handler", ["cpu", "simt"])
def test_columnwise_handler_refuses_inconsistent_buffers(handler, outs, kw, match):
    # A call that bypasses the Python checks: the handler checks y_t and scales_t against
    # y and scales, whose dtypes the kernels write them in, and the results against the
    # form its attributes name.
    target = handler_target(handler, "rms_norm_fp8")
    columnwise = dict(group_size=2, with_inverse_rms=True, columnwise=True)
    kw = dict(columnwise, **kw)
    with jax.default_device(jax.devices("cpu")[0]):
        good = ffi_call(target, _columnwise_outs(), X, GAMMA, **columnwise)
        assert good[3].shape == (16, 4)
        if match is None:
            assert len(ffi_call(target, outs, X, GAMMA, **kw)) == len(outs)
            return
        assert good[3].shape == (16, 4)
        with pytest.raises(Exception, match=match) as info:
            jax.block_until_ready(ffi_call(target, outs, X, GAMMA, **kw))
    assert "jax_fp8norm" in str(info.value)
