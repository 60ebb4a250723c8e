"""The parameter model of the ops: the keywords every op, twin and module takes (their
defaults, meanings and types), what one checked call carries to the primitives
(NormParams, NormCall) and what it returns (NormOutputs). The checks that make them are
in jax_fp8norm._checks."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_fp8norm._dtypes import E4M3, FP4, OUT_MAX
from jax_fp8norm.recipes import scales_per_row

DEFAULT_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class NormParams:
    """Static parameters of one call, after checking and rounding (hashable)."""

    eps: float  # f32(T(eps))
    weight_offset: float  # f32(T(weight_offset))
    # f32(S(scale_ub)) for nearest-rounded scales, f32(scale_ub) for power-of-two ones;
    # inf when unbounded.
    scale_ub: float
    out_dtype: np.dtype
    scale_dtype: np.dtype
    group_size: int | None = None  # None: one scale per row
    power_of_two_scales: bool = False  # also set for float8_e8m0fnu scales
    has_static_scale: bool = False  # a calibrated scale operand follows gamma
    has_global_scale: bool = False  # NVFP4's global scale operand follows gamma
    # The training form: each row's r (float32 [..., 1]) is returned next, for the backward.
    with_inverse_rms: bool = False
    # The columnwise form (with with_inverse_rms): y_t [N, rows] and scales_t follow r.
    columnwise: bool = False
    # Each row's amax (float32 [..., 1], SPEC step 4 before any clip) beside a static
    # scale, for delayed scaling: after r, before the columnwise outputs.
    with_amax: bool = False
    # NVFP4's global scale per row (global_scale="per_row"): no operand; each row's gs is
    # computed from its own amax and returned after amax (and, columnwise, each column's
    # after scales_t).
    per_row_global_scale: bool = False
    # The columnwise outputs' Hadamard transform (with columnwise, FP4 blocks of 16 or 32
    # rows): its sign mask (jax_fp8norm._fp4_parts.hadamard_rows); None: no transform.
    hadamard_mask: int | None = None

    @property
    def out_max(self) -> float:
        """FP8_MAX, or FP4_MAX = 6."""
        return OUT_MAX[self.out_dtype]

    @property
    def fp4(self) -> bool:
        return self.out_dtype == FP4

    @property
    def nvfp4(self) -> bool:
        return self.fp4 and self.scale_dtype == E4M3

    def groups(self, n: int) -> int:
        """Scales per row of ``n`` elements."""
        return scales_per_row(n, self.group_size)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The keywords every op, reference twin, dequantised twin and the Flax module take, with
# their defaults and what each means: the one place they are defined.
NORM_KEYWORDS: dict[str, tuple[Any, str]] = {
    "recipe": (
        None,
        "a scaling recipe of jax_fp8norm.recipes.RECIPES (``fp8_row``, ``fp8_group128``, "
        "``fp8_group128_ue8m0``, ``fp8_static``, ``mxfp8``, ``nvfp4``, ``mxfp4``) that sets "
        "the layout keywords it implies; an explicit keyword that contradicts it is a "
        "ValueError.",
    ),
    "eps": (DEFAULT_EPS, "added to the mean square; rounded through ``x.dtype``."),
    "weight_offset": (
        0.0,
        "added to gamma (1.0 for Gemma-style weights); rounded through ``x.dtype``.",
    ),
    "scale_ub": (
        None,
        "upper bound on a row's (or group's) absolute maximum before it becomes a scale "
        "(the largest scale is ``scale_ub / FP8_MAX``); None for no bound.",
    ),
    "out_dtype": (
        jnp.float8_e4m3fn,
        "``float8_e4m3fn`` (max 448), ``float8_e4m3fnuz`` (max 240), or ``float4_e2m1fn`` "
        "(FP4, max 6: NVFP4 with ``float8_e4m3fn`` scales, MXFP4 with ``float8_e8m0fnu`` "
        "ones; needs an even group_size).",
    ),
    "scale_dtype": (
        jnp.float32,
        "float32, float16, bfloat16, or ``float8_e8m0fnu`` (MXFP8 / MXFP4: power-of-two "
        "scales stored as their exponent byte), or ``float8_e4m3fn`` (NVFP4 only).",
    ),
    "group_size": (
        None,
        "None for one scale per row, or G dividing N: one scale per G consecutive elements "
        "(128 for DeepSeek-V3-style 1x128 activations, 32 for MXFP8); scales then have shape "
        "``[..., N // G]``.",
    ),
    "power_of_two_scales": (
        False,
        "round each scale up to a power of two (UE8M0-style, for DeepGEMM), at least 2^-126; "
        "implied by a ``float8_e8m0fnu`` scale_dtype.",
    ),
    "static_scale": (
        None,
        "a calibrated per-tensor scale (a float, or a float array of shape () or (1,), "
        "possibly traced) used instead of dynamic scales; scales is it, rounded to scale_dtype, "
        "with shape ``[..., 1]``. Not finite and positive: every y is NaN.",
    ),
    "global_scale": (
        None,
        "NVFP4's global decode scale (a float, or a float32 array of shape () or (1,), "
        "possibly traced; None means 1.0): each group is quantised from ``n / global_scale`` "
        "and dequantises as ``f32(y) * f32(scale) * global_scale``. NVFP4 only. Not finite "
        'and positive: every scale is NaN. ``"per_row"``: each row\'s own global scale, '
        "``max(amax_row / 2688, 2^-126)``, returned as ``global_scales`` (float32 "
        "``[..., 1]``) after ``scales`` (and ``residual_out``); with ``columnwise`` each "
        "column's, ``global_scales_t`` ``[N, 1]``, after ``scales_t``.",
    ),
}


class NormKeywords(TypedDict, total=False):
    """The types of NORM_KEYWORDS, for ``**keywords: Unpack[NormKeywords]`` signatures."""

    recipe: str | None
    eps: float
    weight_offset: float
    scale_ub: float | None
    out_dtype: DTypeLike
    scale_dtype: DTypeLike
    group_size: int | None
    power_of_two_scales: bool
    static_scale: float | jax.Array | None
    global_scale: float | jax.Array | str | None


class AllReduceKeywords(NormKeywords, total=False):
    """The keywords of allreduce_residual_rms_norm_fp8 beyond the norm's (its axis_name
    aside)."""

    reduce_dtype: DTypeLike | None
    method: str
    columnwise: bool


def as_operand(value: Any) -> Any:
    """An array argument as the primitives take it: objects that convert themselves
    (``__jax_array__``: a Keras variable, say) converted."""
    if value is None or isinstance(value, (jax.Array, np.ndarray)):
        return value
    return jnp.asarray(value)


@dataclasses.dataclass(frozen=True)
class NormCall:
    """One checked call: its static parameters and, if any, the operand after gamma as a
    float32 ``(1,)`` array: the calibrated scale, or NVFP4's global scale."""

    params: NormParams
    scale_operand: jax.Array | None = None

    def operands(self, *arrays: jax.Array) -> tuple[jax.Array, ...]:
        """The primitive's operands: ``arrays`` (converted where they convert themselves,
        a Keras variable say), then the scale operand if any."""
        extra = () if self.scale_operand is None else (self.scale_operand,)
        return (*(as_operand(a) for a in arrays), *extra)


