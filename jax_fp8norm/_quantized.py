"""What the framework modules share without a framework: the FP8 output of
``quantized_output=True`` (codes and scales, which refuse to be used as an array) and the
recipe keywords a module gives the op."""

from __future__ import annotations

import collections
import functools
import numbers
from typing import Any

import numpy as np

from jax_fp8norm._params import NORM_KEYWORDS


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
    order, so that ``y, scales = norm(x)`` unpacks as the op's tuple does. Used as an
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
    """An op's ``(y, scales)`` (``(y, scales, residual_out)`` with a residual) as the
    QuantizedOutput of its fields."""
    fields = ("y", "scales", "residual_out") if residual else ("y", "scales")
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
