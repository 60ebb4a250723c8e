"""JAX primitives of the ops, with every rule of each in this file: abstract evaluation (the
shape rule), lowering to the XLA FFI custom calls per platform, partitioning under jit
(custom_partitioning with a Shardy sharding rule), batching (vmap) and differentiation
(the FP8 / FP4 outputs refuse a JVP; jax_fp8norm.autodiff holds the differentiable twins).
Where this build has no kernel for a platform, the kernels' primitives lower to their
reference twins (jax_fp8norm._fallback)."""

from __future__ import annotations

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters.mlir import ir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp8norm import _allreduce, _fallback, _ffi, reference
from jax_fp8norm._params import NormCall, NormParams
from jax_fp8norm.recipes import scales_per_row

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


@functools.cache
def _jitted_bind(prim: Primitive, params: tuple, emulating: bool) -> callable:
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def eager_impl(prim: Primitive, *args, **params):
    """Eager calls compile the primitive once per set of parameters (and shapes), and per
    kind of kernel the CPU backend runs (native or emulated)."""
    return _jitted_bind(prim, tuple(sorted(params.items())), _ffi.emulating())(*args)


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
    )


def _ffi_lowering(target: str, platform: str):
    """The op's target, its training form's ("<target>_training"), which also returns each
    row's r, or its columnwise form's ("<target>_columnwise"), r and the columnwise
    outputs."""
    rules = {
        suffix: jax.ffi.ffi_lowering(target + suffix) for suffix in ("", "_training", "_columnwise")
    }

    def lowering(ctx, *args, **params):
        if _empty_rows_are_constant(ctx):
            return _lower_empty_rows(ctx, args, params)
        rule = rules[_form_suffix(params)]
        return rule(ctx, *args, **norm_attributes(params, platform))

    return lowering


def _form_suffix(params: dict) -> str:
    if params["columnwise"]:
        return "_columnwise"
    return "_training" if params["with_inverse_rms"] else ""


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
        y, scales, *rest = ctx.avals_out
        # The columnwise outputs of rows of no elements are empty ([0, rows] and [0, k]).
        columns = [rest.pop(), rest.pop()][::-1] if params["columnwise"] else []
        inverse_rms = rest.pop() if params["with_inverse_rms"] else None
        scale = _empty_row_scale(params, operands[-1])
        outs = [
            jnp.zeros(y.shape, y.dtype),
            jnp.broadcast_to(scale, scales.shape),
            *(jnp.zeros(r.shape, r.dtype) for r in rest),
        ]
        if inverse_rms is not None:
            empty = reference.inverse_rms(jnp.zeros((1, 0), jnp.float32), params["eps"])
            outs.append(jnp.broadcast_to(empty.reshape(()), inverse_rms.shape))
        return outs + [jnp.zeros(c.shape, c.dtype) for c in columns]

    return mlir.lower_fun(outputs, multiple_results=True)(ctx, *args)


def lowering_platforms(ctx) -> tuple[str, ...]:
    """The platforms a lowering rule lowers for: one, or those sharing this rule when
    jax.export lowers for several."""
    return tuple(getattr(ctx, "platforms", None) or ctx.module_context.platforms)


def _twin(*operands, **params):
    """The reference twin of a norm kernel's call, from the kernel primitive's operands."""
    p = NormParams(**params)
    scale_operand = operands[-1] if _has_scale_operand(params) else None
    num_rows = _num_row_operands(len(operands), scale_operand is not None)
    gamma = operands[num_rows]
    if num_rows == 1:
        h = operands[0].astype(jnp.float32)
        outs = reference.quantize_rows(h, gamma, p, scale_operand)
    else:
        outs = reference.add_quantize(operands[0], operands[1], gamma, NormCall(p, scale_operand))
        h = operands[0].astype(jnp.float32) + operands[1].astype(jnp.float32)
    if p.with_inverse_rms:
        r = reference.inverse_rms(h, p.eps)
        outs = (*outs, r)
    if p.columnwise:
        outs = (*outs, *reference.quantize_columns(h, gamma, r, p, scale_operand))
    return outs


