"""The tests' case tables that more than one module reads: bad input and what the
checks must say (tests/test_validation.py, tests/children/bad_input.py), the handler
refusals of calls that bypass the checks, and an example and a bad value of every keyword
of the keyword table (tests/test_recipes.py's keyword table test)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import is_simt

from jax_fp8norm import _ffi as fp8norm_ffi

X = jnp.ones((4, 16), jnp.bfloat16)
F4 = jnp.float4_e2m1fn
E4M3 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu
NVFP4 = dict(out_dtype=F4, scale_dtype=E4M3, group_size=16)
GAMMA = jnp.ones((16,), jnp.float32)


BAD_ARRAYS = [
    (dict(x=jnp.ones((4, 16), jnp.int32)), TypeError, "x must be"),
    (dict(x=np.ones((4, 16), np.float64)), TypeError, "x must be"),
    (dict(x=jnp.ones((4, 16), jnp.bool_)), TypeError, "x must be"),
    (dict(x=[[1.0] * 16] * 4), TypeError, "x must be an array"),
    (dict(x=jnp.float32(1.0)), ValueError, "x must have rank >= 1"),
    (dict(gamma=jnp.ones((17,), jnp.float32)), ValueError, "gamma must have shape"),
    # (1, 16) and a scalar broadcast to the normalised axis (tests/test_framework_shapes.py)
    (dict(gamma=jnp.ones((16, 1), jnp.float32)), ValueError, "gamma must have shape"),
    (dict(gamma=jnp.ones((2, 16), jnp.float32)), ValueError, "gamma must have shape"),
    (dict(gamma=jnp.ones((4,), jnp.float32)), ValueError, "gamma must have shape"),
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
    (dict(eps=jnp.full((1,), 1e-6, jnp.float32)), TypeError, "eps must be"),
    (dict(eps=np.array(True)), TypeError, "eps must be"),
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


# Recipes (jax_fp8norm.recipes): an unknown name, a missing calibrated scale, a
# contradicting keyword (tests/test_recipes.py has every contradiction of every recipe).
BAD_KEYWORDS += [
    (dict(recipe="mxfp9"), ValueError, "recipe must be None or one of"),
    (dict(recipe=8), ValueError, "recipe must be None or one of"),
    (dict(recipe="fp8_static"), ValueError, "recipe='fp8_static' needs static_scale"),
    (dict(recipe="fp8_row", group_size=4), ValueError, "recipe='fp8_row' sets group_size"),
    (dict(recipe="nvfp4", out_dtype=E4M3), ValueError, "recipe='nvfp4' sets out_dtype"),
    (dict(recipe="mxfp8", static_scale=0.1), ValueError, "recipe='mxfp8' .* static_scale"),
]


def ffi_call(
    target,
    outs,
    *args,
    eps=1e-6,
    weight_offset=0.0,
    scale_ub=np.inf,
    group_size=0,
    power_of_two_scales=False,
    fp4_layout=fp8norm_ffi.FP4_LAYOUT_CODES["packed_low_first"],
    with_inverse_rms=False,
    columnwise=False,
    with_amax=False,
    per_row_global_scale=False,
    hadamard_mask=-1,
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
        with_inverse_rms=with_inverse_rms,
        columnwise=columnwise,
        with_amax=with_amax,
        per_row_global_scale=per_row_global_scale,
        hadamard_mask=np.int64(hadamard_mask),
    )


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


GOOD_OUTS = (sds((4, 16), jnp.float8_e4m3fn), sds((4, 1), jnp.float32))
FP4_OUTS = (sds((4, 16), F4), sds((4, 4), E4M3))
ONE = jnp.ones((1,), jnp.float32)


# Calls that bypass the Python checks: the handler must refuse them with an error.
HANDLER_CASES = [
    (GOOD_OUTS, (X, jnp.ones((8,), jnp.float32)), {}, "gamma must have shape"),
    (GOOD_OUTS, (X.astype(jnp.int32), GAMMA), {}, "x must be"),
    ((sds((4, 16), jnp.float32), GOOD_OUTS[1]), (X, GAMMA), {}, "y must be"),
    ((GOOD_OUTS[0], sds((4, 2), jnp.float32)), (X, GAMMA), {}, "scales must have shape"),
    ((GOOD_OUTS[0], sds((4, 1), jnp.int32)), (X, GAMMA), {}, "scales must be"),
    (GOOD_OUTS, (X, GAMMA), dict(eps=-1.0), "eps must be"),
    (GOOD_OUTS, (X, GAMMA), dict(scale_ub=0.0), "scale_ub must be"),
    (GOOD_OUTS, (X, GAMMA), dict(weight_offset=np.inf), "weight_offset must be"),
    (
        (sds((), jnp.float8_e4m3fn), sds((), jnp.float32)),
        (jnp.float32(1.0), jnp.ones((1,), jnp.float32)),
        {},
        "x must have rank >= 1",
    ),
    (GOOD_OUTS, (X, jnp.float32(1.0)), {}, "gamma must have shape"),
    (GOOD_OUTS, (X, GAMMA), dict(group_size=5), "group_size must be"),
    (GOOD_OUTS, (X, GAMMA), dict(group_size=-1), "group_size must be"),
    (GOOD_OUTS, (X, GAMMA), dict(group_size=4), "scales must have shape"),
    ((GOOD_OUTS[0], sds((4, 1), jnp.float8_e8m0fnu)), (X, GAMMA), {}, "power_of_two_scales"),
    (
        (GOOD_OUTS[0], sds((4, 1), jnp.float16)),
        (X, GAMMA),
        dict(power_of_two_scales=True),
        "power-of-two",
    ),
    (GOOD_OUTS, (X, GAMMA, jnp.ones((2,), jnp.float32)), {}, "static_scale must be"),
    (GOOD_OUTS, (X, GAMMA, jnp.ones((1,), jnp.float16)), {}, "static_scale must be"),
    (
        (GOOD_OUTS[0], sds((4, 4), jnp.float32)),
        (X, GAMMA, jnp.ones((1,), jnp.float32)),
        dict(group_size=4),
        "static_scale excludes",
    ),
    # FP4: the layout, the group size, the scale formats and the global scale operand.
    (FP4_OUTS, (X, GAMMA, ONE), dict(group_size=4, fp4_layout=7), "fp4_layout 7 is not"),
    (FP4_OUTS, (X, GAMMA, ONE), dict(group_size=4, fp4_layout=-1), "fp4_layout -1 is not"),
    ((FP4_OUTS[0], sds((4, 16), E4M3)), (X, GAMMA, ONE), dict(group_size=1), "even group_size"),
    ((FP4_OUTS[0], sds((4, 1), E4M3)), (X, GAMMA, ONE), {}, "even group_size"),
    (FP4_OUTS, (X, GAMMA), dict(group_size=4), "needs its global_scale"),
    ((FP4_OUTS[0], sds((4, 4), jnp.float32)), (X, GAMMA), dict(group_size=4), "float8_e4m3fn"),
    ((GOOD_OUTS[0], sds((4, 4), E4M3)), (X, GAMMA, ONE), dict(group_size=4), "NVFP4's"),
    (
        (FP4_OUTS[0], sds((4, 4), E8M0)),
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


# Every keyword of the keyword table (NORM_KEYWORDS): an example call's keywords, valid
# for rows of 256 elements, and a bad value with the error that names it.
KEYWORD_CASES = {
    "recipe": (dict(recipe="mxfp8"), dict(recipe="mxfp9"), ValueError, "recipe must be"),
    "eps": (dict(eps=1e-2), dict(eps=-1.0), ValueError, "eps must be"),
    "weight_offset": (
        dict(weight_offset=1.0),
        dict(weight_offset=float("nan")),
        ValueError,
        "weight_offset must be",
    ),
    "scale_ub": (dict(scale_ub=0.5), dict(scale_ub=0.0), ValueError, "scale_ub must be"),
    "out_dtype": (
        dict(out_dtype=jnp.float8_e4m3fnuz),
        dict(out_dtype=jnp.int8),
        TypeError,
        "out_dtype must be",
    ),
    "scale_dtype": (
        dict(scale_dtype=jnp.bfloat16),
        dict(scale_dtype=jnp.int32),
        TypeError,
        "scale_dtype must be",
    ),
    "group_size": (dict(group_size=64), dict(group_size=3), ValueError, "group_size=3 must"),
    "power_of_two_scales": (
        dict(power_of_two_scales=True),
        dict(power_of_two_scales="yes"),
        TypeError,
        "power_of_two_scales must be",
    ),
    "static_scale": (
        dict(static_scale=0.02),
        dict(static_scale="0.02"),
        TypeError,
        "static_scale must be",
    ),
    "global_scale": (
        dict(NVFP4, global_scale=0.0021),
        dict(NVFP4, global_scale=jnp.ones((2,), jnp.float32)),
        ValueError,
        "global_scale must have shape",
    ),
}
