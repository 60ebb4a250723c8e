"""The fused ops: RMSNorm with dynamic per-row FP8 quantisation, as XLA FFI custom calls.

Each public function validates its arguments (TypeError / ValueError naming the
argument), rounds the constants as docs/spec.md says and binds a JAX primitive that
lowers to one custom call on the CPU or CUDA backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp8norm._primitives import add_rms_norm_fp8_p, rms_norm_fp8_p, round_p
from jax_fp8norm._validation import (
    FLOAT_DTYPES,
    OUT_DTYPES,
    validate,
)
from jax_fp8norm.reference import DEFAULT_EPS, all_reduce


def rms_norm_fp8(
    x: jax.Array,
    gamma: jax.Array,
    *,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
    scale_ub: float | None = None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """RMSNorm of each row of ``x``, quantised to FP8 with one dynamic scale per row.

    Args:
      x: ``[..., N]`` float32, float16 or bfloat16, rank >= 1; each of the
        ``prod(x.shape[:-1])`` rows is normalised on its own.
      gamma: ``[N]`` float32, float16 or bfloat16 (need not match ``x``).
      eps: added to the mean square; rounded through ``x.dtype``.
      weight_offset: added to gamma (1.0 for Gemma-style weights); rounded through
        ``x.dtype``.
      scale_ub: upper bound on a row's absolute maximum before it becomes a scale (the
        largest scale is ``scale_ub / FP8_MAX``); None for no bound.
      out_dtype: ``float8_e4m3fn`` (max 448) or ``float8_e4m3fnuz`` (max 240).
      scale_dtype: float32, float16 or bfloat16.

    Returns:
      ``(y, scales)``: ``y`` is ``[..., N]`` in ``out_dtype``; ``scales`` is
      ``[..., 1]`` in ``scale_dtype``. ``f32(y) * f32(scales)`` dequantises.
    """
    p = validate(
        x,
        gamma,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    y, scales = rms_norm_fp8_p.bind(x, gamma, **p.as_dict())
    return y, scales


def add_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
    scale_ub: float | None = None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``h = x + residual`` in float32, then :func:`rms_norm_fp8` of ``h``, in one pass.

    Args:
      x, residual: ``[..., N]``, the same shape and dtype (float32, float16 or bfloat16).
      gamma and the keywords: as for :func:`rms_norm_fp8`.

    Returns:
      ``(y, scales, residual_out)``: ``y`` and ``scales`` as for :func:`rms_norm_fp8`,
      computed from the unrounded float32 ``h``; ``residual_out`` is ``h`` rounded to
      ``x.dtype`` (the next layer's residual).
    """
    p = validate(
        x,
        gamma,
        residual,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    y, scales, residual_out = add_rms_norm_fp8_p.bind(x, residual, gamma, **p.as_dict())
    return y, scales, residual_out


def allreduce_residual_rms_norm_fp8(
    x: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    axis_name,
    eps: float = DEFAULT_EPS,
    weight_offset: float = 0.0,
    scale_ub: float | None = None,
    out_dtype=jnp.float8_e4m3fn,
    scale_dtype=jnp.float32,
    reduce_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tensor-parallel all-reduce of partial sums, then :func:`add_rms_norm_fp8`, fused.

    Call inside ``jax.shard_map`` (or wherever ``axis_name`` is bound). ``h`` is the sum of
    ``x`` over the axis, an XLA all-reduce (NCCL on GPUs); then one kernel adds the
    residual, normalises and quantises, reading ``h`` once and writing ``residual_out``
    in the same pass. The outputs are identical on every device of the axis.

    Args:
      x: ``[..., N]`` this device's partial sum (e.g. a row-parallel matmul's output),
        float32, float16 or bfloat16.
      residual: ``[..., N]``, the dtype of ``x``, the same on every device.
      gamma: ``[N]``, the same on every device.
      axis_name: the mesh axis (or a tuple of axes) to reduce over.
      reduce_dtype: None to all-reduce in ``x.dtype`` (the bytes a tensor-parallel layer
        already moves), or ``jnp.float32`` to all-reduce, and add the residual, in
        float32.
      The other keywords: as for :func:`rms_norm_fp8`.

    Returns:
      ``(y, scales, residual_out)`` as for :func:`add_rms_norm_fp8`; ``residual_out``
      has the residual's dtype.
    """
    p = validate(
        x,
        gamma,
        residual,
        eps=eps,
        weight_offset=weight_offset,
        scale_ub=scale_ub,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
    )
    h = all_reduce(x, axis_name, reduce_dtype)
    y, scales, residual_out = add_rms_norm_fp8_p.bind(h, residual, gamma, **p.as_dict())
    return y, scales, residual_out


def sharded_allreduce_residual_rms_norm_fp8(
    partials: jax.Array,
    residual: jax.Array,
    gamma: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    **kwargs,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`allreduce_residual_rms_norm_fp8` for callers outside ``shard_map``.

    Args:
      partials: ``[mesh.shape[axis_name], ..., N]``: device ``i``'s partial sum at index
        ``i`` of the leading axis, which is sharded over ``axis_name`` (placed so if it is
        not already).
      residual: ``[..., N]``, replicated. gamma: ``[N]``, replicated.
      mesh, axis_name: the mesh and the axis to reduce over.
      kwargs: the keywords of :func:`allreduce_residual_rms_norm_fp8`.

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

    def per_device(local_partials, residual, gamma):
        return allreduce_residual_rms_norm_fp8(
            local_partials[0], residual, gamma, axis_name=axis_name, **kwargs
        )

    stacked, replicated = NamedSharding(mesh, P(axis_name)), NamedSharding(mesh, P())
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axis_name), P(), P()),
        out_specs=(P(), P(), P()),
    )
    return fn(_place(partials, stacked), _place(residual, replicated), _place(gamma, replicated))


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
    """Rounds float32 ``x`` to ``dtype`` (float16, bfloat16 or an FP8 E4M3 type) with the
    kernels' own conversion code; for checking it against other implementations."""
    check = jnp.dtype(dtype)
    if jnp.dtype(x.dtype) != jnp.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if check not in FLOAT_DTYPES[1:] + OUT_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or an FP8 E4M3 type, got {check}")
    return round_p.bind(x, dtype=check)