def twin_lowering(op: str, twin=None):
    """Where this build has no kernel for the platform: the op's reference twin (``twin``,
    a function of the primitive's operands and parameters; the norm's by default)."""
    lower = mlir.lower_fun(twin or _twin, multiple_results=True)

    def lowering(ctx, *args, **params):
        _fallback.lower_to_twin(op, lowering_platforms(ctx))
        return lower(ctx, *args, **params)

    return lowering


def _cuda_lowering(kernel_rule, fallback_rule):
    """The CUDA kernels where this build has them, else the twin; decided when lowering."""

    def lowering(ctx, *args, **params):
        rule = kernel_rule if _ffi.built_with_cuda() else fallback_rule
        return rule(ctx, *args, **params)

    return lowering


def _unreduced_axes(aval) -> frozenset:
    """The mesh axes over which ``aval`` holds partial sums: in its sharding under explicit
    axes, in its manual axis type inside shard_map."""
    spec_axes = getattr(getattr(aval.sharding, "spec", None), "unreduced", None) or frozenset()
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(spec_axes) | frozenset(getattr(manual, "unreduced", None) or ())


def _has_scale_operand(params: dict) -> bool:
    """Whether a calibrated scale or NVFP4's global scale follows gamma."""
    return bool(params["has_static_scale"] or params["has_global_scale"])


def _num_row_operands(num_operands: int, scale_operand: bool) -> int:
    """x (and residual): the operands before gamma (and the scale operand)."""
    return num_operands - 1 - int(scale_operand)


def _output_types(avals, scale_operand: bool, scale_name: str) -> dict:
    """What every output's type shares besides its shape and dtype.

    The sharding: x's rows, the last axis whole. Each row needs all of its hidden axis, so
    a sharded one is gathered before the kernel (see _partitioned) and y, residual_out and
    scales come out with it replicated; scales' size-1 axis could not be sharded anyway.
    Under explicit mesh axes these types are checked, so they must say exactly that.
    Inside shard_map: varying over every manual axis any input varies over. Never
    unreduced or reduced: the norm is not linear, so a partial sum is refused."""
    rows = ("x",) if _num_row_operands(len(avals), scale_operand) == 1 else ("x", "residual")
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
        rows = _row_spec(x.sharding, x.ndim) + (None,)
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
    scale_operand = _has_scale_operand(params)
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
    n = x.shape[-1]
    groups = scales_per_row(n, params["group_size"])
    outs = [
        x.update(shape=x.shape, dtype=np.dtype(params["out_dtype"]), **types),
        x.update(shape=x.shape[:-1] + (groups,), dtype=np.dtype(params["scale_dtype"]), **types),
    ]
    if _num_row_operands(len(avals), scale_operand) == 2:
        # x, residual, gamma: residual_out has the residual's dtype
        outs.append(x.update(shape=x.shape, dtype=avals[1].dtype, **types))
    if params["with_inverse_rms"]:
        outs.append(x.update(shape=x.shape[:-1] + (1,), dtype=np.dtype(np.float32), **types))
    if params["columnwise"]:
        # [N, rows] and [N, blocks]: the last axis sharded as _partitioned makes it (where
        # x's first row dimension alone is sharded by whole blocks), else replicated.
        p = NormParams(**params)
        y_t_types = scales_t_types = types
        if "sharding" in types and getattr(x.sharding, "spec", None) is not None:
            axes = _columnwise_row_axes(x.sharding, x.shape, params)

            def last_axis(axes):
                spec = x.sharding.spec.update(
                    partitions=(None, axes), unreduced=frozenset(), reduced=frozenset()
                )
                return dict(types, sharding=x.sharding.update(spec=spec))

            y_t_types = last_axis(axes)
            scales_t_types = last_axis(None if p.has_static_scale else axes)
        rows = int(np.prod(x.shape[:-1], dtype=np.int64))
        blocks = 1 if p.has_static_scale else rows // p.group_size
        outs.append(x.update(shape=(n, rows), dtype=np.dtype(params["out_dtype"]), **y_t_types))
        outs.append(
            x.update(shape=(n, blocks), dtype=np.dtype(params["scale_dtype"]), **scales_t_types)
        )
    return outs


def _cpu_lowering(op: str, make_rule):
    """The CPU kernels, or the emulated CUDA ones while the FFI layer's switch is on."""
    rules = {
        target: make_rule(target, "cpu") for target in (_ffi.TARGETS[op], _ffi.EMULATED_TARGETS[op])
    }

    def lowering(ctx, *args, **params):
        return rules[_ffi.cpu_target(op)](ctx, *args, **params)

    return lowering


