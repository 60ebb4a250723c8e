"""JAX primitives of the ops: abstract evaluation (the shape rule), lowering to the XLA FFI
custom calls per platform (through jax_fp8norm._lowering, as the backward's primitives),
batching (vmap) and differentiation (the FP8 / FP4 outputs refuse a JVP;
jax_fp8norm.autodiff holds the differentiable twins); partitioning under jit is
jax_fp8norm._partitioning.
Where this build has no kernel for a platform, the kernels' primitives lower to their
reference twins (jax_fp8norm._fallback)."""

from __future__ import annotations

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp8norm import _allreduce, _fallback, _ffi, reference
from jax_fp8norm._groups import PER_ROW_GLOBAL_FLOOR
from jax_fp8norm._lowering import (
    batch_size,
    eager_impl,
    lowering_platforms,
    map_over_batch,
    register_lowerings,
    to_front,
    twin_lowering,
)
from jax_fp8norm._params import (
    NormCall,
    NormOutputs,
    NormParams,
    has_scale_operand,
    named_outputs,
    num_row_operands,
    result_names,
)
from jax_fp8norm._partitioning import (
    columnwise_row_axes,
    partitioned_lowering,
    requires_devices_during_lowering,
    row_spec,
)
from jax_fp8norm.recipes import recipe_of

# The FFI target names of the native kernels, the same on every platform.
TARGETS = tuple(_ffi.TARGETS.values())

# What jax.export must be told to serialise a function that uses the ops: our custom-call
# targets carry no cross-version compatibility guarantee from XLA, so the caller vouches
# for them (the deserialising process must import jax_fp8norm, which registers them). The
# emulated CUDA kernels' targets (jax_fp8norm.simt) are listed too.
EXPORT_DISABLED_CHECKS = tuple(
    jax.export.DisabledSafetyCheck.custom_call(name)
    for targets in (_ffi.TARGETS, _ffi.EMULATED_TARGETS)
    for name in targets.values()
)


def norm_attributes(params: dict, platform: str) -> dict:
    """The custom call's attributes of the norm (src/common/ffi_decode.h, NormAttributes).
    The dtypes are carried by the result types; a calibrated or global scale by its
    operand; how the platform holds FP4 buffers by fp4_layout."""
    return dict(
        eps=np.float32(params["eps"]),
        weight_offset=np.float32(params["weight_offset"]),
        scale_ub=np.float32(params["scale_ub"]),
        group_size=np.int64(params["group_size"] or 0),
        power_of_two_scales=bool(params["power_of_two_scales"]),
        fp4_layout=np.int64(_ffi.fp4_layout(platform)),
        with_inverse_rms=bool(params["with_inverse_rms"]),
        columnwise=bool(params["columnwise"]),
        with_amax=bool(params["with_amax"]),
        per_row_global_scale=bool(params["per_row_global_scale"]),
        # -1: no transform (a mask has at most 32 bits).
        hadamard_mask=np.int64(-1 if params["hadamard_mask"] is None else params["hadamard_mask"]),
    )


def _ffi_lowering(target: str, platform: str):
    """The op's one target for every form: the attributes with_inverse_rms (each row's r
    also returned) and columnwise (then r and the columnwise outputs) say which."""
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, **params):
        if _empty_rows_are_constant(ctx):
            return _lower_empty_rows(ctx, args, params)
        return rule(ctx, *args, **norm_attributes(params, platform))

    return lowering


def _empty_rows_are_constant(ctx) -> bool:
    """Inside shard_map, rows of N == 0 elements are lowered without the kernel: there a
    custom call whose operands from the manual computation's input are all empty does not
    lower (Shardy finds no operand of its body that comes from that input). Every output
    is then empty but per-row scales, which the keywords and a calibrated scale decide.
    Everywhere else the kernel computes them."""
    manual = getattr(ctx.module_context.axis_context, "manual_axes", None)
    return bool(manual) and ctx.avals_in[0].shape[-1] == 0


def _empty_row_scale(params: dict, static_scale) -> jax.Array:
    """The scale of a row of no elements: a calibrated scale rounded to the scale dtype;
    else a zero row's, 0, or the floor of power-of-two scales (2^-127 in e8m0, its byte 0;
    2^-126 in float32 and bfloat16)."""
    dtype = np.dtype(params["scale_dtype"])
    if params["has_static_scale"]:
        return static_scale.astype(dtype).reshape(())
    if dtype == np.dtype(jnp.float8_e8m0fnu):
        return jnp.asarray(np.zeros((), np.uint8).view(dtype))
    if params["power_of_two_scales"]:
        return jnp.asarray(np.asarray(2.0**-126, dtype))
    return jnp.zeros((), dtype)


