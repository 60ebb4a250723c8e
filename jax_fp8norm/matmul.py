"""Matmuls with the scales this package produces, FP8 and FP4.

FP8: ``a`` FP8 with per-row or per-group activation scales (the ``scales`` of
:func:`jax_fp8norm.rms_norm_fp8`, float or e8m0) and ``w`` FP8 with per-output-channel or
per-block weight scales.

FP4: ``a`` and ``w`` float4_e2m1fn, block-scaled along K (the contraction axis), in one of
two formats, the same for both operands:

- NVFP4: blocks of 16, float8_e4m3fn scales, and a float32 global (decode) scale per
  operand: ``deq(v) = f32(v) * repeat(f32(scales), 16) * global_scale``.
- MXFP4: blocks of 32, float8_e8m0fnu (power-of-two) scales, no global scale:
  ``deq(v) = f32(v) * repeat(2^e, 32)``.

Activation scales are ``[..., M, K // block]`` (the layout of the norm ops' ``scales``);
weight scales ``[K // block, N]``, the blocked weight layout of the FP8 path. The helpers
:func:`jax_fp8norm.quantize.quantize_weights_nvfp4` and
:func:`jax_fp8norm.quantize.quantize_weights_mxfp4` make such weights.
:func:`matmul_path` says how :func:`fp8_matmul` computes each case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp8norm._checks import check_float32_scalar
from jax_fp8norm._dtypes import FP4
from jax_fp8norm.recipes import RECIPES

FP8_DTYPES = (
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.float8_e4m3fnuz),
    np.dtype(jnp.float8_e5m2),
)
# What cuDNN's block-scaled GEMM (MXFP8, through jax.nn.scaled_matmul) takes: OCP FP8
# operands with the MXFP8 recipe's scales and blocks along K.
MXFP8 = RECIPES["mxfp8"]
MXFP8_OPERANDS = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
# An FP4 operand's format, by its scales' dtype: its recipe (E2M1: magnitudes 0, 0.5, 1,
# 1.5, 2, 3, 4, 6).
FP4_FORMATS = {RECIPES[name].scale_dtype: RECIPES[name] for name in ("nvfp4", "mxfp4")}
_FORMAT_NAMES = {
    "fp8": "FP8",
    "nvfp4": "NVFP4 (float4_e2m1fn, float8_e4m3fn scales per 16)",
    "mxfp4": "MXFP4 (float4_e2m1fn, float8_e8m0fnu scales per 32)",
}


def native_block_scaled_available() -> bool:
    """Whether jax.nn.scaled_matmul runs MXFP8 and NVFP4 natively here: the default
    backend is a GPU with block-scaled tensor cores (compute capability 10.0 and newer,
    Blackwell), where jax lowers it to cuDNN. Elsewhere (CPU: no lowering at all)
    fp8_matmul dequantises instead."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    return float(getattr(device, "compute_capability", "0")) >= 10.0


def _blocks_match(a, a_scales, w, w_scales, block: int) -> bool:
    """Whether the scales are one per `block` elements along K, of a and of w's columns."""
    return (
        a_scales.ndim == a.ndim
        and a.shape[-1] == block * a_scales.shape[-1]
        and w_scales.ndim == 2
        and w.shape[0] == block * w_scales.shape[0]
    )


