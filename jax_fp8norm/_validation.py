"""Argument checks and constant rounding shared by the kernels' wrappers and the reference.

Everything a caller passes is checked here, at trace time, before anything reaches C++:
a bad argument raises TypeError or ValueError naming it. The constants are rounded the
way docs/spec.md says (``eps`` and ``weight_offset`` through the input dtype,
``scale_ub`` through the scale dtype) once, so the kernels and the reference receive the
same float32 values.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
FP8_MAX = {np.dtype(jnp.float8_e4m3fn): 448.0, np.dtype(jnp.float8_e4m3fnuz): 240.0}
OUT_DTYPES = tuple(FP8_MAX)
SCALE_DTYPES = FLOAT_DTYPES

_FLOAT_NAMES = "float32, float16 or bfloat16"
_FP8_NAMES = "float8_e4m3fn or float8_e4m3fnuz"


@dataclasses.dataclass(frozen=True)
class NormParams:
    """Static parameters of one call, after checking and rounding (hashable)."""

    eps: float  # f32(T(eps))
    weight_offset: float  # f32(T(weight_offset))
    scale_ub: float  # f32(S(scale_ub)), inf when unbounded
    out_dtype: np.dtype
    scale_dtype: np.dtype

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.out_dtype]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _dtype_of(value: Any, name: str) -> np.dtype:
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}")
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
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a Python float (a static value, not an array or tracer), "
            f"got {type(value).__name__}"
        )
    return float(value)


def _round_through(value: float, dtype: np.dtype) -> float:
    with np.errstate(over="ignore"):  # overflow to inf is reported by the caller
        return float(np.asarray(value, np.float64).astype(dtype).astype(np.float32))


def check_arrays(x: Any, gamma: Any, residual: Any = None) -> None:
    """Checks the array arguments' dtypes and shapes (x, gamma and, if given, residual)."""
    x_dtype = _dtype_of(x, "x")
    if x_dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be {_FLOAT_NAMES}, got {x_dtype}")
    if len(x.shape) < 1:
        raise ValueError("x must have rank >= 1 (rows of hidden values), got a scalar")
    gamma_dtype = _dtype_of(gamma, "gamma")
    if gamma_dtype not in FLOAT_DTYPES:
        raise TypeError(f"gamma must be {_FLOAT_NAMES}, got {gamma_dtype}")
    if tuple(gamma.shape) != (x.shape[-1],):
        raise ValueError(
            f"gamma must have shape (x.shape[-1],) = ({x.shape[-1]},), got {tuple(gamma.shape)}"
        )
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
) -> NormParams:
    """Checks the static arguments and rounds the constants as the spec says."""
    x_dtype = np.dtype(x_dtype)
    out = _as_dtype(out_dtype, "out_dtype", OUT_DTYPES, _FP8_NAMES)
    scale = _as_dtype(scale_dtype, "scale_dtype", SCALE_DTYPES, _FLOAT_NAMES)

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
        ub = _round_through(ub_value, scale)
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
    )


def validate(x: Any, gamma: Any, residual: Any = None, **static: Any) -> NormParams:
    """check_arrays and make_params together: every public op's first step."""
    check_arrays(x, gamma, residual)
    return make_params(x.dtype, **static)


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
