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
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RECIPES", "Recipe", "apply_recipe", "dequantize", "recipe_keywords", "scales_per_row"]

_E4M3FN = np.dtype(jnp.float8_e4m3fn)
_E4M3FNUZ = np.dtype(jnp.float8_e4m3fnuz)
_E8M0 = np.dtype(jnp.float8_e8m0fnu)
_FP4 = np.dtype(jnp.float4_e2m1fn)
# The FP8 recipes take either E4M3 type (e4m3fnuz for AMD's MI300); e4m3fn unless given.
_FP8 = (_E4M3FN, _E4M3FNUZ)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One layout: ``keywords`` maps each keyword the recipe decides to the values it
    accepts, the first being the one it sets when the caller gives none."""

    name: str
    description: str
    keywords: Mapping[str, tuple[Any, ...]]

    @property
    def static(self) -> bool:
        """Whether the recipe's scale is a calibrated ``static_scale`` (data, not computed)."""
        return self.keywords.get("static_scale") == (_REQUIRED,)

    def example(self) -> dict[str, Any]:
        """The keywords the recipe sets, by the first value each accepts (0.02 for the
        static recipe's calibrated ``static_scale``)."""
        return {
            name: 0.02 if values == (_REQUIRED,) else values[0]
            for name, values in self.keywords.items()
        }


class _Required:
    """Marks a keyword the recipe needs the caller to give (the static recipe's scale)."""

    def __repr__(self) -> str:
        return "a value"


_REQUIRED = _Required()

RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            "fp8_row",
            "FP8, one dynamic scale per row (Modular MAX's fused kernel; vLLM's per-token).",
            {"out_dtype": _FP8, "group_size": (None,), "static_scale": (None,)},
        ),
        Recipe(
            "fp8_group128",
            "FP8, one dynamic scale per 1x128 group (DeepSeek-V3 / Qwen3 activations).",
            {"out_dtype": _FP8, "group_size": (128,), "static_scale": (None,)},
        ),
        Recipe(
            "fp8_group128_ue8m0",
            "FP8 per 1x128 group with power-of-two scales (DeepSeek's UE8M0, for DeepGEMM).",
            {
                "out_dtype": _FP8,
                "group_size": (128,),
                "power_of_two_scales": (True,),
                "static_scale": (None,),
            },
        ),
        Recipe(
            "fp8_static",
            "FP8 with one calibrated per-tensor scale (vLLM's rms_norm_static_fp8_quant); "
            "needs static_scale.",
            {"out_dtype": _FP8, "group_size": (None,), "static_scale": (_REQUIRED,)},
        ),
        Recipe(
            "mxfp8",
            "MXFP8 (OCP): e4m3 codes, one float8_e8m0fnu scale per 1x32 group.",
            {
                "out_dtype": (_E4M3FN,),
                "group_size": (32,),
                "scale_dtype": (_E8M0,),
                "static_scale": (None,),
            },
        ),
        Recipe(
            "nvfp4",
            "NVFP4: e2m1 codes, one float8_e4m3fn scale per 1x16 group, a global_scale.",
            {
                "out_dtype": (_FP4,),
                "group_size": (16,),
                "scale_dtype": (_E4M3FN,),
                "static_scale": (None,),
            },
        ),
        Recipe(
            "mxfp4",
            "MXFP4 (OCP): e2m1 codes, one float8_e8m0fnu scale per 1x32 group.",
            {
                "out_dtype": (_FP4,),
                "group_size": (32,),
                "scale_dtype": (_E8M0,),
                "static_scale": (None,),
            },
        ),
    )
}


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
    ``global_scale`` when given: float32 ``[..., N]`` from the ``(y, scales)`` of any op
    (per row, per group, e8m0, static, NVFP4 or MXFP4)."""
    n = y.shape[-1]
    groups = scales.shape[-1]
    scales32 = scales.astype(jnp.float32)
    if groups > 1:
        scales32 = jnp.repeat(scales32, n // groups, axis=-1)
    out = y.astype(jnp.float32) * scales32
    if global_scale is not None:
        out = out * jnp.reshape(jnp.asarray(global_scale, jnp.float32), ())
    return out
