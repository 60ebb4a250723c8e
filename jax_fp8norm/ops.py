"""The fused ops: RMSNorm with FP8 quantisation (dynamic scales per row or per group, or a
calibrated static scale) or FP4 quantisation (NVFP4, MXFP4), as XLA FFI custom calls.

Each public function validates its arguments (TypeError / ValueError naming the
argument), rounds the constants as docs/spec.md says and binds a JAX primitive that
lowers to one custom call on the CPU or CUDA backend.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp8norm._allreduce import check_method, xla_sum
from jax_fp8norm._checks import (
    check_axis_name,
    check_columnwise,
    check_global_scale,
    check_hadamard,
    check_reduce_dtype,
    check_return_amax,
    check_static_scale,
    validate,
)
from jax_fp8norm._dtypes import FLOAT_DTYPES, OUT_DTYPES
from jax_fp8norm._params import AllReduceKeywords, NormKeywords, named_outputs
from jax_fp8norm._primitives import (
    allreduce_rms_norm_fp8_p,
    bind_norm,
    round_p,
)
from jax_fp8norm._shapes import shaped_call
from jax_fp8norm._signatures import norm_keywords


def checked_norm(
    rows: tuple,
    gamma,
    keywords: dict,
    *,
    columnwise,
    training: bool,
    return_amax=False,
    reduction_axes=-1,
    out_sharding=None,
    hadamard=None,
):
    """Every norm op's body: the checks (TypeError / ValueError naming the argument), then
    the primitive. ``rows``: x, or x and residual. Returns the checked call's parameters
    and its outputs (NormOutputs).

    The ops take framework shapes (jax_fp8norm._shapes: gamma None or broadcast,
    reduction_axes, out_sharding); the training forms (``training``) take the kernels'
    own, gamma ``[N]`` and one normalised axis, since their backward takes the forward's
    arrays as they are."""
    if training:
        call = validate(rows[0], gamma, *rows[1:], **keywords)
        shaped = None
    else:
        shaped = shaped_call(
            rows, gamma, keywords, reduction_axes=reduction_axes, out_sharding=out_sharding
        )
        call, rows, gamma = shaped.call, shaped.rows, shaped.gamma
    columnwise = check_columnwise(columnwise, call.params, rows[0].shape)
    amax = check_return_amax(return_amax, call.params)
    mask = check_hadamard(hadamard, call.params, columnwise)
    outs = bind_norm(
        call, rows, gamma, training=training, columnwise=columnwise, amax=amax, hadamard=mask
    )
    return call.params, outs if shaped is None else shaped.finish(outs)


@norm_keywords
def rms_norm_fp8(
    x: jax.Array,
    gamma: jax.Array | None = None,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    return_amax: bool = False,
    reduction_axes: int | tuple[int, ...] = -1,
    out_sharding=None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """RMSNorm of each row of ``x``, quantised to FP8 with dynamic scales per row (or per
    group of ``group_size`` elements), or with one calibrated ``static_scale``; or to FP4
    (``out_dtype=jnp.float4_e2m1fn``): NVFP4 with ``float8_e4m3fn`` scales per group and a
    ``global_scale``, MXFP4 with ``float8_e8m0fnu`` ones.

    Args:
      x: ``[..., N]`` float32, float16 or bfloat16, rank >= 1; each of the
        ``prod(x.shape[:-1])`` rows is normalised on its own.
      {gamma}
      columnwise: also return ``n`` quantised along the rows, for a GEMM that contracts
        over them (the weight gradient ``x^T dy``): ``y_t`` ``[N, rows]`` in ``out_dtype``
        and ``scales_t`` ``[N, rows // group_size]``, blocks of ``group_size`` rows with
        the recipe's scale rule (``[N, 1]`` and the codes transposed for a
        ``static_scale``). Needs block scales or a static scale, and rows a multiple of
        ``group_size``.
      hadamard: the columnwise outputs only (FP4, blocks of 16 or 32 rows): each column's
        block of ``d`` rows of ``n`` becomes ``M n`` (``M = H_d S``, the unnormalised
        Walsh-Hadamard butterfly in float32 after the signs ``S``) before it is
        quantised, for a weight-gradient GEMM whose other operand is transformed alike
        (its float32 result times ``1 / d``). True: the recipe's fixed signs; an int: a
        sign mask (bit ``i`` negates row ``i`` of a block; 0: every sign +1). None or
        False: no transform.
      return_amax: also return each row's amax, ``max_j |n_j|`` before any clip, float32
        ``[..., 1]``, for delayed scaling (the next calibrated scale). Only with a
        ``static_scale``; NaN for a row whose outputs are NaN.
      {reduction_axes}
      {out_sharding}
      {keywords}

    Returns:
      ``(y, scales)``: ``y`` is ``[..., N]`` in ``out_dtype``; ``scales`` is
      ``[..., N // group_size]`` (``[..., 1]`` per row) in ``scale_dtype``.
      ``f32(y) * repeat(f32(scales), N // scales.shape[-1], axis=-1)`` dequantises
      (times ``global_scale`` for NVFP4: :func:`jax_fp8norm.dequantize`). With
      ``columnwise``: ``(y, scales, y_t, scales_t)``; ``amax`` after ``scales`` with
      ``return_amax``. With ``global_scale="per_row"``: each row's global scale,
      ``global_scales`` float32 ``[..., 1]``, after ``scales``, and with ``columnwise``
      each column's, ``global_scales_t`` ``[N, 1]``, after ``scales_t``.
    """
    _, outs = checked_norm(
        (x,),
        gamma,
        keywords,
        columnwise=columnwise,
        training=False,
        return_amax=return_amax,
        reduction_axes=reduction_axes,
        out_sharding=out_sharding,
        hadamard=hadamard,
    )
    return outs.returned(training=False)


@norm_keywords
def add_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array | None = None,
    *,
    columnwise: bool = False,
    hadamard: bool | int | None = None,
    return_amax: bool = False,
    reduction_axes: int | tuple[int, ...] = -1,
    out_sharding=None,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """``h = x + residual`` in float32, then :func:`rms_norm_fp8` of ``h``, in one pass.

    Args:
      x, residual: ``[..., N]``, the same shape and dtype (float32, float16 or bfloat16).
      gamma, columnwise, hadamard, return_amax, reduction_axes, out_sharding: as for
        :func:`rms_norm_fp8`.
      {keywords}

    Returns:
      ``(y, scales, residual_out)``: ``y`` and ``scales`` as for :func:`rms_norm_fp8`,
      computed from the unrounded float32 ``h``; ``residual_out`` is ``h`` rounded to
      ``x.dtype`` (the next layer's residual). With ``columnwise``:
      ``(y, scales, residual_out, y_t, scales_t)``; ``amax`` after ``residual_out`` with
      ``return_amax``; ``global_scales`` (and ``global_scales_t``) as for
      :func:`rms_norm_fp8`, after ``residual_out``.
    """
    _, outs = checked_norm(
        (x, residual),
        gamma,
        keywords,
        columnwise=columnwise,
        training=False,
        return_amax=return_amax,
        reduction_axes=reduction_axes,
        out_sharding=out_sharding,
        hadamard=hadamard,
    )
    return outs.returned(training=False)


@norm_keywords
def allreduce_residual_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array | None = None,
    *,
    axis_name,
    reduce_dtype=None,
    method: str = "auto",
    columnwise: bool = False,
    reduction_axes: int | tuple[int, ...] = -1,
    **keywords: Unpack[NormKeywords],
) -> tuple[jax.Array, ...]:
    """Tensor-parallel all-reduce of partial sums, then :func:`add_rms_norm_fp8`, fused.

    Call inside ``jax.shard_map`` (or wherever ``axis_name`` is bound). With
    ``method="xla"``, ``h`` is the sum of ``x`` over the axis, an XLA all-reduce (NCCL on
    GPUs); then one kernel adds the residual, normalises and quantises, reading ``h`` once
    and writing ``residual_out`` in the same pass. ``"one_shot"`` and ``"two_shot"`` do all
    of it in one kernel per device that reads its peers' partials directly, summing them
    in float32 in the order of the axis (docs/spec.md, "One-kernel all-reduce"); ``"auto"``
    picks among the three (``"xla"`` wherever the one-kernel path cannot run). The outputs
    are identical on every device of the axis.

    Args:
      x: ``[..., N]`` this device's partial sum (e.g. a row-parallel matmul's output),
        float32, float16 or bfloat16.
      residual: ``[..., N]``, the dtype of ``x``, the same on every device.
      gamma: as for :func:`rms_norm_fp8`, the same on every device.
      axis_name: the mesh axis (or a tuple of axes) to reduce over.
      reduce_dtype: None to all-reduce in ``x.dtype`` (the bytes a tensor-parallel layer
        already moves), or ``jnp.float32`` to all-reduce, and add the residual, in
        float32. The one-kernel methods always sum in float32.
      method: ``"auto"``, ``"xla"``, ``"one_shot"`` or ``"two_shot"``; an explicit
        one-kernel method that cannot run here (the CPU backend outside the SIMT
        emulation, several processes, more than 8 devices, a tuple of axes) is a
        ValueError that says why.
      columnwise: as for :func:`rms_norm_fp8` (the rows are the same on every device, and
        so are ``y_t`` and ``scales_t``). The call then sums with ``"xla"`` (``"auto"``
        takes it; a one-kernel method is a ValueError): the columnwise pass reads the
        float32 sum, which the one-kernel methods keep in their registers.
      reduction_axes: as for :func:`rms_norm_fp8`.
      {keywords}

    Returns:
      ``(y, scales, residual_out)`` as for :func:`add_rms_norm_fp8`; ``residual_out``
      has the residual's dtype. With ``columnwise``: then ``y_t, scales_t``. With
      ``global_scale="per_row"`` (which sums with ``"xla"``), ``global_scales`` after
      ``residual_out`` (and ``global_scales_t`` after ``scales_t``).
    """
    shaped = shaped_call((x, residual), gamma, keywords, reduction_axes=reduction_axes)
    call, (x, residual) = shaped.call, shaped.rows
    reduce = check_reduce_dtype(reduce_dtype, x.dtype)
    columnwise = check_columnwise(columnwise, call.params, x.shape)
    if call.params.per_row_global_scale and check_method(method) not in ("auto", "xla"):
        raise ValueError(
            f"global_scale='per_row' sums the partials with method='xla' ('auto' takes it), "
            f"got method={method!r}: the one-kernel methods exchange no per-row global scales"
        )
    if columnwise or call.params.per_row_global_scale:
        if check_method(method) not in ("auto", "xla"):
            raise ValueError(
                f"columnwise=True sums the partials with method='xla' ('auto' takes it), "
                f"got method={method!r}: the columnwise pass reads the float32 sum, which "
                "the one-kernel methods do not write"
            )
        h = xla_sum(x, check_axis_name(axis_name), None if reduce == jnp.dtype(x.dtype) else reduce)
        outs = bind_norm(call, (h, residual), shaped.gamma, training=False, columnwise=columnwise)
        return shaped.finish(outs).returned(training=False)
    results = allreduce_rms_norm_fp8_p.bind(
        *shaped.operands(),
        axes=check_axis_name(axis_name),
        method=check_method(method),
        reduce_dtype=None if reduce == jnp.dtype(x.dtype) else reduce,
        **call.params.as_dict(),
    )
    outs = named_outputs(results, call.params.as_dict(), add=True)
    return shaped.finish(outs).returned(training=False)


def sharded_allreduce_residual_rms_norm_fp8(
    partials: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    **kwargs: Unpack[AllReduceKeywords],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`allreduce_residual_rms_norm_fp8` for callers outside ``shard_map``.

    Args:
      partials: ``[mesh.shape[axis_name], ..., N]``: device ``i``'s partial sum at index
        ``i`` of the leading axis, which is sharded over ``axis_name`` (placed so if it is
        not already).
      residual: ``[..., N]``, replicated. gamma: replicated (or None).
      mesh, axis_name: the mesh and the axis to reduce over.
      kwargs: the keywords of :func:`allreduce_residual_rms_norm_fp8` (a
        ``static_scale`` or ``global_scale`` array is replicated).

    Returns:
      ``(y, scales, residual_out)``, replicated over the mesh.
    """
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    if len(partials.shape) < 2 or partials.shape[0] != mesh.shape[axis_name]:
        raise ValueError(
            f"partials must have shape ({mesh.shape[axis_name]}, ..., N), one partial sum "
            f"per device of {axis_name!r}; got {tuple(partials.shape)}"
        )

    # A calibrated or global scale enters shard_map as a replicated operand, not a
    # closed-over one.
    data = {
        "static_scale": check_static_scale(kwargs.pop("static_scale", None)),
        "global_scale": check_global_scale(kwargs.pop("global_scale", None)),
    }
    if isinstance(data["global_scale"], str):  # "per_row": a keyword, not an operand
        kwargs["global_scale"] = data.pop("global_scale")
    data = {name: value for name, value in data.items() if value is not None}
    extra = tuple(data.values())

    # gamma=None (no weight) is no operand: each device makes the same constant.
    weights = () if gamma is None else (gamma,)

    def per_device(local_partials, residual, *operands):
        weight = operands[0] if weights else None
        kwargs.update(zip(data, operands[len(weights) :], strict=True))
        return allreduce_residual_rms_norm_fp8(
            local_partials[0], residual, weight, axis_name=axis_name, **kwargs
        )

    columnwise = int(bool(kwargs.get("columnwise")))
    per_row = int(isinstance(kwargs.get("global_scale"), str))
    stacked, replicated = NamedSharding(mesh, P(axis_name)), NamedSharding(mesh, P())
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axis_name), P()) + (P(),) * (len(weights) + len(extra)),
        # (y, scales, residual_out), global_scales with global_scale="per_row", then y_t
        # and scales_t (and global_scales_t) with columnwise
        out_specs=(P(),) * (3 + 2 * columnwise + per_row * (1 + columnwise)),
    )
    return fn(
        _place(partials, stacked),
        _place(residual, replicated),
        *(_place(e, replicated) for e in weights + extra),
    )


def _place(value, sharding):
    """Puts a concrete array where shard_map expects it; under jit, jax.sharding.reshard
    does the same for explicit mesh axes and with_sharding_constraint for automatic ones."""
    if not isinstance(value, jax.core.Tracer):
        return jax.device_put(value, sharding)
    explicit = jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(value, sharding)
    return jax.lax.with_sharding_constraint(value, sharding)


def round_float32(x: jax.Array, dtype) -> jax.Array:
    """Rounds float32 ``x`` to ``dtype`` (float16, bfloat16, an FP8 E4M3 type or
    float4_e2m1fn) with the kernels' own conversion code; for checking it against other
    implementations."""
    check = jnp.dtype(dtype)
    if jnp.dtype(x.dtype) != jnp.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if check not in FLOAT_DTYPES[1:] + OUT_DTYPES:
        raise TypeError(
            f"dtype must be float16, bfloat16, an FP8 E4M3 type or float4_e2m1fn, got {check}"
        )
    return round_p.bind(x, dtype=check)