def has_scale_operand(params: dict) -> bool:
    """Whether a calibrated scale or NVFP4's global scale follows gamma among a norm
    primitive's operands (``params``: its parameters, NormParams.as_dict())."""
    return bool(params["has_static_scale"] or params["has_global_scale"])


def num_row_operands(num_operands: int, scale_operand: bool) -> int:
    """x (and residual): a norm primitive's operands before gamma (and the scale operand)."""
    return num_operands - 1 - int(scale_operand)


class NormOutputs(NamedTuple):
    """A norm call's results by name, None where its form has none: ``residual_out`` with
    the residual add, ``inverse_rms`` (each row's r) in the training form, ``amax`` (each
    row's abs-max) beside a static scale when asked, ``global_scales`` (each row's NVFP4
    global scale) with ``global_scale="per_row"``, ``y_t`` and ``scales_t`` in the
    columnwise form (docs/spec.md, "Columnwise outputs"), and ``global_scales_t`` (each
    column's) in the columnwise form with ``global_scale="per_row"``."""

    y: jax.Array
    scales: jax.Array
    residual_out: jax.Array | None = None
    inverse_rms: jax.Array | None = None
    amax: jax.Array | None = None
    global_scales: jax.Array | None = None
    y_t: jax.Array | None = None
    scales_t: jax.Array | None = None
    global_scales_t: jax.Array | None = None

    def returned(self, *, training: bool) -> tuple[jax.Array, ...]:
        """What an op returns: its outputs in this order, ``inverse_rms`` only from a
        training form."""
        return tuple(
            value
            for name, value in self._asdict().items()
            if value is not None and (training or name != "inverse_rms")
        )


def result_names(params: dict, add: bool) -> tuple[str, ...]:
    """The names of a norm primitive's results in their order, which is also the order of
    its FFI target's results: the form's fields of NormOutputs."""
    names = ("y", "scales") + (("residual_out",) if add else ())
    names += ("inverse_rms",) if params["with_inverse_rms"] else ()
    names += ("amax",) if params["with_amax"] else ()
    per_row = params.get("per_row_global_scale", False)
    names += ("global_scales",) if per_row else ()
    if params["columnwise"]:
        names += ("y_t", "scales_t") + (("global_scales_t",) if per_row else ())
    return names


def named_outputs(results, params: dict, add: bool) -> NormOutputs:
    """A norm primitive's results as NormOutputs."""
    return NormOutputs(**dict(zip(result_names(params, add), results, strict=True)))


def global_scale_operand(params: NormParams, static: tuple):
    """NVFP4's global scale, the operand after gamma (``static``: the operands after
    gamma), 1.0 when the call gives none; None for every other format and for per-row
    global scales (an output, not an operand)."""
    if not params.nvfp4 or params.per_row_global_scale:
        return None
    return static[0] if params.has_global_scale else jnp.float32(1.0)
