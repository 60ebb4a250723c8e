"""Bad input (docs/spec.md): a TypeError or ValueError naming the argument, raised at trace
time by the public ops and the reference alike; the C++ handlers refuse what slips past."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SIMT_PLATFORMS, is_simt

import jax_fp8norm as fp8norm
from jax_fp8norm import _ffi as fp8norm_ffi

X = jnp.ones((4, 16), jnp.bfloat16)
F4 = jnp.float4_e2m1fn
E4M3 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu
NVFP4 = dict(out_dtype=F4, scale_dtype=E4M3, group_size=16)
GAMMA = jnp.ones((16,), jnp.float32)


def _rms(impl, x=X, gamma=GAMMA, **kw):
    return impl.rms_norm_fp8(x, gamma, **kw)


def _add(impl, x=X, residual=X, gamma=GAMMA, **kw):
    return impl.add_rms_norm_fp8(x, residual, gamma, **kw)


IMPLS = pytest.mark.parametrize("impl", [fp8norm, fp8norm.reference], ids=["ops", "reference"])
OPS = pytest.mark.parametrize("op", [_rms, _add], ids=["rms_norm_fp8", "add_rms_norm_fp8"])

BAD_ARRAYS = [
    (dict(x=jnp.ones((4, 16), jnp.int32)), TypeError, "x must be"),
    (dict(x=np.ones((4, 16), np.float64)), TypeError, "x must be"),
    (dict(x=jnp.ones((4, 16), jnp.bool_)), TypeError, "x must be"),
    (dict(x=[[1.0] * 16] * 4), TypeError, "x must be an array"),
    (dict(x=jnp.float32(1.0)), ValueError, "x must have rank >= 1"),
    (dict(gamma=jnp.ones((17,), jnp.float32)), ValueError, "gamma must have shape"),
    (dict(gamma=jnp.ones((1, 16), jnp.float32)), ValueError, "gamma must have shape"),
    (dict(gamma=jnp.float32(1.0)), ValueError, "gamma must have shape"),
    (dict(gamma=jnp.ones((16,), jnp.int8)), TypeError, "gamma must be"),
    (dict(gamma=jnp.ones((16,), jnp.float8_e4m3fn)), TypeError, "gamma must be"),
]

BAD_KEYWORDS = [
    (dict(out_dtype=jnp.float8_e5m2), TypeError, "out_dtype must be"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be"),
    (dict(out_dtype="not a dtype"), TypeError, "out_dtype must be"),
    (dict(scale_dtype=np.float64), TypeError, "scale_dtype must be"),
    (dict(scale_dtype=jnp.float8_e4m3fn), ValueError, "float8_e4m3fn is NVFP4's block scale"),
    (dict(eps=-1e-6), ValueError, "eps must be"),
    (dict(eps=float("nan")), ValueError, "eps must be"),
    (dict(eps=float("inf")), ValueError, "eps must be"),
    (dict(eps="1e-6"), TypeError, "eps must be"),
    (dict(eps=True), TypeError, "eps must be"),
    (dict(eps=jnp.float32(1e-6)), TypeError, "eps must be"),
    (dict(weight_offset=float("nan")), ValueError, "weight_offset must be"),
    (dict(weight_offset=None), TypeError, "weight_offset must be"),
    (dict(scale_ub=0.0), ValueError, "scale_ub must be"),
    (dict(scale_ub=-1.0), ValueError, "scale_ub must be"),
    (dict(scale_ub=float("nan")), ValueError, "scale_ub must be"),
    (dict(scale_ub=1e-50), ValueError, "scale_ub=.* rounds to zero"),
    (dict(scale_ub="big"), TypeError, "scale_ub must be"),
    (dict(scale_dtype=jnp.float8_e5m2), TypeError, "scale_dtype must be"),
    (dict(group_size=0), ValueError, "group_size must be positive"),
    (dict(group_size=-4), ValueError, "group_size must be positive"),
    (dict(group_size=5), ValueError, "group_size=5 must divide N"),
    (dict(group_size=32), ValueError, "group_size=32 must divide N"),
    (dict(group_size=4.0), TypeError, "group_size must be"),
    (dict(group_size=True), TypeError, "group_size must be"),
    (dict(group_size="4"), TypeError, "group_size must be"),
    (dict(group_size=jnp.int32(4)), TypeError, "group_size must be"),
    (dict(power_of_two_scales=1), TypeError, "power_of_two_scales must be a bool"),
    (dict(power_of_two_scales="yes"), TypeError, "power_of_two_scales must be a bool"),
    (
        dict(power_of_two_scales=True, scale_dtype=jnp.float16),
        ValueError,
        "power_of_two_scales needs",
    ),
    (dict(static_scale=jnp.ones((2,), jnp.float32)), ValueError, "static_scale must have shape"),
    (dict(static_scale=jnp.ones((1, 1), jnp.float32)), ValueError, "static_scale must have shape"),
    (dict(static_scale=jnp.int32(1)), TypeError, "static_scale must have a float dtype"),
    (dict(static_scale="0.1"), TypeError, "static_scale must be"),
    (dict(static_scale=True), TypeError, "static_scale must be"),
    (dict(static_scale=0.1, group_size=4), ValueError, "static_scale .* excludes group_size"),
    (dict(static_scale=0.1, scale_ub=1.0), ValueError, "static_scale .* excludes scale_ub"),
    (
        dict(static_scale=0.1, power_of_two_scales=True),
        ValueError,
        "static_scale .* excludes power_of_two_scales",
    ),
    (
        dict(static_scale=0.1, scale_dtype=jnp.float8_e8m0fnu),
        ValueError,
        "static_scale .* excludes scale_dtype=float8_e8m0fnu",
    ),
    (dict(group_sizes=4), TypeError, "unexpected keyword argument.*group_sizes"),
    # FP4 (docs/spec.md, "FP4 outputs").
    (dict(out_dtype=F4), ValueError, "float4_e2m1fn needs scale_dtype"),
    (dict(out_dtype=F4, scale_dtype=E4M3), ValueError, "group_size must be an even int"),
    (dict(out_dtype=F4, scale_dtype=E4M3, group_size=1), ValueError, "group_size must be an even"),
    (dict(out_dtype=F4, scale_dtype=jnp.bfloat16, group_size=16), ValueError, "needs scale_dtype"),
    (
        dict(out_dtype=jnp.float4_e2m1fn, scale_dtype=E4M3, group_size=16, scale_ub=1.0),
        ValueError,
        "scale_ub does not apply to NVFP4",
    ),
    (
        dict(out_dtype=F4, scale_dtype=E8M0, group_size=16, power_of_two_scales=True),
        ValueError,
        "power_of_two_scales does not apply",
    ),
    (
        dict(out_dtype=F4, scale_dtype=E8M0, group_size=16, static_scale=0.1),
        ValueError,
        "static_scale is an FP8 option",
    ),
    (
        dict(out_dtype=F4, scale_dtype=E8M0, group_size=16, global_scale=0.1),
        ValueError,
        "global_scale is NVFP4's",
    ),
    (dict(global_scale=0.1), ValueError, "global_scale is NVFP4's"),
    (
        dict(NVFP4, global_scale=jnp.ones((2,), jnp.float32)),
        ValueError,
        "global_scale must have shape",
    ),
    (
        dict(NVFP4, global_scale=jnp.ones((), jnp.bfloat16)),
        TypeError,
        "global_scale must have dtype float32",
    ),
    (dict(NVFP4, global_scale="1"), TypeError, "global_scale must be a float"),
    (dict(NVFP4, global_scale=True), TypeError, "global_scale must be a float"),
]


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

    with pytest.raises(TypeError, match="eps must be a Python float"):
        f(X, GAMMA, 1e-6)


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


def _ffi(
    target,
    outs,
    *args,
    eps=1e-6,
    weight_offset=0.0,
    scale_ub=np.inf,
    group_size=0,
    power_of_two_scales=False,
    fp4_layout=fp8norm_ffi.FP4_PACKED_LOW_FIRST,
):
    call = jax.ffi.ffi_call(target, outs)
    return call(
        *args,
        eps=np.float32(eps),
        weight_offset=np.float32(weight_offset),
        scale_ub=np.float32(scale_ub),
        group_size=np.int64(group_size),
        power_of_two_scales=power_of_two_scales,
        fp4_layout=np.int64(fp4_layout),
    )


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


GOOD_OUTS = (_sds((4, 16), jnp.float8_e4m3fn), _sds((4, 1), jnp.float32))
FP4_OUTS = (_sds((4, 16), F4), _sds((4, 4), E4M3))
ONE = jnp.ones((1,), jnp.float32)


# Calls that bypass the Python checks: the handler must refuse them with an error.
HANDLER_CASES = [
    (GOOD_OUTS, (X, jnp.ones((8,), jnp.float32)), {}, "gamma must have shape"),
    (GOOD_OUTS, (X.astype(jnp.int32), GAMMA), {}, "x must be"),
    ((_sds((4, 16), jnp.float32), GOOD_OUTS[1]), (X, GAMMA), {}, "y must be"),
    ((GOOD_OUTS[0], _sds((4, 2), jnp.float32)), (X, GAMMA), {}, "scales must have shape"),
    ((GOOD_OUTS[0], _sds((4, 1), jnp.int32)), (X, GAMMA), {}, "scales must be"),
    (GOOD_OUTS, (X, GAMMA), dict(eps=-1.0), "eps must be"),
    (GOOD_OUTS, (X, GAMMA), dict(scale_ub=0.0), "scale_ub must be"),
    (GOOD_OUTS, (X, GAMMA), dict(weight_offset=np.inf), "weight_offset must be"),
    (
        (_sds((), jnp.float8_e4m3fn), _sds((), jnp.float32)),
        (jnp.float32(1.0), jnp.ones((1,), jnp.float32)),
        {},
        "x must have rank >= 1",
    ),
    (GOOD_OUTS, (X, jnp.float32(1.0)), {}, "gamma must have shape"),
    (GOOD_OUTS, (X, GAMMA), dict(group_size=5), "group_size must be"),
    (GOOD_OUTS, (X, GAMMA), dict(group_size=-1), "group_size must be"),
    (GOOD_OUTS, (X, GAMMA), dict(group_size=4), "scales must have shape"),
    ((GOOD_OUTS[0], _sds((4, 1), jnp.float8_e8m0fnu)), (X, GAMMA), {}, "power_of_two_scales"),
    (
        (GOOD_OUTS[0], _sds((4, 1), jnp.float16)),
        (X, GAMMA),
        dict(power_of_two_scales=True),
        "power-of-two",
    ),
    (GOOD_OUTS, (X, GAMMA, jnp.ones((2,), jnp.float32)), {}, "static_scale must be"),
    (GOOD_OUTS, (X, GAMMA, jnp.ones((1,), jnp.float16)), {}, "static_scale must be"),
    (
        (GOOD_OUTS[0], _sds((4, 4), jnp.float32)),
        (X, GAMMA, jnp.ones((1,), jnp.float32)),
        dict(group_size=4),
        "static_scale excludes",
    ),
    # FP4: the layout, the group size, the scale formats and the global scale operand.
    (FP4_OUTS, (X, GAMMA, ONE), dict(group_size=4, fp4_layout=7), "fp4_layout 7 is not"),
    (FP4_OUTS, (X, GAMMA, ONE), dict(group_size=4, fp4_layout=-1), "fp4_layout -1 is not"),
    ((FP4_OUTS[0], _sds((4, 16), E4M3)), (X, GAMMA, ONE), dict(group_size=1), "even group_size"),
    ((FP4_OUTS[0], _sds((4, 1), E4M3)), (X, GAMMA, ONE), {}, "even group_size"),
    (FP4_OUTS, (X, GAMMA), dict(group_size=4), "needs its global_scale"),
    ((FP4_OUTS[0], _sds((4, 4), jnp.float32)), (X, GAMMA), dict(group_size=4), "float8_e4m3fn"),
    ((GOOD_OUTS[0], _sds((4, 4), E4M3)), (X, GAMMA, ONE), dict(group_size=4), "NVFP4's"),
    (
        (FP4_OUTS[0], _sds((4, 4), E8M0)),
        (X, GAMMA, ONE),
        dict(group_size=4, power_of_two_scales=True),
        "MXFP4 takes neither",
    ),
    (FP4_OUTS, (X, GAMMA, ONE), dict(group_size=4, scale_ub=1.0), "neither power_of_two"),
    (FP4_OUTS, (X, GAMMA, jnp.ones((2,), jnp.float32)), dict(group_size=4), "global_scale must"),
]


def handler_target(handler: str, op: str) -> str:
    """The FFI target of the op `op` for `handler` (a platform: "cpu", "simt" or
    "simt-<variant>") on the CPU backend: the CPU kernels' handler, or the CUDA handler
    compiled for the SIMT emulation."""
    return (fp8norm_ffi.EMULATED_TARGETS if is_simt(handler) else fp8norm_ffi.TARGETS)[op]


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
            jax.block_until_ready(_ffi(target, outs, *args, **kw))
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
    outs = GOOD_OUTS + (_sds(residual.shape, residual.dtype),)
    target = handler_target(handler, "add_rms_norm_fp8")
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_ffi(target, outs, X, residual, GAMMA))


def test_the_keyword_types_cover_the_keyword_table():
    """NormKeywords (the typed ``**keywords``) names exactly NORM_KEYWORDS, in order."""
    from jax_fp8norm._params import NORM_KEYWORDS, AllReduceKeywords, NormKeywords

    assert tuple(NormKeywords.__annotations__) == tuple(NORM_KEYWORDS)
    assert set(AllReduceKeywords.__annotations__) == {*NORM_KEYWORDS, "reduce_dtype", "method"}