def _lower_empty_rows(ctx, args, params: dict):
    """The outputs of rows of no elements (_empty_rows_are_constant)."""

    def outputs(*operands):
        add = num_row_operands(len(operands), has_scale_operand(params)) == 2
        avals = dict(zip(result_names(params, add), ctx.avals_out, strict=True))
        # Every output of rows of no elements is empty but per-row scales and r.
        outs = {name: jnp.zeros(a.shape, a.dtype) for name, a in avals.items()}
        scale = _empty_row_scale(params, operands[-1])
        outs["scales"] = jnp.broadcast_to(scale, avals["scales"].shape)
        if "inverse_rms" in avals:
            empty = reference.inverse_rms(jnp.zeros((1, 0), jnp.float32), params["eps"])
            outs["inverse_rms"] = jnp.broadcast_to(empty.reshape(()), avals["inverse_rms"].shape)
        if "global_scales" in avals:
            # A row of no elements has amax 0: the floor.
            floor = jnp.float32(PER_ROW_GLOBAL_FLOOR)
            outs["global_scales"] = jnp.broadcast_to(floor, avals["global_scales"].shape)
        return list(outs.values())

    return mlir.lower_fun(outputs, multiple_results=True)(ctx, *args)


def _twin(*operands, **params):
    """The reference twin of a norm kernel's call, from the kernel primitive's operands."""
    p = NormParams(**params)
    scale_operand = operands[-1] if has_scale_operand(params) else None
    num_rows = num_row_operands(len(operands), scale_operand is not None)
    gamma = operands[num_rows]
    if num_rows == 1:
        h = operands[0].astype(jnp.float32)
        y, scales = reference.quantize_rows(h, gamma, p, scale_operand)
        outs = {"y": y, "scales": scales}
    else:
        call = NormCall(p, scale_operand)
        y, scales, residual_out = reference.add_quantize(operands[0], operands[1], gamma, call)
        outs = {"y": y, "scales": scales, "residual_out": residual_out}
        h = operands[0].astype(jnp.float32) + operands[1].astype(jnp.float32)
    if p.with_inverse_rms:
        outs["inverse_rms"] = reference.inverse_rms(h, p.eps)
    if p.with_amax:
        outs["amax"] = reference.row_amax(h, gamma, p)
    if p.per_row_global_scale:
        outs["global_scales"] = reference.row_global_scales(h, gamma, p)
    if p.columnwise:
        columns = reference.quantize_columns(h, gamma, outs["inverse_rms"], p, scale_operand)
        outs.update(zip(("y_t", "scales_t", "global_scales_t"), columns, strict=False))
    return [outs[name] for name in result_names(params, num_rows == 2)]


def _unreduced_axes(aval) -> frozenset:
    """The mesh axes over which ``aval`` holds partial sums: in its sharding under explicit
    axes, in its manual axis type inside shard_map."""
    spec_axes = getattr(getattr(aval.sharding, "spec", None), "unreduced", None) or frozenset()
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(spec_axes) | frozenset(getattr(manual, "unreduced", None) or ())


def _output_types(avals, scale_operand: bool, scale_name: str) -> dict:
    """What every output's type shares besides its shape and dtype.

    The sharding: x's rows, the last axis whole. Each row needs all of its hidden axis, so
    a sharded one is gathered before the kernel (see _partitioned) and y, residual_out and
    scales come out with it replicated; scales' size-1 axis could not be sharded anyway.
    Under explicit mesh axes these types are checked, so they must say exactly that.
    Inside shard_map: varying over every manual axis any input varies over. Never
    unreduced or reduced: the norm is not linear, so a partial sum is refused."""
    rows = ("x",) if num_row_operands(len(avals), scale_operand) == 1 else ("x", "residual")
    names = (*rows, "gamma", scale_name)
    for name, aval in zip(names, avals, strict=False):
        unreduced = _unreduced_axes(aval)
        if unreduced:
            raise ValueError(
                f"jax_fp8norm: {name} is unreduced over mesh axes {sorted(unreduced)}, and the "
                f"norm needs whole values: reduce it first, e.g. "
                f"jax.sharding.reshard({name}, P(...)) with no unreduced axes (jax.lax.psum "
                "inside shard_map), or pass the partial sums to "
                "allreduce_residual_rms_norm_fp8 inside shard_map"
            )
    x = avals[0]
    types = {"weak_type": False}
    spec = getattr(x.sharding, "spec", None)
    if spec is None:  # no mesh in sight: nothing to declare
        types["sharding"] = x.sharding
    else:
        rows = row_spec(x.sharding, x.ndim) + (None,)
        types["sharding"] = x.sharding.update(
            spec=spec.update(partitions=rows, unreduced=frozenset(), reduced=frozenset())
        )
    manual = getattr(x, "manual_axis_type", None)
    if manual is not None:
        varying = frozenset().union(*(a.manual_axis_type.varying for a in avals))
        types["manual_axis_type"] = type(manual)(
            varying=varying, unreduced=frozenset(), reduced=frozenset()
        )
    return types