def _register_lowerings(prim: Primitive, op: str, make_rule, twin) -> None:
    """A native target's name is the same on every platform, only the handler behind it
    differs; on the CPU the FFI layer's switch may pick the emulated target instead. Every
    other platform (and CUDA in a build without its kernels) gets ``twin``."""
    mlir.register_lowering(prim, _cpu_lowering(op, make_rule), platform="cpu")
    mlir.register_lowering(
        prim, _cuda_lowering(make_rule(_ffi.TARGETS[op], "cuda"), twin), platform="cuda"
    )
    mlir.register_lowering(prim, twin)


def _to_front(value, dim, size):
    """The batch axis first: moved there, or made by broadcasting an unbatched operand."""
    if dim is None:
        return jnp.broadcast_to(value, (size, *value.shape))
    return jnp.moveaxis(value, dim, 0)


def _norm_batching_rule(prim: Primitive):
    """vmap. Every leading axis of x is a row axis to the kernel, so a batch of x (and
    residual) with one shared gamma (and calibrated scale) is one kernel call over more
    rows. A batch of gammas or of calibrated scales, or the columnwise form (whose blocks
    must not span two elements), becomes a compiled loop (lax.map), one kernel call per
    batch element."""

    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
        num_rows = _num_row_operands(len(args), _has_scale_operand(params))
        rows = [
            _to_front(a, d, size) for a, d in zip(args[:num_rows], dims[:num_rows], strict=True)
        ]
        shared, shared_dims = args[num_rows:], dims[num_rows:]
        # The columnwise form's blocks must not mix batch elements: one call per element.
        if all(d is None for d in shared_dims) and not params["columnwise"]:
            outs = prim.bind(*rows, *shared, **params)
        else:
            batched = [_to_front(a, d, size) for a, d in zip(shared, shared_dims, strict=True)]
            outs = jax.lax.map(lambda a: prim.bind(*a, **params), (*rows, *batched))
        return outs, [0] * len(outs)

    return rule


def _row_spec(sharding, rank: int) -> tuple:
    """The mesh axes of the row dimensions of a rank-``rank`` operand's sharding."""
    spec = tuple(getattr(sharding, "spec", ()))[: rank - 1]
    return spec + (None,) * (rank - 1 - len(spec))


def _columnwise_row_axes(sharding, shape: tuple, params: dict):
    """The mesh axes (a name or a tuple of names) the columnwise form keeps x's rows, and
    y_t's and scales_t's last axis, sharded over; None when the rows must be gathered.

    ``y_t [N, rows]`` flattens the row dimensions in row-major order, so a device's rows
    are one contiguous run of y_t's columns only when the first row dimension alone is
    sharded; and a block of ``group_size`` rows must not span two devices. Then each
    device's call makes its own rows' part of y_t and scales_t, the same bits as one call
    over all rows (each block depends on its own rows alone)."""
    rows = _row_spec(sharding, len(shape))
    if not rows or rows[0] is None or any(axis is not None for axis in rows[1:]):
        return None
    mesh = getattr(sharding, "mesh", None)
    names = rows[0] if isinstance(rows[0], tuple) else (rows[0],)
    shards = int(np.prod([mesh.shape[name] for name in names])) if mesh is not None else 0
    if shards < 1 or shape[0] % shards:
        return None
    local_rows = shape[0] // shards * int(np.prod(shape[1:-1], dtype=np.int64))
    group = params["group_size"]
    if not params["has_static_scale"] and (group is None or local_rows % group):
        return None
    return rows[0]


def _result_shardings(mesh, rows: tuple, num_results: int):
    # y and residual_out [..., N] and scales [..., 1]: rows as x's, the last axis whole.
    return tuple(NamedSharding(mesh, P(*rows, None)) for _ in range(num_results))


