"""Argument checks and constant rounding shared by the kernels' wrappers and the reference.

Everything a caller passes is checked here, at trace time, before anything reaches C++:
a bad argument raises TypeError or ValueError naming it. The constants are rounded the
way docs/spec.md says (``eps`` and ``weight_offset`` through the input dtype,
``scale_ub`` through the scale dtype) once, so the kernels and the reference receive the
same float32 values.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._dtypes import E4M3, E8M0, FLOAT_DTYPES, FP4, OUT_DTYPES, SCALE_DTYPES
from jax_fp8norm._fp4_parts import HADAMARD_SIGNS
from jax_fp8norm._params import NORM_KEYWORDS, NormCall, NormParams
from jax_fp8norm.recipes import apply_recipe, recipe_of

_FLOAT_NAMES = "float32, float16 or bfloat16"
_SCALE_NAMES = "float32, float16, bfloat16, float8_e8m0fnu or float8_e4m3fn"
_OUT_NAMES = "float8_e4m3fn, float8_e4m3fnuz or float4_e2m1fn"


def check_keyword_names(keywords: dict[str, Any]) -> None:
    unknown = sorted(set(keywords) - set(NORM_KEYWORDS))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {unknown}; expected some of {list(NORM_KEYWORDS)}"
        )


def _dtype_of(value: Any, name: str) -> np.dtype:
    """The dtype of an array argument: a jax or NumPy array, or an object that converts
    itself to one (``__jax_array__``: a Keras variable, a Flax or penzai parameter)."""
    array_like = isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "__jax_array__")
    if not array_like or not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise TypeError(
            f"{name} must be an array (jax, NumPy, or one with __jax_array__), got "
            f"{type(value).__name__}"
        )
    return np.dtype(value.dtype)


def _as_dtype(value: Any, name: str, allowed: tuple[np.dtype, ...], names: str) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be one of {names}, got {value!r}") from None
    if dtype not in allowed:
        raise TypeError(f"{name} must be one of {names}, got {dtype}")
    return dtype


def _as_real(value: Any, name: str) -> float:
    """A static real: a Python number, or a concrete 0-d array of a real dtype (as penzai
    and Keras keep theirs). A traced value cannot be compiled into the kernel call."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is static (compiled into the kernel call), so it must be a Python "
            "float or a concrete 0-d array, got a traced value: pass it from outside the "
            "jitted function (a closure, or jax.jit's static_argnames)"
        )
    if isinstance(value, (jax.Array, np.ndarray, np.generic)) and np.shape(value) == ():
        dtype = np.dtype(value.dtype)
        if dtype != np.bool_ and (jnp.issubdtype(dtype, jnp.floating) or dtype.kind in "iu"):
            return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a Python float or a concrete 0-d real array, got "
            f"{type(value).__name__}"
            + (f" of shape {tuple(np.shape(value))}" if hasattr(value, "shape") else "")
        )
    return float(value)


def _round_through(value: float, dtype: np.dtype) -> float:
    with np.errstate(over="ignore"):  # overflow to inf is reported by the caller
        return float(np.asarray(value, np.float64).astype(dtype).astype(np.float32))


def check_arrays(x: Any, gamma: Any, residual: Any = None) -> None:
    """Checks the array arguments' dtypes and shapes as the kernels take them (x, gamma
    ``[N]`` and, if given, residual)."""
    check_rows(x, residual)
    check_gamma_dtype(gamma)
    if tuple(gamma.shape) != (x.shape[-1],):
        raise ValueError(
            f"gamma must have shape (x.shape[-1],) = ({x.shape[-1]},), got {tuple(gamma.shape)}"
        )


def check_gamma_dtype(gamma: Any) -> np.dtype:
    gamma_dtype = _dtype_of(gamma, "gamma")
    if gamma_dtype not in FLOAT_DTYPES:
        raise TypeError(f"gamma must be {_FLOAT_NAMES}, got {gamma_dtype}")
    return gamma_dtype


def check_float_dtype(value: Any, name: str) -> np.dtype:
    """A dtype argument that must be float32, float16 or bfloat16."""
    return _as_dtype(value, name, FLOAT_DTYPES, _FLOAT_NAMES)


