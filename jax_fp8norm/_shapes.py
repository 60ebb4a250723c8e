"""The arrays framework code hands the ops, as the kernels take them (docs/spec.md, "Shapes,
dtypes and shardings"): ``gamma=None``, a gamma of any shape that broadcasts to the
normalised axes (after leading axes of size 1), normalisation over several trailing axes
(``reduction_axes``), the dequantised twins' dtype and ``out_sharding``.

The kernels take rows ``[..., N]`` and gamma ``[N]``. :func:`shaped_call` checks a call and
makes those; :meth:`ShapedCall.finish` gives the outputs (NormOutputs, by name) the
caller's shapes back and places them as ``out_sharding`` asks. Every public op, twin and
reference twin goes through here, so that they agree on every rule.
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
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp8norm._checks import check_float_dtype, check_gamma_dtype, check_rows, validate
from jax_fp8norm._exact_sums import exact_sum
from jax_fp8norm._params import NormCall, NormOutputs, as_operand

# The outputs of x's shape; the columnwise ones ([N, rows], [N, blocks]) keep theirs and
# their placement; every other output is one or more values per row, [..., k].
_X_SHAPED = ("y", "residual_out")
_COLUMNWISE = ("y_t", "scales_t", "global_scales_t")


def check_axes(value: Any, name: str) -> tuple[int, ...]:
    """An axes argument (``reduction_axes``, ``feature_axes``): an int or a sequence of ints,
    any sign; a bool is refused (True is not axis 1)."""
    ints = (numbers.Integral,)
    if isinstance(value, ints) and not isinstance(value, (bool, np.bool_)):
        return (int(value),)
    if isinstance(value, (tuple, list)) and all(
        isinstance(a, ints) and not isinstance(a, (bool, np.bool_)) for a in value
    ):
        return tuple(int(a) for a in value)
    raise TypeError(f"{name} must be an int or a sequence of ints, got {value!r}")


def check_reduction_axes(reduction_axes: Any, ndim: int) -> int:
    """How many trailing axes of an ``ndim``-rank x are normalised: ``reduction_axes`` (an
    int or a sequence of ints, any sign) must name the trailing axes, contiguous, ending at
    the last."""
    axes = check_axes(reduction_axes, "reduction_axes")
    if not axes:
        raise ValueError("reduction_axes must name at least one axis, got an empty sequence")
    for axis in axes:
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"reduction_axes={reduction_axes!r}: axis {axis} is out of range for x of "
                f"rank {ndim}"
            )
    positive = sorted(a % ndim for a in axes)
    if len(set(positive)) != len(positive):
        raise ValueError(f"reduction_axes={reduction_axes!r} names an axis twice")
    k = len(positive)
    if positive != list(range(ndim - k, ndim)):
        # A row is contiguous in memory only over trailing axes: that is what the kernels
        # read. Another layout is a transpose away, which the caller sees and pays for.
        raise ValueError(
            f"reduction_axes={reduction_axes!r} must be the trailing axes of x (rank {ndim}), "
            f"contiguous and ending at the last, such as -1 or (-2, -1); move the axes to "
            f"normalise last (jnp.moveaxis) first"
        )
    return k


def _gamma_shape(gamma: Any, normalised: tuple, k: int) -> tuple:
    """gamma's shape without the leading axes of size 1 beyond the normalised axes' count,
    checked to broadcast to ``normalised``; as a rank-``k`` shape (1s in front)."""
    shape = tuple(int(d) for d in gamma.shape)
    extra = max(len(shape) - k, 0)
    trimmed = shape[extra:]
    broadcasts = len(trimmed) <= k and all(
        g in (1, n) for g, n in zip(reversed(trimmed), reversed(normalised), strict=False)
    )
    if any(d != 1 for d in shape[:extra]) or not broadcasts:
        where = f"x.shape[-{k}:]" if k > 1 else "x.shape[-1:]"
        raise ValueError(
            f"gamma must have shape {normalised}, the normalised axes' ({where}, the axes "
            "reduction_axes names), or one that broadcasts to it after dropping leading axes "
            f"of size 1 (such as {(1,) * 2 + normalised}); got {shape}"
        )
    return (1,) * (k - len(trimmed)) + trimmed


@functools.cache
def _broadcaster(shape: tuple, normalised: tuple):
    """float32 gamma of ``shape`` (rank k, 1s where it broadcasts) broadcast to
    ``normalised`` and flattened to [N]. Its gradient sums each element's float32 dgamma
    over the positions it was broadcast to exactly (exact_sum): the sum does not depend on
    an order of addition, as the kernels' dgamma over the rows does not."""
    broadcast = [i for i, (g, n) in enumerate(zip(shape, normalised, strict=True)) if g != n]
    kept = [i for i in range(len(shape)) if i not in broadcast]

    @jax.custom_vjp
    def fn(gamma32):
        return jnp.broadcast_to(gamma32, normalised).reshape(-1)

    def bwd(_, cotangent):
        terms = jnp.transpose(cotangent.astype(jnp.float32).reshape(normalised), kept + broadcast)
        summed = exact_sum(terms.reshape(tuple(normalised[i] for i in kept) + (-1,)), axis=-1)
        return (summed.reshape(shape),)

    fn.defvjp(lambda gamma32: (fn(gamma32), None), bwd)
    return fn


