"""The public signatures of the ops' keywords: ``norm_keywords`` gives a function (or a
class) taking ``**keywords`` the signature and the documentation of NORM_KEYWORDS."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from jax_fp8norm._params import NORM_KEYWORDS


def _keywords_doc(indent: str) -> str:
    return "\n".join(
        textwrap.fill(
            f"{name}: {text} Default {_default_repr(default)}.",
            width=88,
            initial_indent=indent,
            subsequent_indent=indent + "  ",
        )
        for name, (default, text) in NORM_KEYWORDS.items()
    )


def _default_repr(value: Any) -> str:
    return getattr(value, "__name__", None) or repr(value)


def norm_keywords(fn: Callable) -> Callable:
    """Gives ``fn(..., **keywords)`` (a function, or a class by its __init__) the signature
    of the keywords in NORM_KEYWORDS (for help() and IDEs) and puts their descriptions
    where its docstring says ``{keywords}``.
    ``fn`` hands ``keywords`` to :func:`validate`, which applies the defaults and refuses
    unknown names."""
    if isinstance(fn, type):  # a class: its __init__ without self
        signature = inspect.signature(fn.__init__)
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    else:
        signature = inspect.signature(fn)
    parameters = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    parameters += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, (default, _) in NORM_KEYWORDS.items()
    ]
    fn.__signature__ = signature.replace(parameters=parameters)
    if fn.__doc__ and "{keywords}" in fn.__doc__:
        line = next(t for t in fn.__doc__.splitlines() if "{keywords}" in t)
        indent = line[: len(line) - len(line.lstrip())]
        fn.__doc__ = fn.__doc__.replace(line, _keywords_doc(indent))
    return fn