def check_rows(x: Any, residual: Any = None) -> None:
    """Checks x's and, if given, the residual's dtype and shape."""
    x_dtype = _dtype_of(x, "x")
    if x_dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be {_FLOAT_NAMES}, got {x_dtype}")
    if len(x.shape) < 1:
        raise ValueError("x must have rank >= 1 (rows of hidden values), got a scalar")
    if residual is not None:
        residual_dtype = _dtype_of(residual, "residual")
        if residual_dtype != x_dtype:
            raise TypeError(f"residual must have the dtype of x ({x_dtype}), got {residual_dtype}")
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(
                f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )


def make_params(
    x_dtype: Any,
    *,
    eps: Any,
    weight_offset: Any,
    scale_ub: Any,
    out_dtype: Any,
    scale_dtype: Any,
    group_size: Any = None,
    power_of_two_scales: Any = False,
    has_static_scale: bool = False,
    has_global_scale: bool = False,
    per_row_global_scale: bool = False,
    hidden: int | None = None,
) -> NormParams:
    """Checks the static arguments and rounds the constants as the spec says.
    ``has_static_scale`` / ``has_global_scale`` say whether a calibrated scale / a global
    scale was given, ``per_row_global_scale`` whether it is ``"per_row"``; ``hidden`` (N)
    is what ``group_size`` must divide."""
    x_dtype = np.dtype(x_dtype)
    out = _as_dtype(out_dtype, "out_dtype", OUT_DTYPES, _OUT_NAMES)
    scale = _as_dtype(scale_dtype, "scale_dtype", SCALE_DTYPES, _SCALE_NAMES)
    if not isinstance(power_of_two_scales, (bool, np.bool_)):
        raise TypeError(
            f"power_of_two_scales must be a bool, got {type(power_of_two_scales).__name__}"
        )
    power_of_two = bool(power_of_two_scales) or scale == E8M0
    if power_of_two and scale == np.dtype(jnp.float16):
        raise ValueError(
            "power_of_two_scales needs a float32, bfloat16 or float8_e8m0fnu scale_dtype: "
            "float16 cannot hold the smallest power-of-two scale (2^-126)"
        )
    group = _check_group_size(group_size, hidden)
    _check_fp4(out, scale, group, scale_ub, power_of_two_scales, has_static_scale)
    nvfp4 = out == FP4 and scale == E4M3
    if (has_global_scale or per_row_global_scale) and not nvfp4:
        given = "global_scale='per_row'" if per_row_global_scale else "global_scale"
        raise ValueError(
            f"{given} is NVFP4's (out_dtype=float4_e2m1fn, scale_dtype=float8_e4m3fn); "
            f"got out_dtype={out}, scale_dtype={scale}"
        )
    if has_static_scale:
        conflicts = [
            name
            for name, given in (
                ("group_size", group is not None),
                ("scale_ub", scale_ub is not None),
                ("power_of_two_scales", bool(power_of_two_scales)),
                ("scale_dtype=float8_e8m0fnu", scale == E8M0),
            )
            if given
        ]
        if conflicts:
            raise ValueError(
                f"static_scale is a calibrated per-tensor scale: it excludes {', '.join(conflicts)}"
            )

    eps_value = _as_real(eps, "eps")
    if not math.isfinite(eps_value) or eps_value < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps_value}")
    offset_value = _as_real(weight_offset, "weight_offset")
    if not math.isfinite(offset_value):
        raise ValueError(f"weight_offset must be finite, got {offset_value}")

    if scale_ub is None:
        ub = math.inf
    else:
        ub_value = _as_real(scale_ub, "scale_ub")
        if math.isnan(ub_value) or ub_value <= 0:
            raise ValueError(f"scale_ub must be > 0 (or None for no bound), got {ub_value}")
        ub = _round_through(ub_value, np.dtype(np.float32) if power_of_two else scale)
        if ub == 0:
            raise ValueError(f"scale_ub={ub_value} rounds to zero in scale_dtype {scale}")

    eps_rounded = _round_through(eps_value, x_dtype)
    if not math.isfinite(eps_rounded):
        raise ValueError(f"eps={eps_value} overflows the input dtype {x_dtype}")
    offset_rounded = _round_through(offset_value, x_dtype)
    if not math.isfinite(offset_rounded):
        raise ValueError(f"weight_offset={offset_value} overflows the input dtype {x_dtype}")

    return NormParams(
        eps=eps_rounded,
        weight_offset=offset_rounded,
        scale_ub=ub,
        out_dtype=out,
        scale_dtype=scale,
        group_size=group,
        power_of_two_scales=power_of_two,
        has_static_scale=bool(has_static_scale),
        has_global_scale=nvfp4 and not per_row_global_scale,
        per_row_global_scale=bool(per_row_global_scale),
    )


