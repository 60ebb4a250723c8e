"""How a norm primitive runs under jit with sharded operands: custom_partitioning with a
Shardy sharding rule, each device computing its own rows (the columnwise form keeping a
row sharding where its blocks allow). The primitives' other rules are in
jax_fp8norm._primitives."""

from __future__ import annotations

import functools

import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.interpreters.mlir import ir
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp8norm import _ffi
from jax_fp8norm._params import NormParams, has_scale_operand, num_row_operands, result_names
from jax_fp8norm.recipes import recipe_of


def row_spec(sharding, rank: int) -> tuple:
    """The mesh axes of the row dimensions of a rank-``rank`` operand's sharding."""
    spec = tuple(getattr(sharding, "spec", ()))[: rank - 1]
    return spec + (None,) * (rank - 1 - len(spec))


def columnwise_row_axes(sharding, shape: tuple, params: dict):
    """The mesh axes (a name or a tuple of names) the columnwise form keeps x's rows, and
    y_t's and scales_t's last axis, sharded over; None when the rows must be gathered.

    ``y_t [N, rows]`` flattens the row dimensions in row-major order, so a device's rows
    are one contiguous run of y_t's columns only when the first row dimension alone is
    sharded; and a block of ``group_size`` rows must not span two devices. Then each
    device's call makes its own rows' part of y_t and scales_t, the same bits as one call
    over all rows (each block depends on its own rows alone)."""
    rows = row_spec(sharding, len(shape))
    if not rows or rows[0] is None or any(axis is not None for axis in rows[1:]):
        return None
    mesh = getattr(sharding, "mesh", None)
    names = rows[0] if isinstance(rows[0], tuple) else (rows[0],)
    shards = int(np.prod([mesh.shape[name] for name in names])) if mesh is not None else 0
    if shards < 1 or shape[0] % shards:
        return None
    local_rows = shape[0] // shards * int(np.prod(shape[1:-1], dtype=np.int64))
    recipe = recipe_of(NormParams(**params))
    if not recipe.static and (recipe.block is None or local_rows % recipe.block):
        return None
    return rows[0]


def blocks_fit_devices(aval, num_devices, params: dict) -> bool:
    """Whether the columnwise form of x (``aval``) may be partitioned: its sharding fixed by
    Explicit mesh axes (the rule then keeps whole blocks on each device or gathers the
    rows), or its rows a multiple of the block times the device count, so that no
    sharding XLA may choose splits a block between devices.

    Otherwise XLA, propagating the sharding of a consumer of y_t or scales_t that reshapes
    the rows into blocks (the layer's weight gradient), may give scales_t a part of a mesh
    axis, which custom_partitioning cannot take (it fails with an IndivisibleError before
    the rule runs). Such a call is lowered unpartitioned: XLA gathers its operands and runs
    it on all the rows, the bits of the unsharded call. The choice is made while lowering,
    before XLA picks the shardings, so a call whose rows would be whole blocks over the
    part of the mesh that splits them is gathered too. Never with per-row global scales:
    each column's takes every row, which one device's rows alone would not give."""
    if params.get("per_row_global_scale"):
        return False
    recipe = recipe_of(NormParams(**params))
    if recipe.static or recipe.block is None or not isinstance(num_devices, int):
        return True
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    kinds = tuple(getattr(mesh, "axis_types", ()))
    if kinds and all(kind == AxisType.Explicit for kind in kinds):
        return True
    shape = tuple(aval.shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows % (recipe.block * num_devices) == 0


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
    columnwise_row_axes allows, with y_t and scales_t sharded along their last axis by the
    same mesh axes (a calibrated scale's scales_t [N, 1] replicated), and gathers the rows
    otherwise. ``columns``: the columnwise form's (x's shape, the device count or None),
    which its sharding rule depends on; None for the other forms, whose rule does not."""
    kwargs = dict(params)
    num_rows = num_row_operands(num_operands, has_scale_operand(kwargs))
    num_shared = num_operands - num_rows
    recipe = recipe_of(NormParams(**kwargs))
    # The rowwise results (y, scales[, residual_out][, inverse_rms][, amax]), then the
    # columnwise.
    names = result_names(kwargs, add=num_rows == 2)
    num_results = len([name for name in names if name not in ("y_t", "scales_t")])
    columnwise = kwargs["columnwise"]

    @custom_partitioning
    def call(*args):
        return tuple(kernel.bind(*args, **kwargs))

    def row_axes(arg_shapes):
        """The rows' spec (x's row dimensions) and, columnwise, y_t's mesh axes."""
        x = arg_shapes[0]
        if not columnwise:
            return row_spec(x.sharding, len(x.shape)), None
        axes = columnwise_row_axes(x.sharding, x.shape, kwargs)
        return (axes,) + (None,) * (len(x.shape) - 2), axes

    def result_shardings(mesh, rows, columns_axes):
        outs = _result_shardings(mesh, rows, num_results)
        if columnwise:
            blocks = None if recipe.static else columns_axes
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
        group = 1 if recipe.static else recipe.block
        dims = list(names)
        block_names = None
        # Only where every mesh axis divides the rows of blocks (the device count unknown,
        # as inside shard_map: never): otherwise the partitioner may split an axis between
        # the two factors, which custom_partitioning cannot take.
        devices = num_devices if isinstance(num_devices, int) else 0
        if not recipe.static and devices and shape[-2] % (group * devices) == 0:
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
        results += f", {row_dims} j" * (1 + int(kwargs["with_amax"]))
        results += f", n {flat_rows}, n {blocks}"
    else:
        rows = "... n, " * num_rows
        results = "... n, ... k" + (", ... n" if num_rows == 2 else "")
        results += ", ... j" if kwargs["with_inverse_rms"] else ""
        results += ", ... j" if kwargs["with_amax"] else ""
        results += ", ... j" if kwargs["per_row_global_scale"] else ""
    shared = "n" + (", s" if num_shared == 2 else "")
    call.def_partition(
        partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{rows}{shared} -> {results}",
        need_replication_factors=("n",),
        **factor_sizes,
    )
    return call


def requires_devices_during_lowering(prim: Primitive) -> None:
    try:
        from jax._src import dispatch
    except ImportError:  # without it the lowering falls back to the unpartitioned call
        return
    registry = getattr(dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.add(prim)


def partitioned_lowering(kernel: Primitive):
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
        if (
            num_devices == 1
            or unassigned
            or for_export
            or one_row
            or (
                params["columnwise"]
                and not blocks_fit_devices(ctx.avals_in[0], num_devices, params)
            )
        ):
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
