"""What the framework modules (nnx.py, linen.py, eqx.py) share without a framework: the
FP8 output of ``quantized_output=True`` (codes and scales, which refuse to be used as an
array), the recipe keywords a module gives the op (checked where the module is made, one
rule for all three), and the axes and the scale parameter as the op takes them."""

from __future__ import annotations

import collections
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8norm._checks import (
    check_global_scale,
    check_keyword_names,
    check_static_scale,
    validate,
)
from jax_fp8norm._params import NORM_KEYWORDS
from jax_fp8norm._shapes import check_axes, check_reduction_axes
from jax_fp8norm.recipes import apply_recipe

REMOVED_DEQUANTIZE = (
    "dequantize= was removed in jax_fp8norm 0.3.0: RMSNormFP8 returns the dequantised "
    "array by default, as its framework's RMSNorm does (dequantize=True's output); "
    "quantized_output=True returns the FP8/FP4 codes and their scales (dequantize=False's)"
)


def _error(what: str) -> str:
    return (
        f"{what}: the module was made with quantized_output=True, so it returns a "
        "QuantizedOutput (the FP8/FP4 codes y and their scales), not an array. Take out.y "
        "and out.scales for a layer that consumes codes, jax_fp8norm.dequantize(out.y, "
        "out.scales) for the values, or make the module with quantized_output=False (the "
        "default) for the dequantised array"
    )


class QuantizedOutput(tuple):
    """What a norm module made with ``quantized_output=True`` returns: a named tuple of the
    op's outputs (``y``, ``scales``, and ``residual_out`` with a residual), in the op's
    order (then ``global_scales`` with ``global_scale="per_row"``), so that it unpacks as
    the op's tuple does. Used as an
    array (``jnp`` functions, ``.shape``, ``.astype``, arithmetic, indexing by anything
    but an int or a slice) it raises an error naming ``quantized_output``: a tuple of
    codes reaching the next layer by mistake would otherwise fail there naming nothing,
    or be stacked or repeated silently."""

    __slots__ = ()

    def __getattr__(self, name: str):
        # Only names the tuple lacks reach here (y, scales, index, count do not).
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_error(f"QuantizedOutput has no .{name}"))

    def __getitem__(self, index):
        if isinstance(index, (numbers.Integral, slice)):
            return tuple.__getitem__(self, index)
        raise TypeError(_error(f"indexing by {index!r}"))

    def __jax_array__(self):
        raise TypeError(_error("used as a jax array"))

    def __array__(self, *args, **kwargs):
        raise TypeError(_error("used as a numpy array"))


def _refuse_arithmetic(name: str):
    def method(self, *args):
        raise TypeError(_error(f"arithmetic ({name})"))

    method.__name__ = name
    return method


# A tuple's own + and * concatenate and repeat: never what a norm's output meant.
for _name in (
    "add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow "
    "matmul rmatmul neg pos abs"
).split():
    setattr(QuantizedOutput, f"__{_name}__", _refuse_arithmetic(f"__{_name}__"))


@functools.cache
def _quantized_type(fields: tuple[str, ...]) -> type:
    """The QuantizedOutput of these fields (one class per form, so that jax rebuilds it
    from its leaves as the named tuple it is)."""
    base = collections.namedtuple("QuantizedOutput", fields)
    return type("QuantizedOutput", (QuantizedOutput, base), {"__slots__": ()})


def quantized_output(outputs: tuple, residual: bool) -> QuantizedOutput:
    """An op's ``(y, scales)`` (``(y, scales, residual_out)`` with a residual, then
    ``global_scales`` with ``global_scale="per_row"``) as the QuantizedOutput of its
    fields."""
    fields = ("y", "scales", "residual_out") if residual else ("y", "scales")
    fields += ("global_scales",) if len(outputs) > len(fields) else ()
    return _quantized_type(fields)(*outputs)


def keywords_given(values: dict[str, Any]) -> dict[str, Any]:
    """The recipe keywords among ``values`` that differ from the ops' defaults: a module
    keeps every keyword as an attribute with its default, and one left at it must not
    contradict the module's ``recipe``."""
    given = {}
    for name, value in values.items():
        default = NORM_KEYWORDS[name][0]
        if default is None or value is None:
            same = value is None and default is None
        elif name in ("out_dtype", "scale_dtype"):
            try:
                same = np.dtype(value) == np.dtype(default)
            except TypeError:  # not a dtype: the op says so
                same = False
        else:
            same = type(value) is type(default) and value == default
        if not same:
            given[name] = value
    return given