def matmul_path(a, a_scales, w, w_scales) -> str:
    """The path :func:`fp8_matmul` takes for these operands:

    - "scaled_matmul": ``jax.nn.scaled_matmul``, cuDNN's block-scaled GEMM, on GPUs of
      compute capability 10.0 and newer, for MXFP8 (FP8 operands, e8m0 scales per 32) and
      NVFP4 (FP4 operands, e4m3 scales per 16; the global scales multiply its float32
      result).
    - "fp8_dot": FP8 with one scale per row and per output channel: an FP8 GEMM with the
      scales applied to its float32 result.
    - "dequantize": everything else (FP8 scales per group or block, MXFP4 anywhere, NVFP4
      and MXFP8 off Blackwell): the operands dequantised to float32, then a float32
      matmul (and for NVFP4 the global scales applied to its result).
    """
    if FP4 in (np.dtype(a.dtype), np.dtype(w.dtype)):
        fmt = RECIPES["nvfp4"]
        nvfp4 = (
            np.dtype(a.dtype) == FP4
            and np.dtype(w.dtype) == FP4
            and np.dtype(a_scales.dtype) == fmt.scale_dtype
            and np.dtype(w_scales.dtype) == fmt.scale_dtype
            and _blocks_match(a, a_scales, w, w_scales, fmt.block)
        )
        # cuDNN (and XLA's block-scaled dot) take NVFP4 but not MXFP4.
        return "scaled_matmul" if nvfp4 and native_block_scaled_available() else "dequantize"
    per_row = a_scales.shape[-1] == 1
    per_channel = w_scales.ndim == 1
    if per_row and per_channel:
        return "fp8_dot"
    mxfp8 = (
        np.dtype(a_scales.dtype) == MXFP8.scale_dtype
        and np.dtype(w_scales.dtype) == MXFP8.scale_dtype
        and np.dtype(a.dtype) in MXFP8_OPERANDS
        and np.dtype(w.dtype) in MXFP8_OPERANDS
        and _blocks_match(a, a_scales, w, w_scales, MXFP8.block)
    )
    if mxfp8 and native_block_scaled_available():
        return "scaled_matmul"
    return "dequantize"


def _format(name: str, value, scales) -> str:
    """ "fp8", "nvfp4" or "mxfp4": the format of operand `name` with these scales."""
    dtype = np.dtype(value.dtype)
    if dtype in FP8_DTYPES:
        return "fp8"
    if dtype != FP4:
        raise TypeError(
            f"{name} must be an FP8 array or an FP4 (float4_e2m1fn) array, got {value.dtype}"
        )
    fmt = FP4_FORMATS.get(np.dtype(scales.dtype))
    if fmt is None:
        raise TypeError(
            f"{name}_scales of an FP4 {name} must be float8_e4m3fn (NVFP4) or "
            f"float8_e8m0fnu (MXFP4), got {scales.dtype}"
        )
    return fmt.name


def _check_fp8(a, a_scales, w, w_scales) -> None:
    k, m = w.shape
    groups = a_scales.shape[-1] if a_scales.ndim == a.ndim else 0
    if a_scales.ndim != a.ndim or tuple(a_scales.shape[:-1]) != tuple(a.shape[:-1]):
        groups = 0
    if groups == 0 or k % groups != 0:
        raise ValueError(
            "a_scales must have shape a.shape[:-1] + (1,) (per row) or a.shape[:-1] + "
            f"(K // G,) (per group of G dividing K = {k}); got {tuple(a_scales.shape)}"
        )
    per_channel = tuple(w_scales.shape) == (m,)
    per_block = w_scales.ndim == 2 and w_scales.shape[1] == m and w_scales.shape[0] > 0
    if not (per_channel or (per_block and k % w_scales.shape[0] == 0)):
        raise ValueError(
            f"w_scales must have shape ({m},) (per output channel) or (K // B, {m}) (per block "
            f"of B rows of w, B dividing K = {k}); got {tuple(w_scales.shape)}"
        )


