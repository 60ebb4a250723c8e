"""The scaling recipes: one name per layout of outputs and scales, the vocabulary of the
ops' ``recipe=`` keyword, the benchmarks, the command line and the tests.

A recipe sets the keywords that define its layout (``out_dtype``, ``group_size``,
``scale_dtype``, ``power_of_two_scales``, and whether the scale is a calibrated
``static_scale``); the others (``eps``, ``weight_offset``, ``scale_ub``, ``global_scale``)
stay the caller's. An explicit keyword that contradicts the recipe is a ValueError::

    y, scales = fp8norm.rms_norm_fp8(x, gamma, recipe="mxfp8")
    # the same as group_size=32, scale_dtype=jnp.float8_e8m0fnu

This module also holds the layouts' arithmetic shared by every op and twin: how many
scales a row has, and how ``(y, scales)`` dequantise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._fp4_parts import HADAMARD_SIGNS

__all__ = [
    "RECIPES",
    "OperandFormat",
    "Recipe",
    "apply_recipe",
    "dequantize",
    "recipe_keywords",
    "recipe_of",
    "scales_per_row",
]

_E4M3FN = np.dtype(jnp.float8_e4m3fn)
_E4M3FNUZ = np.dtype(jnp.float8_e4m3fnuz)
_E8M0 = np.dtype(jnp.float8_e8m0fnu)
_FP4 = np.dtype(jnp.float4_e2m1fn)
_E5M2 = np.dtype(jnp.float8_e5m2)
# The FP8 recipes take either E4M3 type (e4m3fnuz for AMD's MI300); e4m3fn unless given.
_FP8 = (_E4M3FN, _E4M3FNUZ)


class _Required:
    """Marks a keyword the recipe needs the caller to give (the static recipe's scale)."""

    def __repr__(self) -> str:
        return "a value"


_REQUIRED = _Required()

# The scale rules (docs/spec.md, "Scales"): the nearest scale of the abs-max; a power of
# two >= it (at least 2^-127 in e8m0, 2^-126 in a float type); a calibrated scale; NVFP4's
# e4m3 block scale under a float32 global scale.
NEAREST, POWER_OF_TWO, STATIC, NVFP4 = "nearest", "power_of_two", "static", "nvfp4"


@dataclasses.dataclass(frozen=True)
class OperandFormat:
    """How the layer quantises an operand it makes itself (the weight, the output
    gradient): its codes, the block along the contraction axis (None: one scale per row of
    an activation or per column of a weight) and the rule of its scales: NEAREST (float32,
    at least 2^-126), POWER_OF_TWO (e8m0) or NVFP4 (e4m3 blocks; rows get a global scale
    each, a weight one for the whole)."""

    element: np.dtype
    block: int | None
    rule: str


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One layout of codes and scales, with every fact the ops, the layer and the checks
    read from it.

    ``elements``: the code dtypes it takes, the first its default (``element``);
    ``block``: elements per scale along a row (None: one scale per row, or per tensor for
    the static rule), and rows per scale in the columnwise layout; ``scale_dtype``: the
    scales' dtype, None where the caller picks a float type; ``rule``: the scale rule;
    ``gradient_element``: the output gradient's codes in the layer (None: the recipe's
    own).

    The operands the layer quantises itself are OperandFormats (``weight``,
    ``gradient``): how an operand is rounded (nearest or stochastic), transformed
    (a Hadamard transform of the wgrad GEMM's operands) and tiled (a weight's 2-D tiles)
    belongs there, and a per-row global scale to the NVFP4 rule."""

    name: str
    description: str
    elements: tuple[np.dtype, ...]
    block: int | None
    scale_dtype: np.dtype | None
    rule: str
    gradient_element: np.dtype | None = None
    family: str | None = None  # the named recipe a call's layout derives from
    # The sign mask of the layer's Hadamard transform of the wgrad GEMM's operands, in
    # blocks of ``block`` rows (jax_fp8norm._fp4_parts.HADAMARD_SIGNS; 0: every sign +1);
    # None for a recipe without the transform (FP8).
    hadamard_signs: int | None = None

    @property
    def base(self) -> Recipe:
        """The named recipe of this layout's family (itself for a named one)."""
        return RECIPES[self.family or self.name]

    @property
    def element(self) -> np.dtype:
        return self.elements[0]

    @property
    def static(self) -> bool:
        """Whether the recipe's scale is a calibrated ``static_scale`` (data, not computed)."""
        return self.rule == STATIC

    @property
    def fp4(self) -> bool:
        return self.element == _FP4

    @property
    def columnwise(self) -> bool:
        """Whether it has a columnwise form (blocks of ``block`` rows, or the static scale):
        every recipe but one scale per row, whose scales cannot be transposed."""
        return self.block is not None or self.static

    @property
    def weight(self) -> OperandFormat:
        """How the layer quantises its weight along K: FP4 in the recipe's own format; FP8
        with one scale per column beside per-row or static scales, else e8m0 blocks of the
        recipe's."""
        if self.rule == NVFP4:
            return OperandFormat(self.element, self.block, NVFP4)
        if self.block is None:
            return OperandFormat(self.element, None, NEAREST)
        return OperandFormat(self.element, self.block, POWER_OF_TWO)

    @property
    def gradient(self) -> OperandFormat:
        """How the layer quantises the output gradient (blocked along the output features
        for dgrad, along the rows for wgrad): the weight's format with the gradient's
        codes. E5M2 (its range) beside the FP8 recipes' E4M3, as Transformer Engine's
        HYBRID format; MXFP8 keeps E4M3 with its e8m0 blocks, as TE's MXFP8 recipe; the
        FP4 recipes quantise the gradient as everything else."""
        return dataclasses.replace(self.weight, element=self.gradient_element or self.element)

    @property
    def keywords(self) -> dict[str, tuple[Any, ...]]:
        """The keywords the recipe decides, each with the values it accepts, the first the
        one it sets when the caller gives none."""
        keywords: dict[str, tuple[Any, ...]] = {
            "out_dtype": self.elements,
            "group_size": (None if self.static else self.block,),
        }
        if self.scale_dtype is not None:
            keywords["scale_dtype"] = (self.scale_dtype,)
        if self.rule == POWER_OF_TWO and self.scale_dtype != _E8M0:  # e8m0 implies it
            keywords["power_of_two_scales"] = (True,)
        keywords["static_scale"] = (_REQUIRED,) if self.static else (None,)
        return keywords

    def example(self) -> dict[str, Any]:
        """The keywords the recipe sets, by the first value each accepts (0.02 for the
        static recipe's calibrated ``static_scale``)."""
        return {
            name: 0.02 if values == (_REQUIRED,) else values[0]
            for name, values in self.keywords.items()
        }

    def scales_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The rowwise scales' shape for ``y`` of shape ``shape``."""
        return tuple(shape[:-1]) + (scales_per_row(shape[-1], None if self.static else self.block),)

    def columnwise_scales_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``scales_t``'s shape for ``x`` of shape ``shape`` (``y_t`` is ``[N, rows]``)."""
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        return (shape[-1], 1 if self.static else rows // self.block)


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            "fp8_row",
            "FP8, one dynamic scale per row (Modular MAX's fused kernel; vLLM's per-token).",
            _FP8, None, None, NEAREST, _E5M2,
        ),
        Recipe(
            "fp8_group128",
            "FP8, one dynamic scale per 1x128 group (DeepSeek-V3 / Qwen3 activations).",
            _FP8, 128, None, NEAREST, _E5M2,
        ),
        Recipe(
            "fp8_group128_ue8m0",
            "FP8 per 1x128 group with power-of-two scales (DeepSeek's UE8M0, for DeepGEMM).",
            _FP8, 128, None, POWER_OF_TWO, _E5M2,
        ),
        Recipe(
            "fp8_static",
            "FP8 with one calibrated per-tensor scale (vLLM's rms_norm_static_fp8_quant); "
            "needs static_scale.",
            _FP8, None, None, STATIC, _E5M2,
        ),
        Recipe(
            "mxfp8",
            "MXFP8 (OCP): e4m3 codes, one float8_e8m0fnu scale per 1x32 group.",
            (_E4M3FN,), 32, _E8M0, POWER_OF_TWO, _E4M3FN,
        ),
        Recipe(
            "nvfp4",
            "NVFP4: e2m1 codes, one float8_e4m3fn scale per 1x16 group, a global_scale.",
            (_FP4,), 16, _E4M3FN, NVFP4, hadamard_signs=HADAMARD_SIGNS[16],
        ),
        Recipe(
            "mxfp4",
            "MXFP4 (OCP): e2m1 codes, one float8_e8m0fnu scale per 1x32 group.",
            (_FP4,), 32, _E8M0, POWER_OF_TWO, hadamard_signs=HADAMARD_SIGNS[32],
        ),
    )
}  # fmt: skip