def _norm_abstract_eval(*avals, reduced_axes: tuple = (), **params):
    """The outputs' types; ``reduced_axes``: the manual axes the op all-reduces x over, which
    its outputs vary over only where another operand does."""
    x = avals[0]
    scale_operand = has_scale_operand(params)
    scale_name = "global_scale" if params["has_global_scale"] else "static_scale"
    types = _output_types(avals, scale_operand, scale_name)
    if reduced_axes and "manual_axis_type" in types:
        manual = types["manual_axis_type"]
        varying = frozenset(x.manual_axis_type.varying) - frozenset(reduced_axes)
        types["manual_axis_type"] = type(manual)(
            varying=varying.union(*(a.manual_axis_type.varying for a in avals[1:])),
            unreduced=frozenset(),
            reduced=frozenset(),
        )
    recipe = recipe_of(NormParams(**params))
    outs = {
        "y": x.update(shape=x.shape, dtype=np.dtype(params["out_dtype"]), **types),
        "scales": x.update(
            shape=recipe.scales_shape(x.shape), dtype=np.dtype(params["scale_dtype"]), **types
        ),
        # x, residual, gamma: residual_out has the residual's dtype
        "residual_out": x.update(shape=x.shape, dtype=avals[1].dtype, **types),
        "inverse_rms": x.update(shape=x.shape[:-1] + (1,), dtype=np.dtype(np.float32), **types),
        "amax": x.update(shape=x.shape[:-1] + (1,), dtype=np.dtype(np.float32), **types),
        "global_scales": x.update(shape=x.shape[:-1] + (1,), dtype=np.dtype(np.float32), **types),
    }
    if params["columnwise"]:
        # [N, rows] and [N, blocks]: the last axis sharded as _partitioned makes it (where
        # x's first row dimension alone is sharded by whole blocks), else replicated.
        y_t_types = scales_t_types = replicated_types = types
        if "sharding" in types and getattr(x.sharding, "spec", None) is not None:
            axes = columnwise_row_axes(x.sharding, x.shape, params)

            def last_axis(axes):
                spec = x.sharding.spec.update(
                    partitions=(None, axes), unreduced=frozenset(), reduced=frozenset()
                )
                return dict(types, sharding=x.sharding.update(spec=spec))

            y_t_types = last_axis(axes)
            # A static scale's scales_t [N, 1] is replicated.
            scales_t_types = last_axis(None if recipe.static else axes)
            replicated_types = last_axis(None)
        rows = int(np.prod(x.shape[:-1], dtype=np.int64))
        y_t_shape = (x.shape[-1], rows)
        outs["y_t"] = x.update(shape=y_t_shape, dtype=np.dtype(params["out_dtype"]), **y_t_types)
        outs["scales_t"] = x.update(
            shape=recipe.columnwise_scales_shape(x.shape),
            dtype=np.dtype(params["scale_dtype"]),
            **scales_t_types,
        )
        # Each column's global scale, from every row: replicated.
        outs["global_scales_t"] = x.update(
            shape=(x.shape[-1], 1), dtype=np.dtype(np.float32), **replicated_types
        )
    add = num_row_operands(len(avals), scale_operand) == 2
    return [outs[name] for name in result_names(params, add)]


