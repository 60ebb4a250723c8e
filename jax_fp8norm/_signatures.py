"""The public signatures of the ops' keywords: ``norm_keywords`` gives a function (or a
class) taking ``**keywords`` the signature and the documentation of NORM_KEYWORDS."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from jax_fp8norm._params import NORM_KEYWORDS


def _keywords_doc(indent: str, keywords: dict) -> str:
    return "\n".join(
        textwrap.fill(
            f"{name}: {text} Default {_default_repr(default)}.",
            width=88,
            initial_indent=indent,
            subsequent_indent=indent + "  ",
        )
        for name, (default, text) in keywords.items()
    )


# The arguments every public op shares beyond NORM_KEYWORDS (jax_fp8norm._shapes checks
# them), each described once: a docstring line ``{name}`` becomes its text.
ARGUMENT_DOCS: dict[str, str] = {
    "gamma": (
        "gamma: the weight, float32, float16 or bfloat16 (need not match ``x``): of the "
        "normalised axes' shape (``[N]`` for the last axis), or any shape that broadcasts "
        "to it after dropping leading axes of size 1 (``(1, 1, 1, N)``; ``(16,)`` for a norm "
        "over ``(4, 16)``); or None for no weight (the weight is 1 exactly, whatever "
        "``weight_offset``)."
    ),
    "reduction_axes": (
        "reduction_axes: the axes normalised together, an int or a sequence of ints (any "
        "sign): the trailing axes of ``x``, contiguous, ending at the last. Default -1. "
        "Several are one row of ``N = prod(normalised shape)`` elements to the kernels: "
        "``y`` and ``residual_out`` come back in ``x.shape``, ``scales`` as "
        "``x.shape[:-k] + (N // group_size,)`` (``+ (1,)`` per row), ``y_t`` as "
        "``[N, rows]``."
    ),
    "out_sharding": (
        "out_sharding: None, or a NamedSharding (or a PartitionSpec under ``jax.set_mesh``) "
        "for ``y`` and ``residual_out``; ``scales`` take its entries on the batch axes. "
        "Applied with ``jax.sharding.reshard`` on explicit mesh axes and "
        "``jax.lax.with_sharding_constraint`` on automatic ones."
    ),
}


def _argument_doc(name: str, indent: str) -> str:
    return textwrap.fill(
        ARGUMENT_DOCS[name], width=88, initial_indent=indent, subsequent_indent=indent + "  "
    )


def _default_repr(value: Any) -> str:
    return getattr(value, "__name__", None) or repr(value)


def norm_keywords(fn: Callable | None = None, *, exclude: tuple[str, ...] = ()) -> Callable:
    """Gives ``fn(..., **keywords)`` (a function, or a class by its __init__) the signature
    of the keywords in NORM_KEYWORDS but ``exclude`` (for help() and IDEs) and puts their
    descriptions where its docstring says ``{keywords}``, and that of a shared argument
    (ARGUMENT_DOCS) on a line that says ``{gamma}``, ``{reduction_axes}`` or
    ``{out_sharding}``. ``fn`` hands ``keywords`` to :func:`validate`, which applies the
    defaults and refuses unknown names. ``norm_keywords(exclude=(...))`` is the decorator
    that leaves those out (a module whose framework names one of them its own way)."""
    if fn is None:
        return lambda fn: norm_keywords(fn, exclude=exclude)
    keywords = {name: spec for name, spec in NORM_KEYWORDS.items() if name not in exclude}
    if isinstance(fn, type):  # a class: its __init__ without self
        signature = inspect.signature(fn.__init__)
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    else:
        signature = inspect.signature(fn)
    parameters = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    parameters += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, (default, _) in keywords.items()
    ]
    try:
        fn.__signature__ = signature.replace(parameters=parameters)
    except AttributeError:  # equinox's metaclass gives __init__'s, less self, as the class's
        self_parameter = next(iter(inspect.signature(fn.__init__).parameters.values()))
        fn.__init__.__signature__ = signature.replace(parameters=[self_parameter, *parameters])
    for line in (fn.__doc__ or "").splitlines():
        name = line.strip()[1:-1]
        if line.strip() not in ("{keywords}", *(f"{{{a}}}" for a in ARGUMENT_DOCS)):
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if name == "keywords":
            text = _keywords_doc(indent, keywords)
        else:
            text = _argument_doc(name, indent)
        fn.__doc__ = fn.__doc__.replace(line, text)
    return fn
