"""The one ``jax.custom_vjp`` of the fused norm followed by a differentiable head: the
dequantisation of the differentiable twins (jax_fp8norm.autodiff) or the FP8 / FP4 GEMM
of the layer (jax_fp8norm.dense), for the rms and add forms alike.

Forward: the norm's plain form, or under differentiation its training form (each row's
r, and the columnwise codes where the head keeps them), then the head. Backward: the
head's backward gives ``dn``, the cotangent of the normalised ``n`` (the quantisation
passes it straight through), and the gradients of its own operands; then the fused norm
backward gives ``dx`` and ``dgamma`` (and ``dresidual``).

Rows that are not whole blocks of the columnwise codes a head's backward takes are padded
under differentiation: the forward runs the norm and the head on the rows flattened to
``[rows, K]`` and padded with zero rows, and returns the caller's rows; the backward pads
the cotangent with zero rows for the head and runs the norm's backward on the caller's
rows alone. A zero row's codes are zero, it raises no block's amax, and its zero
cotangent adds nothing to ``dw`` or ``dgamma``: every bit is that of a call padded by
hand (docs/training.md, "Rows padded to the blocks")."""

from __future__ import annotations

import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_fp8norm._backward import add_backward, rms_backward
from jax_fp8norm._params import NormCall, NormOutputs, NormParams
from jax_fp8norm._primitives import bind_norm
from jax_fp8norm.recipes import recipe_of


class Head(Protocol):
    """What follows the norm. Hashable: one custom_vjp per (params, form, head)."""

    num_operands: int  # its own operands, after gamma (the layer's w, its key)
    columnwise: bool  # whether its backward reads the norm's columnwise codes
    hadamard: int | None  # the columnwise codes' transform (its sign mask), None for none

    def apply(self, outs: NormOutputs, operands: tuple, static: tuple) -> tuple:
        """``(value, residuals)``: its value from the norm's outputs, its operands and the
        norm's operands after gamma (a calibrated or global scale), and what its backward
        keeps of its own work (the layer's quantised weight)."""

    def check_training(self, x_shape: tuple, operands: tuple) -> None:
        """Refuses what its backward cannot take, when the function is differentiated."""

    def kept(self, outs: NormOutputs) -> tuple:
        """What its backward keeps of the norm's outputs."""

    def backward(self, g, operands: tuple, static: tuple, kept: tuple, residuals: tuple) -> tuple:
        """``(dn, gradients of its operands)`` from the cotangent ``g`` of its value."""