def module_keywords(
    keywords: dict[str, Any], *, eps: Any, eps_name: str, n: int | None = None
) -> tuple[dict[str, Any], dict[str, jax.Array | None]]:
    """The ops' keywords of a module, checked where the module is made (a bad one fails
    there, not at the first call inside a model): ``keywords`` the recipe keywords given,
    ``eps`` the module's epsilon under its framework's name ``eps_name`` (``epsilon`` for
    Flax, ``eps`` for equinox; the other name is refused, saying which to use), ``n`` the
    normalised size where the module knows it (else group_size is checked against N at the
    call). Returns the static keywords (with ``eps``) and the scale arrays (``static_scale``,
    ``global_scale``: float32 ``(1,)`` or None), which a module keeps as data."""
    keywords = dict(keywords)
    other = "eps" if eps_name == "epsilon" else "epsilon"
    if other in keywords:
        raise TypeError(
            f"{other}=: this RMSNormFP8 takes its framework's name for it, {eps_name}= "
            f"(the ops' eps), so that a norm's arguments carry over as they are"
        )
    if "dequantize" in keywords:
        raise TypeError(REMOVED_DEQUANTIZE)
    check_keyword_names(keywords)
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{eps_name} must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{eps_name} must be finite and >= 0, got {eps}")
    keywords["eps"] = float(eps)
    scales = {
        "static_scale": check_static_scale(keywords.pop("static_scale", None)),
        "global_scale": check_global_scale(keywords.pop("global_scale", None)),
    }
    if n is None:  # a row of one group passes every group rule the recipe has
        group = apply_recipe({**keywords, **scales}).get("group_size")
        valid = isinstance(group, numbers.Integral) and not isinstance(group, bool) and group > 0
        n = int(group) if valid else 2
    validate(np.zeros((1, n), np.float32), np.ones((n,), np.float32), **keywords, **scales)
    return keywords, scales


def module_axes(reduction_axes: Any, feature_axes: Any, ndim: int | None) -> tuple:
    """``reduction_axes`` and ``feature_axes`` of a module's call on x of rank ``ndim``, as
    positive axes: the normalised ones trailing and contiguous (the kernels read a row's
    elements contiguously), the scale's among them (the kernels' gamma is one weight over
    the normalised values, the same for every row). ``ndim`` None: checked where the
    module is made, as far as negative axes allow (a positive axis needs x's rank)."""
    reduction, features = (
        check_axes(reduction_axes, "reduction_axes"),
        check_axes(feature_axes, "feature_axes"),
    )
    if ndim is None:
        if any(a >= 0 for a in reduction + features):
            return None
        ndim = -min(reduction + features)
    k = check_reduction_axes(reduction_axes, ndim)
    normalised = tuple(range(ndim - k, ndim))
    for axis in features:
        if not -ndim <= axis < ndim or axis % ndim not in normalised:
            raise ValueError(
                f"feature_axes={feature_axes!r} must be among reduction_axes="
                f"{reduction_axes!r} for x of rank {ndim}: RMSNormFP8's kernels multiply "
                "every normalised row by one weight over its values, the same for every "
                "row, which a scale along another axis is not"
            )
    return normalised, tuple(sorted({a % ndim for a in features}))


def scale_as_gamma(scale: Any, x_shape: tuple, reduction_axes: Any, feature_axes: Any):
    """A module's ``scale`` parameter as the op's gamma: over the normalised axes, the
    features' sizes on their axes and 1 (broadcast) elsewhere, as the frameworks reshape
    it; None without a scale. The op broadcasts it (its gradient summed exactly)."""
    normalised, features = module_axes(reduction_axes, feature_axes, len(x_shape))
    if scale is None:
        return None
    target = tuple(x_shape[a] if a in features else 1 for a in normalised)
    shape = tuple(scale.shape)
    if shape == target:
        return scale
    if math.prod(shape) != math.prod(target):
        raise ValueError(
            f"scale of shape {shape} does not fit feature_axes={feature_axes!r} of x of "
            f"shape {tuple(x_shape)} (sizes {tuple(x_shape[a] for a in features)})"
        )
    if shape == tuple(x_shape[a] for a in features):
        # New axes of size 1 keep a sharded scale's placement (a reshape may not).
        return jnp.expand_dims(scale, [i for i, a in enumerate(normalised) if a not in features])
    return jnp.reshape(scale, target)