def _check_fp4(out, scale, group, scale_ub, power_of_two_scales, has_static_scale) -> None:
    """The rules of FP4 outputs (docs/spec.md, "FP4 outputs"), and of NVFP4's scale dtype."""
    if out != FP4:
        if scale == E4M3:
            raise ValueError(
                "scale_dtype float8_e4m3fn is NVFP4's block scale: it needs "
                f"out_dtype=float4_e2m1fn, got out_dtype={out}"
            )
        return
    if scale not in (E4M3, E8M0):
        raise ValueError(
            "out_dtype float4_e2m1fn needs scale_dtype float8_e4m3fn (NVFP4) or "
            f"float8_e8m0fnu (MXFP4), got scale_dtype={scale}"
        )
    if group is None or group % 2 != 0:
        raise ValueError(
            "out_dtype float4_e2m1fn is always block-scaled: group_size must be an even int "
            f"(16 for NVFP4, 32 for MXFP4), got group_size={group}"
        )
    if has_static_scale:
        raise ValueError("static_scale is an FP8 option: out_dtype float4_e2m1fn excludes it")
    if bool(power_of_two_scales):
        raise ValueError(
            "power_of_two_scales does not apply to out_dtype float4_e2m1fn: MXFP4's "
            "float8_e8m0fnu scales are powers of two already"
        )
    if scale == E4M3 and scale_ub is not None:
        raise ValueError(
            "scale_ub does not apply to NVFP4 (scale_dtype float8_e4m3fn): its scales are "
            "bounded by the format (448); use global_scale"
        )


def _check_group_size(group_size: Any, hidden: int | None) -> int | None:
    if group_size is None:
        return None
    if isinstance(group_size, (bool, np.bool_)) or not isinstance(group_size, numbers.Integral):
        raise TypeError(
            f"group_size must be None or a positive Python int, got {type(group_size).__name__}"
        )
    group = int(group_size)
    if group <= 0:
        raise ValueError(f"group_size must be positive, got {group}")
    if hidden is not None and hidden % group != 0:
        raise ValueError(
            f"group_size={group} must divide N = {hidden}, the size of the normalised axes"
        )
    return group


def check_scale_operand(value: Any, name: str, float32_only: bool) -> jax.Array | None:
    """A per-tensor scale as a float32 ``(1,)`` array: from a Python float, or an array
    (concrete or traced) of shape () or (1,), of a float dtype (float32 only when
    ``float32_only``)."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return jnp.full((1,), float(value), jnp.float32)
    kind = "a float32 array" if float32_only else "a float array"
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise TypeError(f"{name} must be a float or {kind}, got {type(value).__name__}")
    dtype = np.dtype(value.dtype)
    if float32_only and dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {dtype}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must have a float dtype, got {dtype}")
    if tuple(value.shape) not in ((), (1,)):
        raise ValueError(f"{name} must have shape () or (1,), got {tuple(value.shape)}")
    return jnp.reshape(jnp.asarray(value).astype(jnp.float32), (1,))


def check_float32_scalar(value: Any, name: str) -> jax.Array:
    """A float32 scale (a Python float, or a float32 array of shape () or (1,), possibly
    traced) as a float32 array of shape (): a global scale's check."""
    return jnp.reshape(check_scale_operand(value, name, float32_only=True), ())


def check_static_scale(static_scale: Any) -> jax.Array | None:
    """The calibrated scale as a float32 ``(1,)`` array: from a Python float, or a float
    array (concrete or traced) of shape () or (1,)."""
    return check_scale_operand(static_scale, "static_scale", float32_only=False)


# global_scale's one string value: each row's own NVFP4 global scale, computed by the op.
PER_ROW = "per_row"