@functools.cache
def recipe_of(params) -> Recipe:
    """The recipe of a checked call's parameters (a NormParams): the named recipe whose
    layout they are, or for a layout no name stands for (another group size, say) that
    recipe's family with the call's block; the code and scale dtypes the call's. The one
    place a call's keywords are read back as a recipe."""
    if params.fp4:
        base = RECIPES["nvfp4" if params.scale_dtype == _E4M3FN else "mxfp4"]
    elif params.has_static_scale:
        base = RECIPES["fp8_static"]
    elif params.group_size is None:
        base = RECIPES["fp8_row"]
    elif params.scale_dtype == _E8M0 and params.group_size == RECIPES["mxfp8"].block:
        base = RECIPES["mxfp8"]
    elif params.power_of_two_scales:
        base = RECIPES["fp8_group128_ue8m0"]
    else:
        base = RECIPES["fp8_group128"]
    block = None if base.static else params.group_size
    name = base.name if block == base.block else f"{base.name} with group_size={block}"
    return dataclasses.replace(
        base,
        name=name,
        elements=(np.dtype(params.out_dtype),),
        block=block,
        scale_dtype=np.dtype(params.scale_dtype),
        family=base.name,
    )


def _same(given: Any, wanted: Any) -> bool:
    if wanted is None:
        return given is None
    if isinstance(wanted, bool):
        return isinstance(given, (bool, np.bool_)) and bool(given) == wanted
    if isinstance(wanted, int):
        integral = isinstance(given, numbers.Integral) and not isinstance(given, (bool, np.bool_))
        return integral and int(given) == wanted
    try:
        return np.dtype(given) == wanted
    except TypeError:
        return False