def flat_gamma(gamma: Any, normalised: tuple) -> jax.Array:
    """A checked gamma (not None) as the kernels take it: ``[N]``. One of the normalised
    axes' shape is reshaped (its gradient is the kernels' dgamma, reshaped); a broadcast
    one goes through float32 (values unchanged) and :func:`_broadcaster`."""
    k = len(normalised)
    shape = _gamma_shape(gamma, normalised, k)
    gamma = as_operand(gamma)
    n = math.prod(normalised)
    if shape == normalised:
        return gamma if tuple(gamma.shape) == (n,) else jnp.reshape(gamma, (n,))
    return _broadcaster(shape, normalised)(jnp.reshape(gamma, shape).astype(jnp.float32))


def _names(entry: Any) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


def _explicit_sharding(array: Any) -> NamedSharding | None:
    """The sharding in ``array``'s type where it names a mesh axis (Explicit axes: Auto
    ones are not part of a type), on the abstract mesh of that type; None elsewhere."""
    if not isinstance(array, jax.Array):
        return None
    sharding = getattr(jax.typeof(array), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(entry is None for entry in spec):
        return None
    return sharding


def _gathered(gamma: Any) -> Any:
    """gamma whole (the kernels take a whole gamma beside whole rows) where an Explicit
    mesh axis shards it, gathered through its own type's mesh, so that no mesh context is
    needed; reshard's transpose gives its cotangent gamma's sharding back. Auto axes need
    nothing: XLA places them."""
    sharding = _explicit_sharding(gamma)
    if sharding is None:
        return gamma
    return jax.sharding.reshard(gamma, sharding.update(spec=P()))


def product_sharding(x: Any, gamma: Any, reduction_axes: Any = -1) -> NamedSharding | None:
    """The placement jnp gives ``x * gamma`` on Explicit mesh axes (gamma broadcast over
    the normalised axes): x's entries, and gamma's on the normalised axes x leaves whole (a
    mesh axis x already uses stays x's: a spec names each axis once); None where neither
    names an Explicit axis. The ops place ``y`` as x's rows with the normalised axes whole;
    the framework modules pass this as ``out_sharding`` instead, so that a model's later
    types are those its framework's norm gives."""
    x_sharding, g_sharding = _explicit_sharding(x), _explicit_sharding(gamma)
    if x_sharding is None and g_sharding is None:
        return None
    ndim = len(x.shape)
    k = check_reduction_axes(reduction_axes, ndim)
    spec = list(x_sharding.spec) if x_sharding is not None else []
    spec += [None] * (ndim - len(spec))
    if g_sharding is not None:
        gamma_spec = list(g_sharding.spec) + [None] * (gamma.ndim - len(g_sharding.spec))
        # gamma's trailing axes meet the normalised axes (broadcasting aligns on the right).
        used = {name for entry in spec if entry is not None for name in _names(entry)}
        for axis in range(1, min(k, gamma.ndim) + 1):
            entry = gamma_spec[-axis]
            if spec[-axis] is None and gamma.shape[-axis] != 1 and entry is not None:
                if not used & set(_names(entry)):
                    spec[-axis] = entry
                    used |= set(_names(entry))
    mesh = (x_sharding or g_sharding).mesh
    return NamedSharding(mesh, P(*spec))


@dataclasses.dataclass(frozen=True)
class OutSharding:
    """A checked ``out_sharding``: the spec of x-shaped outputs and the mesh it names (a
    NamedSharding's, or the one in context for a PartitionSpec)."""

    spec: P
    sharding: Any  # a NamedSharding, or the PartitionSpec itself under a mesh context
    explicit: bool  # reshard (explicit axes) rather than with_sharding_constraint

    def place(self, value: jax.Array, spec: P) -> jax.Array:
        target = spec if isinstance(self.sharding, P) else NamedSharding(self.sharding.mesh, spec)
        if self.explicit:
            return jax.sharding.reshard(value, target)
        return jax.lax.with_sharding_constraint(value, target)


def check_out_sharding(out_sharding: Any, ndim: int) -> OutSharding | None:
    """``out_sharding``: None, a NamedSharding, or a PartitionSpec under a mesh context
    (jax.set_mesh), of at most x's rank."""
    if out_sharding is None:
        return None
    if isinstance(out_sharding, NamedSharding):
        spec, mesh = out_sharding.spec, out_sharding.mesh
    elif isinstance(out_sharding, P):
        spec, mesh = out_sharding, jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"out_sharding={out_sharding} is a PartitionSpec with no mesh in context: "
                "call under `with jax.set_mesh(mesh):`, or pass a NamedSharding"
            )
    else:
        raise TypeError(
            f"out_sharding must be None, a NamedSharding or a PartitionSpec, got "
            f"{type(out_sharding).__name__}"
        )
    if len(spec) > ndim:
        raise ValueError(f"out_sharding={spec} has more entries than x has axes ({ndim})")
    names = [
        name
        for entry in spec
        if entry is not None
        for name in (entry if isinstance(entry, tuple) else (entry,))
    ]
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    for name in names:
        if name not in types:
            raise ValueError(
                f"out_sharding={spec} names the axis {name!r}, which the mesh "
                f"{tuple(mesh.axis_names)} does not have"
            )
    # Explicit axes are placed by reshard, automatic ones by a constraint; a spec that
    # names no axis replicates, which on an explicit mesh is a reshard too.
    considered = names or list(types)
    explicit = any(types[name] == AxisType.Explicit for name in considered)
    return OutSharding(P(*spec, *([None] * (ndim - len(spec)))), out_sharding, explicit)