@functools.cache
def _partitioned(kernel: Primitive, params: tuple, num_operands: int, columns: tuple | None):
    """kernel.bind wrapped in custom_partitioning: under jit with sharded inputs, XLA runs
    it on each device's rows (no all-gather when rows are sharded: per-group scales
    [..., N // G] keep the rows' sharding too); a hidden axis that is sharded is gathered
    first, since each row needs all of it. gamma and a calibrated scale are replicated.
    The columnwise form keeps x's first row dimension sharded where
    _columnwise_row_axes allows, with y_t and scales_t sharded along their last axis by the
    same mesh axes (a calibrated scale's scales_t [N, 1] replicated), and gathers the rows
    otherwise. ``columns``: the columnwise form's (x's shape, the device count or None),
    which its sharding rule depends on; None for the other forms, whose rule does not."""
    kwargs = dict(params)
    num_rows = _num_row_operands(num_operands, _has_scale_operand(kwargs))
    num_shared = num_operands - num_rows
    # rms: (y, scales); add: (y, scales, residual_out); the training forms: then r
    num_results = num_rows + 1 + int(bool(kwargs["with_inverse_rms"]))
    columnwise = kwargs["columnwise"]

    @custom_partitioning
    def call(*args):
        return tuple(kernel.bind(*args, **kwargs))

    def row_axes(arg_shapes):
        """The rows' spec (x's row dimensions) and, columnwise, y_t's mesh axes."""
        x = arg_shapes[0]
        if not columnwise:
            return _row_spec(x.sharding, len(x.shape)), None
        axes = _columnwise_row_axes(x.sharding, x.shape, kwargs)
        return (axes,) + (None,) * (len(x.shape) - 2), axes

    def result_shardings(mesh, rows, columns_axes):
        outs = _result_shardings(mesh, rows, num_results)
        if columnwise:
            blocks = None if kwargs["has_static_scale"] else columns_axes
            outs += tuple(NamedSharding(mesh, P(None, axes)) for axes in (columns_axes, blocks))
        return outs

    def partition(mesh, arg_shapes, result_shape):
        rows, columns_axes = row_axes(arg_shapes)
        row_operands = [NamedSharding(mesh, P(*rows, None))] * num_rows
        arg_shardings = (*row_operands, *[NamedSharding(mesh, P(None))] * num_shared)
        lower = lambda *args: tuple(kernel.bind(*args, **kwargs))  # noqa: E731
        return mesh, lower, result_shardings(mesh, rows, columns_axes), arg_shardings

    def infer(mesh, arg_shapes, result_shape):
        return result_shardings(mesh, *row_axes(arg_shapes))

    factor_sizes = {}
    if columnwise:
        shape, num_devices = columns
        # The row dimensions by name, y_t's last axis their product (row-major). Where the
        # last row dimension is a multiple of the block, it is (rows of blocks, block
        # rows), and scales_t's last axis is the product of the rows of blocks; otherwise
        # a factor of its own, which the rows' sharding does not reach (XLA then gathers
        # scales_t, 1/32 of y_t's bytes or less).
        names = [f"r{chr(ord('a') + i)}" for i in range(len(shape) - 1)]
        group = 1 if kwargs["has_static_scale"] else kwargs["group_size"]
        dims = list(names)
        block_names = None
        # Only where every mesh axis divides the rows of blocks (the device count unknown,
        # as inside shard_map: never): otherwise the partitioner may split an axis between
        # the two factors, which custom_partitioning cannot take.
        devices = num_devices if isinstance(num_devices, int) else 0
        if not kwargs["has_static_scale"] and devices and shape[-2] % (group * devices) == 0:
            dims[-1] = f"({names[-1]} g)"
            factor_sizes["g"] = group
            if len(names) > 1:  # a factor that appears only in compound dimensions
                factor_sizes[names[-1]] = shape[-2] // group
            block_names = names
        row_dims = " ".join(dims)
        rows = f"{row_dims} n, " * num_rows
        results = f"{row_dims} n, {row_dims} k" + (f", {row_dims} n" if num_rows == 2 else "")
        flat = names + (["g"] if block_names is not None else [])
        flat_rows = flat[0] if len(flat) == 1 else f"({' '.join(flat)})"
        if block_names is None:
            blocks = "blocks"
        else:
            blocks = names[0] if len(names) == 1 else f"({' '.join(names)})"
        results += f", {row_dims} j, n {flat_rows}, n {blocks}"
    else:
        rows = "... n, " * num_rows
        results = "... n, ... k" + (", ... n" if num_rows == 2 else "")
        results += ", ... j" if kwargs["with_inverse_rms"] else ""
    shared = "n" + (", s" if num_shared == 2 else "")
    call.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{rows}{shared} -> {results}",
        need_replication_factors=("n",),
        **factor_sizes,
    )
    return call