def check_global_scale(global_scale: Any) -> jax.Array | str | None:
    """NVFP4's global scale as a float32 ``(1,)`` array: from a Python float, or a float32
    array (concrete or traced) of shape () or (1,); or the string ``"per_row"`` as it is."""
    if isinstance(global_scale, str):
        if global_scale != PER_ROW:
            raise TypeError(
                f"global_scale must be a float, a float32 array or {PER_ROW!r}, got "
                f"{global_scale!r}"
            )
        return PER_ROW
    return check_scale_operand(global_scale, "global_scale", float32_only=True)


def validate(x: Any, gamma: Any, residual: Any = None, **keywords: Any) -> NormCall:
    """Every public op's first step: checks the arrays and the keywords (defaults from
    NORM_KEYWORDS) after the recipe's, rounds the constants."""
    check_keyword_names(keywords)
    keywords = apply_recipe(keywords)
    given = {name: default for name, (default, _) in NORM_KEYWORDS.items()} | keywords
    given.pop("recipe")
    check_arrays(x, gamma, residual)
    static_scale = check_static_scale(given.pop("static_scale"))
    global_scale = check_global_scale(given.pop("global_scale"))
    per_row = isinstance(global_scale, str)
    params = make_params(
        x.dtype,
        **given,
        has_static_scale=static_scale is not None,
        has_global_scale=global_scale is not None and not per_row,
        per_row_global_scale=per_row,
        hidden=int(x.shape[-1]),
    )
    if params.has_global_scale:
        # NVFP4 always carries its global scale: 1.0 unless given.
        global_scale = jnp.ones((1,), jnp.float32) if global_scale is None else global_scale
        return NormCall(params, global_scale)
    return NormCall(params, static_scale)


def check_columnwise(columnwise: Any, params: NormParams, x_shape: tuple) -> bool:
    """Checks ``columnwise`` (a bool) and, when set, that the call has a columnwise form:
    block scales whose block divides the rows, or a calibrated scale."""
    if not isinstance(columnwise, (bool, np.bool_)):
        raise TypeError(f"columnwise must be a bool, got {columnwise!r}")
    if not columnwise:
        return False
    recipe = recipe_of(params)
    if recipe.static:
        return True
    if not recipe.columnwise:
        raise ValueError(
            "columnwise=True needs block scales (group_size, or a recipe such as mxfp8, "
            "nvfp4, mxfp4, fp8_group128) or a static_scale: a dynamic per-row scale has no "
            "columnwise form (a column's scale would need every row first)"
        )
    rows = int(np.prod(x_shape[:-1], dtype=np.int64))
    if rows % recipe.block != 0:
        raise ValueError(
            f"columnwise=True quantises blocks of group_size={recipe.block} rows: the "
            f"number of rows, prod(x.shape[:-1]) = {rows}, must be a multiple of it (pad the "
            "rows)"
        )
    return True


def check_hadamard(hadamard: Any, params: NormParams, columnwise: bool) -> int | None:
    """Checks ``hadamard``: None or False for no transform; True for the fixed signs of the
    block (HADAMARD_SIGNS); an int, a sign mask of the block's rows (0: every sign +1).
    Only the columnwise outputs of an FP4 call take it, in blocks of d = 16 or 32 rows (the
    transform's d). Returns the sign mask, or None."""
    if hadamard is None or (isinstance(hadamard, (bool, np.bool_)) and not hadamard):
        return None
    if not isinstance(hadamard, (bool, np.bool_, numbers.Integral)):
        raise TypeError(
            f"hadamard must be None, a bool or an int sign mask, got {type(hadamard).__name__} "
            f"{hadamard!r}"
        )
    if not columnwise:
        raise ValueError(
            "hadamard transforms the columnwise outputs (the weight-gradient GEMM's operand): "
            "it needs columnwise=True"
        )
    block = params.group_size
    if not params.fp4 or block not in HADAMARD_SIGNS:
        raise ValueError(
            "hadamard needs an FP4 recipe's columnwise blocks of 16 rows (nvfp4) or 32 "
            f"(mxfp4), got {recipe_of(params).name}"
        )
    if isinstance(hadamard, (bool, np.bool_)):
        return HADAMARD_SIGNS[block]
    mask = int(hadamard)
    if mask < 0 or mask >> block:
        raise ValueError(
            f"hadamard's sign mask has a bit per row of a block of {block} rows "
            f"(0 <= mask < 2**{block}), got {mask:#x}"
        )
    return mask