@dataclasses.dataclass(frozen=True)
class ShapedCall:
    """One checked call as the kernels take it."""

    call: NormCall
    rows: tuple  # x (and residual) as [..., N]
    gamma: jax.Array  # [N]
    x_shape: tuple
    axes: int  # how many trailing axes of x are normalised
    dtype: np.dtype  # result_type(x, gamma); x's dtype for gamma=None
    out_sharding: OutSharding | None

    def operands(self) -> tuple:
        """The norm's operands: rows, gamma, then the scale operand if any."""
        return self.call.operands(*self.rows, self.gamma)

    def value_dtype(self, dtype: Any) -> np.dtype:
        """The dequantised twins' dtype: ``dtype`` (checked) if given, else the call's."""
        return self.dtype if dtype is None else check_float_dtype(dtype, "dtype")

    def finish(self, outs: NormOutputs) -> NormOutputs:
        """The outputs of the kernels' call in the caller's terms: x's shape back on the
        fields of x's shape (by name), and every row output placed as out_sharding asks:
        the x-shaped ones by its spec, the others by its entries on the batch axes."""
        values = outs._asdict()
        for name in _X_SHAPED:
            if values[name] is not None and tuple(values[name].shape) != self.x_shape:
                values[name] = jnp.reshape(values[name], self.x_shape)
        placing = self.out_sharding
        if placing is not None:
            batch = len(self.x_shape) - self.axes
            row_spec = P(*placing.spec[:batch], None)
            for name, value in values.items():
                if value is None or name in _COLUMNWISE:
                    continue
                values[name] = placing.place(value, placing.spec if name in _X_SHAPED else row_spec)
        return NormOutputs(**values)


def shaped_call(
    rows: tuple, gamma: Any, keywords: dict, *, reduction_axes: Any = -1, out_sharding: Any = None
) -> ShapedCall:
    """Checks a public op's call (``rows``: x, or x and residual; errors name the argument)
    and makes its arrays the kernels' rows and gamma."""
    x = rows[0]
    check_rows(x, *rows[1:])
    shape = tuple(int(d) for d in x.shape)
    k = check_reduction_axes(reduction_axes, len(shape))
    normalised = shape[len(shape) - k :]
    n = math.prod(normalised)
    flat_shape = shape[: len(shape) - k] + (n,)
    rows = tuple(as_operand(r) if k == 1 else jnp.reshape(as_operand(r), flat_shape) for r in rows)
    x_dtype = np.dtype(x.dtype)
    if gamma is None:
        # No weight: 1 exactly, whatever weight_offset (checked as given, then 0).
        flat = jnp.ones((n,), x_dtype)
        call = validate(rows[0], flat, *rows[1:], **keywords)
        params = dataclasses.replace(call.params, weight_offset=0.0)
        call = dataclasses.replace(call, params=params)
        dtype = x_dtype
    else:
        gamma_dtype = check_gamma_dtype(gamma)
        gamma = _gathered(gamma)
        flat = flat_gamma(gamma, normalised)
        call = validate(rows[0], flat, *rows[1:], **keywords)
        dtype = np.dtype(jnp.result_type(x_dtype, gamma_dtype))
    placing = check_out_sharding(out_sharding, len(shape))
    return ShapedCall(call, rows, flat, shape, k, dtype, placing)