def _norm_batching_rule(prim: Primitive):
    """vmap. Every leading axis of x is a row axis to the kernel, so a batch of x (and
    residual) with one shared gamma (and calibrated scale) is one kernel call over more
    rows. A batch of gammas or of calibrated scales, or the columnwise form (whose blocks
    must not span two elements), becomes a compiled loop (lax.map), one kernel call per
    batch element."""

    def rule(args, dims, **params):
        num_rows = num_row_operands(len(args), has_scale_operand(params))
        # The columnwise form's blocks must not mix batch elements: one call per element.
        if any(d is not None for d in dims[num_rows:]) or params["columnwise"]:
            return map_over_batch(prim, args, dims, **params)
        size = batch_size(args, dims)
        rows = [to_front(a, d, size) for a, d in zip(args[:num_rows], dims[:num_rows], strict=True)]
        outs = prim.bind(*rows, *args[num_rows:], **params)
        return outs, [0] * len(outs)

    return rule


def _no_gradient(op: str):
    """The JVP rule of the FP8 / FP4 ops: JAX gives a cotangent the dtype of its primal, so
    a gradient reaching y would be rounded to FP8 or FP4 (and mostly underflow to zero)."""

    def rule(primals, tangents, **params):
        fmt = "FP4" if np.dtype(params["out_dtype"]) == np.dtype(jnp.float4_e2m1fn) else "FP8"
        raise TypeError(
            f"jax_fp8norm.{op} has no gradient: its output y is {fmt}, and a "
            f"cotangent rounded to {fmt} would be mostly zeros. Differentiate "
            f"jax_fp8norm.{op}_dequantized (the same kernel forward, a "
            "straight-through RMSNorm gradient backward), or stop_gradient the inputs."
        )

    return rule


def _make_norm_primitive(op: str) -> Primitive:
    """The op's primitive, and beneath it the kernel's. The op's lowering wraps the kernel
    in custom_partitioning (sharding under plain jit); its batching rule and gradient rule
    stay on the op, where custom_partitioning would not carry them."""
    name = f"fp8norm_{op}"
    kernel = Primitive(f"{name}_kernel")
    kernel.multiple_results = True
    kernel.def_abstract_eval(_norm_abstract_eval)
    register_lowerings(kernel, op, _ffi_lowering, twin_lowering(op, _twin))

    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(_norm_abstract_eval)
    prim.def_impl(functools.partial(eager_impl, prim))
    mlir.register_lowering(prim, partitioned_lowering(kernel))
    batching.primitive_batchers[prim] = _norm_batching_rule(prim)
    ad.primitive_jvps[prim] = _no_gradient(op)
    # custom_partitioning needs the devices while lowering; jax provides them only for
    # primitives it knows to ask (jax's own custom_partitioning_p is in the same set).
    requires_devices_during_lowering(prim)
    return prim


rms_norm_fp8_p = _make_norm_primitive("rms_norm_fp8")
add_rms_norm_fp8_p = _make_norm_primitive("add_rms_norm_fp8")


def bind_norm(
    call: NormCall,
    rows: tuple,
    gamma,
    *,
    training: bool,
    columnwise: bool,
    amax: bool = False,
    hadamard: int | None = None,
) -> NormOutputs:
    """The outputs of a checked call (``rows``: x, or x and residual, which picks the rms or
    the add primitive). The columnwise form computes each row's r whether or not the
    caller keeps it. ``amax``: each row's amax too (a static scale's call only).
    ``hadamard``: the columnwise outputs' sign mask (check_hadamard), None for none."""
    prim = add_rms_norm_fp8_p if len(rows) == 2 else rms_norm_fp8_p
    params = dataclasses.replace(
        call.params,
        with_inverse_rms=training or columnwise,
        columnwise=columnwise,
        with_amax=amax,
        hadamard_mask=hadamard,
    )
    results = prim.bind(*call.operands(*rows, gamma), **params.as_dict())
    return named_outputs(results, params.as_dict(), add=len(rows) == 2)


# The all-reduce op: x is this device's partial, inside shard_map over the manual axes
# `axes`. Its lowering runs the method _allreduce.select decides: "xla" (XLA's all-reduce,
# then the add kernel) or a one-kernel method.
allreduce_rms_norm_fp8_p = Primitive("fp8norm_allreduce_rms_norm_fp8")
allreduce_rms_norm_fp8_p.multiple_results = True

# Call sites: random, so that one lowered in another process (an exported function) does
# not share a number, and with it a workspace, with one lowered here.
_call_sites = random.Random()


def _allreduce_abstract_eval(*avals, axes, method, reduce_dtype, **params):
    return _norm_abstract_eval(*avals, reduced_axes=axes, **params)


def _device_ordinal(device) -> int:
    """The device's number as its handler sees it (XLA's FFI DeviceOrdinal): the CUDA
    ordinal of a GPU, the id of a virtual CPU device."""
    if device.platform == "gpu" and getattr(device, "local_hardware_id", None) is not None:
        return int(device.local_hardware_id)
    return int(device.id)