def check_return_amax(return_amax: Any, params: NormParams) -> bool:
    """Checks ``return_amax`` (a bool): each row's amax is returned only beside a static
    scale, where nothing else gives it (a dynamic scale is computed from it)."""
    if not isinstance(return_amax, (bool, np.bool_)):
        raise TypeError(f"return_amax must be a bool, got {return_amax!r}")
    if return_amax and not params.has_static_scale:
        raise ValueError(
            "return_amax=True returns each row's amax beside a static_scale (for delayed "
            "scaling): give a static_scale (recipe fp8_static); without one, each row's "
            "scale is computed from its amax"
        )
    return bool(return_amax)


def check_backward(
    dn: Any,
    x: Any,
    gamma: Any,
    inverse_rms: Any,
    residual: Any = None,
    d_residual_out: Any = None,
    weight_offset: Any = 0.0,
) -> float:
    """Checks the backward's arguments; returns f32(T(weight_offset)), T being x's dtype."""
    check_arrays(x, gamma, residual)
    dn_dtype = _dtype_of(dn, "dn")
    if dn_dtype not in FLOAT_DTYPES:
        raise TypeError(f"dn must be {_FLOAT_NAMES}, got {dn_dtype}")
    if tuple(dn.shape) != tuple(x.shape):
        raise ValueError(f"dn must have the shape of x {tuple(x.shape)}, got {tuple(dn.shape)}")
    if d_residual_out is not None:
        dtype = _dtype_of(d_residual_out, "d_residual_out")
        if dtype != residual.dtype:
            raise TypeError(
                f"d_residual_out must have the dtype of residual ({residual.dtype}), got {dtype}"
            )
        if tuple(d_residual_out.shape) != tuple(x.shape):
            raise ValueError(
                f"d_residual_out must have the shape of x {tuple(x.shape)}, got "
                f"{tuple(d_residual_out.shape)}"
            )
    if _dtype_of(inverse_rms, "inverse_rms") != np.dtype(np.float32):
        raise TypeError(f"inverse_rms must be float32, got {inverse_rms.dtype}")
    rows_shape = tuple(x.shape[:-1]) + (1,)
    if tuple(inverse_rms.shape) != rows_shape:
        raise ValueError(
            f"inverse_rms must have shape x.shape[:-1] + (1,) = {rows_shape} (the training "
            f"form's), got {tuple(inverse_rms.shape)}"
        )
    wo = _round_through(_as_real(weight_offset, "weight_offset"), np.dtype(x.dtype))
    if not np.isfinite(wo):
        raise ValueError(
            f"weight_offset must be finite in {np.dtype(x.dtype)}, got {weight_offset}"
        )
    return wo


def check_reduce_dtype(reduce_dtype: Any, x_dtype: Any) -> np.dtype:
    """The all-reduce's dtype: the input's (None) or float32."""
    if reduce_dtype is None:
        return np.dtype(x_dtype)
    try:
        dtype = np.dtype(reduce_dtype)
    except TypeError:
        raise TypeError(f"reduce_dtype must be None or float32, got {reduce_dtype!r}") from None
    if dtype not in (np.dtype(x_dtype), np.dtype(jnp.float32)):
        raise TypeError(f"reduce_dtype must be None, x.dtype or float32, got {dtype}")
    return dtype


def check_axis_name(axis_name: Any) -> tuple[Any, ...]:
    """Checks that every named axis is bound here (inside shard_map over a mesh that has it);
    returns the names as a tuple."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError("axis_name must name at least one mesh axis")
    for name in names:
        try:
            hash(name)
        except TypeError:
            raise TypeError(f"axis_name must be a mesh axis name, got {name!r}") from None
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise ValueError(
                f"axis_name {name!r} is not bound here: call allreduce_residual_rms_norm_fp8 "
                "inside jax.shard_map over a mesh with that axis (or use "
                "sharded_allreduce_residual_rms_norm_fp8 with the mesh)"
            ) from None
    return names