def _varying_axes(v: jax.Array) -> frozenset:
    """The shard_map axes along which ``v``'s value differs between devices."""
    manual = getattr(jax.typeof(v), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def summed_over_devices(primal: jax.Array, cotangent: jax.Array) -> jax.Array:
    """Inside shard_map, ``cotangent`` psummed over the mesh axes along which it varies and
    ``primal`` does not: ``dn`` of a norm whose outputs are the same on every device of "tp"
    (the type of its ``inverse_rms``, which varies wherever any of the norm's operands
    does, does not vary there) and whose layer's weight is split by columns over "tp" is
    the sum of every device's part (summed in float32 before the norm's backward, so that
    dx is rounded once), and so is dgamma of a gamma replicated over the axis that splits
    the rows. Where the norm's outputs vary (x, gamma, the residual or a
    static or global scale differs between devices), each device's backward is its own,
    on its own dn, and dx, dresidual and dgamma are summed after it, once."""
    axes = tuple(sorted(_varying_axes(cotangent) - _varying_axes(primal)))
    return jax.lax.psum(cotangent, axes) if axes else cotangent


def _padding(lead: tuple, block: int) -> tuple[int, int]:
    """The number of rows of ``[*lead, K]`` and the zero rows that make it a multiple of
    ``block``."""
    num = math.prod(lead)
    return num, -num % block


def _pad_rows(v: jax.Array, num: int, extra: int) -> jax.Array:
    """``v`` of ``num`` rows as ``[num + extra, C]``, the ``extra`` rows zeros."""
    return jnp.pad(v.reshape(num, -1), ((0, extra), (0, 0)))


def _first_rows(v: jax.Array, num: int, lead: tuple) -> jax.Array:
    """The first ``num`` rows of ``v [rows, *C]`` as ``[*lead, *C]``."""
    return v[:num].reshape(lead + v.shape[1:])


def _explicit_row_shards(v: jax.Array) -> tuple:
    """``v``'s sharding (None outside Explicit axes) and, for each row dimension, the
    number of devices its Explicit mesh axes split it over."""
    sharding = getattr(jax.typeof(v), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return None, ()
    explicit = {
        name: size
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    }
    spec = tuple(sharding.spec) + (None,) * (v.ndim - len(sharding.spec))
    shards = []
    for entry in spec[:-1]:
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        shards.append(math.prod(explicit.get(name, 1) for name in names))
    return sharding, tuple(shards)


def _gathers_rows(v: jax.Array, rows: int, block: int) -> bool:
    """Whether the rows of ``v`` (``rows`` of them once padded) are split over Explicit mesh
    axes so that a device's share is not whole blocks of ``block`` rows, or not one run of
    the flattened rows (a row dimension after the first split): then the layer runs on all
    the rows on each device, the bits of the unsharded call. Under Auto axes the norm's
    lowering decides alone (jax_fp8norm._partitioning.blocks_fit_devices): the sharding is
    not known while tracing."""
    _, shards = _explicit_row_shards(v)
    if block == 1 or math.prod(shards) == 1:
        return False
    return any(n > 1 for n in shards[1:]) or rows % (block * shards[0]) != 0


def _with_rows_of(v: jax.Array, like: jax.Array, *, keep_last: bool) -> jax.Array:
    """``v`` resharded to the Explicit sharding of ``like``'s rows; its last axis as
    ``like``'s where ``keep_last``, else as ``v``'s own (the head's value keeps the
    columns its GEMM gave it: the type the call has undifferentiated)."""
    sharding, _ = _explicit_row_shards(like)
    spec = tuple(sharding.spec) + (None,) * (like.ndim - len(sharding.spec))
    if not keep_last:
        own = tuple(jax.typeof(v).sharding.spec)
        spec = spec[:-1] + ((own + (None,) * (v.ndim - len(own)))[-1],)
    return jax.sharding.reshard(v, jax.sharding.NamedSharding(sharding.mesh, P(*spec)))


def _rows_whole(v: jax.Array) -> jax.Array:
    """``v`` with its row dimensions resharded to whole on every device."""
    sharding, _ = _explicit_row_shards(v)
    spec = tuple(sharding.spec) + (None,) * (v.ndim - len(sharding.spec))
    whole = P(*(None,) * (v.ndim - 1), spec[-1])
    return jax.sharding.reshard(v, jax.sharding.NamedSharding(sharding.mesh, whole))


def _in_type_of(d: jax.Array, operand: jax.Array) -> jax.Array:
    """``d`` resharded to ``operand``'s sharding where that is on a mesh (the head's
    backward on gathered rows leaves a gradient whole that its operand splits)."""
    sharding = jax.typeof(operand).sharding
    if not getattr(sharding.mesh, "axis_names", ()) or jax.typeof(d).sharding == sharding:
        return d
    return jax.sharding.reshard(d, sharding)


@functools.cache
def differentiable_norm(p: NormParams, add: bool, head: Head):
    """``fn(x[, residual], gamma, *head operands, *static)``: the head's value (and with
    ``add`` the norm's ``residual_out``, whose cotangent flows to x and residual
    unchanged), differentiable in every operand but the static ones (a calibrated or
    global scale: constants of the straight-through rule)."""
    num_rows = 2 if add else 1
    # The norm's columnwise codes, which the head's backward may take, come in blocks of
    # rows: a call of other rows is padded to them under differentiation.
    block = (recipe_of(p).block if head.columnwise else None) or 1

    def split(args):
        rows, gamma = args[:num_rows], args[num_rows]
        operands = args[num_rows + 1 : num_rows + 1 + head.num_operands]
        return rows, gamma, operands, args[num_rows + 1 + head.num_operands :]

    def run(args, *, training: bool):
        rows, gamma, operands, static = split(args)
        call = NormCall(p, static[0] if static else None)
        columnwise = training and head.columnwise
        outs = bind_norm(
            call,
            rows,
            gamma,
            training=training,
            columnwise=columnwise,
            hadamard=head.hadamard if columnwise else None,
        )
        value, residuals = head.apply(outs, operands, static)
        return ((value, outs.residual_out) if add else value), outs, residuals

    @jax.custom_vjp
    def fn(*args):
        return run(args, training=False)[0]

    def fwd(*args):
        rows, gamma, operands, static = split(args)
        lead = rows[0].shape[:-1]
        num, extra = _padding(lead, block)
        if _gathers_rows(rows[0], num + extra, block):
            # A device's share of the rows would split a block: the whole call on every
            # device, its results back in the caller's sharding.
            gathered = tuple(_rows_whole(r) for r in rows)
            value, saved = fwd(*gathered, *args[num_rows:])
            if add:
                value = (
                    _with_rows_of(value[0], rows[0], keep_last=False),
                    _with_rows_of(value[1], rows[0], keep_last=True),
                )
            else:
                value = _with_rows_of(value, rows[0], keep_last=False)
            inverse_rms = _with_rows_of(saved[2], rows[0], keep_last=False)
            return value, (rows, saved[1], inverse_rms, *saved[3:])
        if extra:  # zero rows: the codes, scales and gradients of the real rows unchanged
            padded = tuple(_pad_rows(r, num, extra) for r in rows)
            head.check_training(padded[0].shape, operands)
            value, outs, residuals = run((*padded, *args[num_rows:]), training=True)
            value = jax.tree.map(lambda v: _first_rows(v, num, lead), value)
            inverse_rms = _first_rows(outs.inverse_rms, num, lead)
        else:
            head.check_training(rows[0].shape, operands)
            value, outs, residuals = run(args, training=True)
            inverse_rms = outs.inverse_rms
        kept = head.kept(outs)
        return value, (rows, gamma, inverse_rms, operands, static, kept, residuals)

    def bwd(saved, cotangent):
        rows, gamma, inverse_rms, operands, static, kept, residuals = saved
        g, d_residual_out = cotangent if add else (cotangent, None)
        num, extra = _padding(rows[0].shape[:-1], block)
        gathered = _gathers_rows(rows[0], num + extra, block)
        if gathered:  # as the forward: the head's backward on all the rows
            g = _rows_whole(g)
        if extra:  # the padded rows' cotangent is zero; dn of the real rows alone
            g = _pad_rows(g, num, extra)
        dn, d_operands = head.backward(g, operands, static, kept, residuals)
        if gathered:  # each gradient in its operand's type, as custom_vjp requires
            d_operands = tuple(_in_type_of(d, o) for d, o in zip(d_operands, operands, strict=True))
        dn = dn[:num] if extra else dn
        dn = dn.reshape(rows[0].shape)
        if gathered:
            dn = _with_rows_of(dn, rows[0], keep_last=True)
        dn = summed_over_devices(inverse_rms, dn)
        if add:
            x, residual = rows
            dx, dresidual, dgamma = add_backward(
                dn, d_residual_out, x, residual, gamma, inverse_rms, p.weight_offset
            )
            d_rows = (dx, dresidual)
        else:
            dx, dgamma = rms_backward(dn, rows[0], gamma, inverse_rms, p.weight_offset)
            d_rows = (dx,)
        d_rows = tuple(summed_over_devices(r, d) for r, d in zip(rows, d_rows, strict=True))
        dgamma = summed_over_devices(gamma, dgamma).astype(gamma.dtype)
        return (*d_rows, dgamma, *d_operands, *(jnp.zeros_like(s) for s in static))

    fn.defvjp(fwd, bwd)
    return fn
