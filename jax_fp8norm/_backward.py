"""JAX primitives of the backward pass of rms_norm_fp8 and add_rms_norm_fp8 (docs/spec.md,
"Training: the backward pass"), with every rule of each in this file: the shape rule, the
lowering and batching, registered through jax_fp8norm._lowering as the norm's are.
Operands: rms: (dn, x, gamma, inverse_rms); add: (dn, d_residual_out, x, residual, gamma,
inverse_rms). Results: (dx, dgamma) and (dx, dresidual, dgamma)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp8norm import reference
from jax_fp8norm._lowering import eager_impl, map_over_batch, register_lowerings, twin_lowering


def _varying(avals) -> dict:
    """The results vary over every shard_map axis any operand varies over (dn varies over
    "tp" when the weight after the norm is split by columns, though x does not); empty
    where no operand varies (outside shard_map, or replicated everywhere)."""
    manual = getattr(avals[0], "manual_axis_type", None)
    varying = frozenset().union(
        *(getattr(a, "manual_axis_type", manual).varying for a in avals if manual is not None)
    )
    if not varying:
        return {}
    return {
        "manual_axis_type": type(manual)(
            varying=varying, unreduced=frozenset(), reduced=frozenset()
        )
    }


def _abstract_eval(*avals, weight_offset, add):
    x = avals[2] if add else avals[1]
    varying = _varying(avals)
    dx = x.update(shape=x.shape, dtype=x.dtype, weak_type=False, **varying)
    dgamma = jax.core.ShapedArray((x.shape[-1],), np.dtype(np.float32))
    if varying:  # on the shard_map's mesh, whole on each device
        replicated = NamedSharding(x.sharding.mesh, PartitionSpec(None))
        dgamma = x.update(
            shape=dgamma.shape, dtype=dgamma.dtype, weak_type=False, sharding=replicated, **varying
        )
    if add:
        residual = avals[3]
        dresidual = residual.update(shape=x.shape, dtype=residual.dtype, weak_type=False, **varying)
        return [dx, dresidual, dgamma]
    return [dx, dgamma]


def _twin(*operands, weight_offset, add):
    if add:
        return reference.add_backward(*operands, weight_offset)
    return reference.backward(*operands, weight_offset)


def _ffi_rule(target: str, platform: str):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, weight_offset, add):
        return rule(ctx, *args, weight_offset=np.float32(weight_offset))

    return lowering


def _make_backward_primitive(op: str) -> Primitive:
    prim = Primitive(f"fp8norm_{op}")
    prim.multiple_results = True
    prim.def_abstract_eval(_abstract_eval)
    prim.def_impl(functools.partial(eager_impl, prim))
    register_lowerings(prim, op, _ffi_rule, twin_lowering(op, _twin))
    # One call per batch element: each element has a dgamma of its own.
    batching.primitive_batchers[prim] = functools.partial(map_over_batch, prim)
    return prim


rms_norm_backward_p = _make_backward_primitive("rms_norm_backward")
add_rms_norm_backward_p = _make_backward_primitive("add_rms_norm_backward")


def rms_backward(dn, x, gamma, inverse_rms, weight_offset: float):
    """(dx, dgamma float32) of the fused backward, its operands checked by the caller."""
    return rms_norm_backward_p.bind(
        dn, x, gamma, inverse_rms, weight_offset=weight_offset, add=False
    )


def add_backward(dn, d_residual_out, x, residual, gamma, inverse_rms, weight_offset: float):
    """(dx, dresidual, dgamma float32) of the fused backward with the residual add;
    ``d_residual_out`` in the residual's dtype, as residual_out is."""
    return add_rms_norm_backward_p.bind(
        dn,
        d_residual_out.astype(residual.dtype),
        x,
        residual,
        gamma,
        inverse_rms,
        weight_offset=weight_offset,
        add=True,
    )