def _check_fp4(fmt: str, a, a_scales, w, w_scales) -> None:
    k, n = w.shape
    block = RECIPES[fmt].block
    label = fmt.upper()
    if k % block:
        raise ValueError(f"{label} operands need K a multiple of {block}; got K = {k}")
    want = tuple(a.shape[:-1]) + (k // block,)
    if tuple(a_scales.shape) != want:
        raise ValueError(
            f"a_scales must have shape a.shape[:-1] + (K // {block},) = {want} for {label} a "
            f"(one scale per block of {block} along K); got {tuple(a_scales.shape)}"
        )
    if tuple(w_scales.shape) != (k // block, n):
        raise ValueError(
            f"w_scales must have shape (K // {block}, N) = {(k // block, n)} for {label} w "
            f"(one scale per block of {block} rows of w in each column); got "
            f"{tuple(w_scales.shape)}"
        )


def _check(a, a_scales, w, w_scales) -> str:
    """Validates the operands; returns their format: "fp8", "nvfp4" or "mxfp4"."""
    a_format = _format("a", a, a_scales)
    w_format = _format("w", w, w_scales)
    if a_format != w_format:
        raise ValueError(
            "a and w (with a_scales and w_scales) must be of one format: both FP8, both "
            f"NVFP4 or both MXFP4; got a {_FORMAT_NAMES[a_format]} and w "
            f"{_FORMAT_NAMES[w_format]}"
        )
    if w.ndim != 2 or a.ndim < 1 or a.shape[-1] != w.shape[0]:
        raise ValueError(f"w must have shape (a.shape[-1], M); got a {a.shape}, w {w.shape}")
    if a_format == "fp8":
        _check_fp8(a, a_scales, w, w_scales)
    else:
        _check_fp4(a_format, a, a_scales, w, w_scales)
    return a_format


def _global_scales(fmt: str, a_global_scale, w_global_scale):
    """The product of the two global scales (float32, shape ()) for NVFP4, else None."""
    given = [
        name
        for name, value in (("a_global_scale", a_global_scale), ("w_global_scale", w_global_scale))
        if value is not None
    ]
    if fmt != "nvfp4":
        if given:
            raise ValueError(
                f"{' and '.join(given)} are only for NVFP4 operands; a and w are "
                f"{_FORMAT_NAMES[fmt]}"
            )
        return None
    if len(given) != 2:
        raise ValueError(
            "NVFP4 operands need a_global_scale and w_global_scale (float32 decode scales: "
            "deq = f32(v) * f32(block scale) * global_scale; 1.0 for none)"
        )
    return check_float32_scalar(a_global_scale, "a_global_scale") * check_float32_scalar(
        w_global_scale, "w_global_scale"
    )


# Rows per tile of the float32 product on the CPU. XLA's CPU dot picks its blocking, and
# with it the order in which each output sums its K products, from the operands' shapes:
# the same row in a call of another size can get other bits. Every tile is one product of
# the same shape, so a row's result depends on that row alone (docs/spec.md, "The layer").
CPU_TILE_ROWS = 64


def _dot(a: jax.Array, w: jax.Array, precision=jax.lax.Precision.HIGHEST) -> jax.Array:
    """``a [..., K] @ w [K, N]`` accumulated in float32."""
    return jax.lax.dot_general(
        a,
        w,
        (((a.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
        out_sharding=_summed_out_sharding(a, w),
    )


def _summed_out_sharding(a: jax.Array, w: jax.Array):
    """Where the operands' types shard K over Explicit mesh axes, the product's sharding
    (a's rows and w's columns as they are, K summed over the devices); else None."""
    a_spec, w_spec = _explicit_spec(a), _explicit_spec(w)
    if a_spec is None and w_spec is None:
        return None
    a_spec = a_spec or (None,) * a.ndim
    w_spec = w_spec or (None, None)
    if a_spec[-1] is None and w_spec[0] is None:
        return None
    mesh = (jax.typeof(a) if _explicit_spec(a) else jax.typeof(w)).sharding.mesh
    return NamedSharding(mesh, P(*a_spec[:-1], w_spec[1]))


def _explicit_spec(v: jax.Array) -> tuple | None:
    """The PartitionSpec of ``v``'s type (sharding in types: Explicit mesh axes), padded
    to its rank; None when no axis of it is sharded that way."""
    sharding = getattr(jax.typeof(v), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    if not any(axis is not None for axis in spec):
        return None
    return spec + (None,) * (v.ndim - len(spec))


def _tiled_dot(a: jax.Array, w: jax.Array) -> jax.Array:
    """:func:`_local_tiled_dot`; where the operands' types are sharded over Explicit mesh
    axes (a loop cannot run over a sharded axis there), each device's block of the rows
    and columns, in a shard_map, unless K is sharded (then XLA's product)."""
    a_spec, w_spec = _explicit_spec(a), _explicit_spec(w)
    if a_spec is None and w_spec is None:
        return _local_tiled_dot(a, w)
    a_spec = a_spec or (None,) * a.ndim
    w_spec = w_spec or (None, None)
    if _summed_out_sharding(a, w) is not None:
        return _dot(a, w)
    mesh = (jax.typeof(a) if _explicit_spec(a) else jax.typeof(w)).sharding.mesh
    return jax.shard_map(
        _local_tiled_dot,
        mesh=mesh,
        in_specs=(P(*a_spec), P(*w_spec)),
        out_specs=P(*a_spec[:-1], w_spec[1]),
    )(a, w)


def _local_tiled_dot(a: jax.Array, w: jax.Array) -> jax.Array:
    """:func:`_dot` of float32 operands as products of CPU_TILE_ROWS rows each, the rows
    padded with zeros to whole tiles."""
    rows, k = a.shape[:-1], a.shape[-1]
    m = int(np.prod(rows, dtype=np.int64))
    if m == 0 or k == 0:
        return _dot(a, w)
    flat = a.reshape(m, k)
    tiles = jnp.pad(flat, ((0, -m % CPU_TILE_ROWS), (0, 0))).reshape(-1, CPU_TILE_ROWS, k)
    out = jax.lax.map(lambda tile: _dot(tile, w), tiles)
    return out.reshape(-1, w.shape[1])[:m].reshape(*rows, w.shape[1])


def _fp8_dot(a: jax.Array, w: jax.Array) -> jax.Array:
    """The FP8 operands straight to the dot: an FP8 GEMM on GPUs that have one."""
    return _dot(a, w, precision=None)


def _row_invariant_dot(a: jax.Array, w: jax.Array, native=_dot) -> jax.Array:
    """``a @ w`` in float32, its rows independent of the number of rows on the CPU (tiles
    of float32); ``native`` (by default the plain dot) elsewhere."""

    def tiled(a, w):
        # The barrier keeps XLA from moving the scales that follow into the product.
        return jax.lax.optimization_barrier(
            _tiled_dot(a.astype(jnp.float32), w.astype(jnp.float32))
        )

    return jax.lax.platform_dependent(a, w, cpu=tiled, default=native)


def _dequantize_weights(w: jax.Array, w_scales: jax.Array) -> jax.Array:
    scales = w_scales.astype(jnp.float32)
    if scales.ndim == 1:
        return w.astype(jnp.float32) * scales
    # Blocks by reshaping rather than jnp.repeat, which refuses an axis sharded over
    # Explicit mesh axes.
    blocks, n = scales.shape
    w32 = w.astype(jnp.float32).reshape(blocks, w.shape[0] // blocks, n)
    return (w32 * scales[:, None, :]).reshape(w.shape)


def _dequantized_product(a, a_scales, w, w_scales) -> jax.Array:
    """``dequantize(a) @ dequantize(w)`` in float32, its rows independent of the call's."""
    scales = a_scales.astype(jnp.float32)
    groups = scales.shape[-1]
    a32 = a.astype(jnp.float32).reshape(*a.shape[:-1], groups, a.shape[-1] // groups)
    a32 = (a32 * scales[..., None]).reshape(a.shape)
    return _row_invariant_dot(a32, _dequantize_weights(w, w_scales))


def fp8_matmul(
    a: jax.Array,
    a_scales: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    a_global_scale=None,
    w_global_scale=None,
) -> jax.Array:
    """``dequantize(a, a_scales) @ dequantize(w, w_scales)``, accumulated in float32.

    Args:
      a: ``[..., K]`` FP8 or FP4 (float4_e2m1fn) activations.
      a_scales: for FP8 ``a``, ``[..., 1]`` (one scale per row) or ``[..., K // G]`` (one
        per group of G consecutive elements, e.g. DeepSeek-style 1x128 or MXFP8's 1x32),
        float32, float16, bfloat16 or float8_e8m0fnu: the ``scales`` of
        :func:`jax_fp8norm.rms_norm_fp8`. For FP4 ``a``, ``[..., K // 16]``
        float8_e4m3fn (NVFP4) or ``[..., K // 32]`` float8_e8m0fnu (MXFP4).
      w: ``[K, N]`` FP8 or FP4 weights, of the same format as ``a``.
      w_scales: for FP8 ``w``, ``[N]`` (one per output channel) or ``[K // B, N]`` (one
        per block of B rows of ``w`` in each column, e.g. MXFP8 weights with B = 32 and
        e8m0 scales). For FP4 ``w``, ``[K // 16, N]`` float8_e4m3fn (NVFP4) or
        ``[K // 32, N]`` float8_e8m0fnu (MXFP4): see :func:`quantize_weights_nvfp4` and
        :func:`quantize_weights_mxfp4`.
      out_dtype: the result's dtype (bfloat16, float16 or float32).
      a_global_scale, w_global_scale: NVFP4 only, and then both required: the operands'
        float32 global decode scales (``deq(a) = f32(a) * repeat(f32(a_scales), 16) *
        a_global_scale``), each a Python float or a float32 array of shape ``()`` or
        ``(1,)``; they are data, so they may be traced. Their product multiplies the
        float32 result. Given with any other format they are a ValueError.

    Returns:
      ``[..., N]`` in ``out_dtype``. :func:`matmul_path` says how it is computed: with
      per-row and per-channel FP8 scales the FP8 operands go to the dot directly
      (``preferred_element_type=float32``), an FP8 GEMM on GPUs that have one; MXFP8
      operands (e8m0 scales, blocks of 32) and NVFP4 operands go to
      ``jax.nn.scaled_matmul``, cuDNN's block-scaled GEMM, on Blackwell GPUs, with the
      leading dims of ``a`` flattened into its rows and ``w`` transposed to ``[N, K]``;
      everything else (MXFP4 always) is dequantised to float32 first (any backend). On
      the CPU the float32 product runs in tiles of :data:`CPU_TILE_ROWS` rows, so that
      each row of the result has the same bits in a call of any number of rows.

    Raises:
      TypeError: an operand neither FP8 nor FP4, FP4 scales neither e4m3 nor e8m0, or a
        global scale that is not float32.
      ValueError: operands of two formats (FP8 with FP4, NVFP4 with MXFP4), shapes that
        do not fit (scales not one per block of the format's size), global scales missing
        for NVFP4 or given for another format.
    """
    fmt = _check(a, a_scales, w, w_scales)
    global_scale = _global_scales(fmt, a_global_scale, w_global_scale)
    path = matmul_path(a, a_scales, w, w_scales)
    if path == "fp8_dot":
        # FP8 codes are exact in float32: the CPU's tiles compute the same products.
        acc = _row_invariant_dot(a, w, native=_fp8_dot)
        scaled = acc * a_scales.astype(jnp.float32) * w_scales.astype(jnp.float32)
        return scaled.astype(out_dtype)
    if path == "scaled_matmul":
        # jax.nn.scaled_matmul takes (B, M, K) and (B, N, K) operands with (B, M, K // b)
        # and (B, N, K // b) scales, K contracted on both.
        rows, k = a.shape[:-1], a.shape[-1]
        lhs = a.reshape(1, -1, k)
        lhs_scales = a_scales.reshape(1, -1, a_scales.shape[-1])
        rhs, rhs_scales = w.T[None], w_scales.T[None]
        out = jax.nn.scaled_matmul(
            lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32
        )
        out = out.reshape(*rows, w.shape[1])
    else:
        out = _dequantized_product(a, a_scales, w, w_scales)
    if global_scale is not None:
        # As jax.nn.scaled_dot_general does for NVFP4: the block-scaled product in
        # float32, times the product of the two global scales, then the output dtype.
        out = out * global_scale
    return out.astype(out_dtype)