def _axis_groups(ctx, axes: tuple) -> np.ndarray | None:
    """[groups, n]: the devices of each group along the one axis of ``axes``, in their
    order on the axis, from the mesh of the enclosing shard_map; None without a mesh of
    concrete devices (an abstract mesh, pmap) or for several axes."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    # An abstract mesh has no devices: its `devices` raises rather than being absent.
    if len(axes) != 1 or not isinstance(mesh, jax.sharding.Mesh):
        return None
    if axes[0] not in mesh.axis_names:
        return None
    ids = np.vectorize(_device_ordinal, otypes=[np.int64])(np.asarray(mesh.devices))
    axis = list(mesh.axis_names).index(axes[0])
    return np.moveaxis(ids, axis, -1).reshape(-1, ids.shape[axis])


def _allreduce_lowering(platform: str | None):
    """``platform``: the backend the rule is registered for; None for the rule of every
    platform without a kernel of ours, where the method is "xla" and the norm the twin."""

    def lowering(ctx, *args, axes, method, reduce_dtype, **params):
        platform_here = platform or lowering_platforms(ctx)[0]
        if platform is None or (platform == "cuda" and not _ffi.built_with_cuda()):
            _fallback.lower_to_twin("allreduce_residual_rms_norm_fp8", lowering_platforms(ctx))
        x = ctx.avals_in[0]
        groups = _axis_groups(ctx, axes)
        chosen = _allreduce.select(
            method,
            platform=platform_here,
            emulating=_ffi.emulating(),
            cuda_built=_ffi.built_with_cuda(),
            processes=jax.process_count(),
            num_devices=None if groups is None else groups.shape[1],
            payload_bytes=int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize,
            axes=axes,
        )
        if _empty_rows_are_constant(ctx):
            return _lower_empty_rows(ctx, args, params)
        if chosen == "xla":

            def xla_method(x, *rest):
                h = _allreduce.xla_sum(x, axes, reduce_dtype)
                return add_rms_norm_fp8_p.bind(h, *rest, **params)

            return mlir.lower_fun(xla_method, multiple_results=True)(ctx, *args)
        target = _ffi.EMULATED_TARGETS if platform_here == "cpu" else _ffi.TARGETS
        rule = jax.ffi.ffi_lowering(target["allreduce_rms_norm_fp8"])
        return rule(
            ctx,
            *args,
            **norm_attributes(params, platform_here),
            call_site=np.int64(_call_sites.getrandbits(62)),
            devices=np.ascontiguousarray(groups.reshape(-1)),
            group_devices=np.int64(groups.shape[1]),
            method=np.int64(_allreduce.method_code(chosen)),
            rows=np.int64(int(np.prod(x.shape[:-1]))),
            hidden=np.int64(x.shape[-1]),
        )

    return lowering


allreduce_rms_norm_fp8_p.def_abstract_eval(_allreduce_abstract_eval)
batching.primitive_batchers[allreduce_rms_norm_fp8_p] = _norm_batching_rule(
    allreduce_rms_norm_fp8_p
)
for _platform in ("cpu", "cuda", None):
    mlir.register_lowering(
        allreduce_rms_norm_fp8_p, _allreduce_lowering(_platform), platform=_platform
    )
ad.primitive_jvps[allreduce_rms_norm_fp8_p] = _no_gradient("allreduce_residual_rms_norm_fp8")

# Element-wise float32 -> float16 / bfloat16 / FP8 rounding with the kernels' own code;
# used by tests to check every rounding boundary on each platform.
round_p = Primitive("fp8norm_round")
round_p.def_abstract_eval(lambda x, *, dtype: x.update(dtype=np.dtype(dtype), weak_type=False))


def _round_lowering(target: str, platform: str):
    rule = jax.ffi.ffi_lowering(target)
    return lambda ctx, x, *, dtype: rule(ctx, x, fp4_layout=np.int64(_ffi.fp4_layout(platform)))


round_p.def_impl(functools.partial(eager_impl, round_p))


def _round_unavailable(ctx, x, *, dtype):
    platforms = lowering_platforms(ctx)
    raise NotImplementedError(f"jax_fp8norm's rounding check has no kernel on {platforms}")


register_lowerings(round_p, "round", _round_lowering, _round_unavailable)
batching.defvectorized(round_p)