def _spell(value: Any) -> str:
    if value is None or isinstance(value, (bool, numbers.Number, np.bool_)):
        return repr(value)
    try:
        return np.dtype(value).name
    except TypeError:
        return repr(value)


def apply_recipe(keywords: dict[str, Any]) -> dict[str, Any]:
    """``keywords`` with its ``recipe`` (if any) replaced by the keywords the recipe sets;
    a ValueError for an unknown recipe, a contradicting keyword or a missing static
    scale."""
    keywords = dict(keywords)
    name = keywords.pop("recipe", None)
    if name is None:
        return keywords
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"recipe must be None or one of {list(RECIPES)}, got {name!r}")
    for keyword, accepted in RECIPES[name].keywords.items():
        if accepted == (_REQUIRED,):
            if keywords.get(keyword) is None:
                raise ValueError(f"recipe={name!r} needs {keyword}: its calibrated scale")
            continue
        if keyword not in keywords:
            keywords[keyword] = accepted[0]
        elif keyword == "static_scale" and keywords[keyword] is not None:
            raise ValueError(
                f"recipe={name!r} computes its scales, which contradicts the explicit "
                "static_scale: use recipe='fp8_static' for a calibrated scale"
            )
        elif not any(_same(keywords[keyword], value) for value in accepted):
            allowed = " or ".join(_spell(value) for value in accepted)
            raise ValueError(
                f"recipe={name!r} sets {keyword}={allowed}, which contradicts the explicit "
                f"{keyword}={_spell(keywords[keyword])}: drop one of the two"
            )
    return keywords


def recipe_keywords(name: str) -> dict[str, Any]:
    """The keywords the recipe ``name`` stands for (the static recipe's ``static_scale``
    is an example value: pass your calibrated one)."""
    if name not in RECIPES:
        raise ValueError(f"recipe must be one of {list(RECIPES)}, got {name!r}")
    return RECIPES[name].example()


def scales_per_row(hidden: int, group_size: int | None) -> int:
    """Scales per row of ``hidden`` elements: one per group of ``group_size``, or one for
    the row (``group_size=None``)."""
    return 1 if group_size is None else hidden // group_size


def dequantize(
    y: jax.Array, scales: jax.Array, global_scale: jax.Array | float | None = None
) -> jax.Array:
    """``f32(y) * f32(scales)``, each scale repeated over its group, times NVFP4's
    ``global_scale`` when given (one, or each row's ``[..., 1]`` from
    ``global_scale="per_row"``): float32 of ``y``'s shape from the ``(y, scales)`` of any
    op (per row, per group, e8m0, static, NVFP4 or MXFP4). A ``y`` with more trailing axes
    than ``scales`` (an op's ``reduction_axes`` over several) is read as rows of its
    trailing axes flattened."""
    shape = tuple(y.shape)
    batch = len(scales.shape) - 1
    if batch < 0 or len(shape) <= batch or shape[:batch] != tuple(scales.shape[:batch]):
        raise ValueError(
            f"scales of shape {tuple(scales.shape)} do not fit y of shape {shape}: scales "
            "must be y's batch axes then one axis of scales per row"
        )
    n = math.prod(shape[batch:])
    groups = scales.shape[-1]
    if (n % groups != 0) if groups else n != 0:
        raise ValueError(
            f"scales' last axis ({groups}) must divide the row of y, {n} elements "
            f"(y's shape {shape})"
        )
    scales32 = scales.astype(jnp.float32)
    if groups > 1:
        scales32 = jnp.repeat(scales32, n // groups, axis=-1)
    out = jnp.reshape(y, shape[:batch] + (n,)).astype(jnp.float32) * scales32
    if global_scale is not None:
        gs = jnp.asarray(global_scale, jnp.float32)
        # One for the tensor, or each row's (global_scale="per_row": scales' batch axes, 1).
        out = out * (jnp.reshape(gs, ()) if gs.size == 1 else gs)
    return jnp.reshape(out, shape)