def _requires_devices_during_lowering(prim: Primitive) -> None:
    try:
        from jax._src import dispatch
    except ImportError:  # without it the lowering falls back to the unpartitioned call
        return
    registry = getattr(dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.add(prim)


def _partitioned_lowering(kernel: Primitive):
    def lowering(ctx, *args, **params):
        # One device, devices not yet assigned (custom_partitioning needs them), or
        # lowering for jax.export (which cannot serialise custom_partitioning's host
        # callback): the kernel's call alone, which XLA runs unpartitioned.
        axis_context = ctx.module_context.axis_context
        num_devices = getattr(axis_context, "num_devices", None)
        unassigned = hasattr(axis_context, "device_assignment") and (
            axis_context.device_assignment is None
        )
        lowering_parameters = getattr(ctx.module_context, "lowering_parameters", None)
        for_export = getattr(lowering_parameters, "for_export", False)
        shape = tuple(ctx.avals_in[0].shape)
        # A columnwise call of one row (x of rank 1) has no row axis to shard.
        one_row = params["columnwise"] and len(shape) < 2
        if num_devices == 1 or unassigned or for_export or one_row:
            call = functools.partial(kernel.bind, **params)
            return mlir.lower_fun(call, multiple_results=True)(ctx, *args)
        key = tuple(sorted(params.items()))
        columns = (shape, num_devices) if params["columnwise"] else None
        call = _partitioned(kernel, key, len(args), columns)
        results = mlir.lower_fun(call, multiple_results=True)(ctx, *args)
        kernels = "emulated" if _ffi.emulating() else "native"
        _describe_partitioned_call(results, f"{kernel.name} {kernels} {key}")
        return results

    return lowering


PARTITIONED_CALL_ATTRIBUTE = "fp8norm_call"


def _describe_partitioned_call(results, description: str) -> None:
    """custom_partitioning's call carries only the address of its Python callbacks, not the
    op's settings or kernel, so two calls that differ only there lower to the same text.
    jax's persistent compilation cache keys on that text: once the first call's callbacks
    are freed and their address reused, it would hand the second the first's program. The
    settings, as a frontend attribute of the call, make the texts differ."""
    op = results[0].owner  # the call's results are all of one op
    target = op.attributes["call_target_name"] if "call_target_name" in op.attributes else None
    if target is not None and ir.StringAttr(target).value == "CustomSPMDPartitioning":
        op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
            {PARTITIONED_CALL_ATTRIBUTE: ir.StringAttr.get(description)}
        )


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
    _register_lowerings(kernel, op, _ffi_lowering, twin_lowering(op))

    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(_norm_abstract_eval)
    prim.def_impl(functools.partial(eager_impl, prim))
    mlir.register_lowering(prim, _partitioned_lowering(kernel))
    batching.primitive_batchers[prim] = _norm_batching_rule(prim)
    ad.primitive_jvps[prim] = _no_gradient(op)
    # custom_partitioning needs the devices while lowering; jax provides them only for
    # primitives it knows to ask (jax's own custom_partitioning_p is in the same set).
    _requires_devices_during_lowering(prim)
    return prim


rms_norm_fp8_p = _make_norm_primitive("rms_norm_fp8")
add_rms_norm_fp8_p = _make_norm_primitive("add_rms_norm_fp8")


def bind_norm(
    prim: Primitive, call: NormCall, rows: tuple, gamma, *, training: bool, columnwise: bool
) -> tuple:
    """The outputs of an op's call (``prim``: the norm's primitive; ``rows``: x, or x and
    residual): (y, scales[, residual_out][, inverse_rms][, y_t, scales_t]). The columnwise
    form computes each row's r whether or not the caller keeps it."""
    params = dataclasses.replace(
        call.params, with_inverse_rms=training or columnwise, columnwise=columnwise
    )
    outs = tuple(prim.bind(*call.operands(*rows, gamma), **params.as_dict()))
    if columnwise and not training:
        return (*outs[:-3], *outs[-2:])
    return outs


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


_register_lowerings(round_p, "round", _round_lowering, _round_unavailable)
batching.defvectorized(round_p)
