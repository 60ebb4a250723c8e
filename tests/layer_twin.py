"""A twin of the layer (rms_norm_dense, add_rms_norm_dense), stated from docs/spec.md ("The
layer: rms_norm_dense") and not from jax_fp8norm/dense.py: the quantisations the layer
makes itself (the weight along K, w^T along F, the output gradient G along F per row for
dgrad and along the rows per column for wgrad) are written here in NumPy and ml_dtypes,
each with the format, block, scale rule and global scale the spec's table gives its
recipe. The norm's codes (rowwise, columnwise) and its fused backward are the reference
twins' (jax_fp8norm.reference), and the GEMMs are fp8_matmul's, as the spec says they are.

FP4 training's parts (docs/spec.md, "FP4 training") are stated here too: the stochastic
rounding of the output gradient's two copies (with the random bits of
jax_fp8norm._fp4_parts.random_bits, the spec's statement of them), the weight's 2-D tiles
and the Hadamard transform of the wgrad GEMM's operands (X's columnwise codes from the
transformed n, G's wgrad copy transformed, dW times 1 / d).

tests/test_layer_bits.py holds the layer to this twin bit for bit."""

from __future__ import annotations

import dataclasses
import functools

import jax
import ml_dtypes
import numpy as np
from helpers import reference_on_cpu

from jax_fp8norm import reference
from jax_fp8norm._fp4_parts import (
    DGRAD_STREAM,
    WGRAD_STREAM,
    key_words,
    random_bits,
    stream_key,
)
from jax_fp8norm.matmul import fp8_matmul

F32 = np.float32
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FP4 = np.dtype(ml_dtypes.float4_e2m1fn)
FP8_MAX = {E4M3: F32(448.0), E5M2: F32(57344.0)}
FP4_MAX = F32(6.0)
# Every scale the layer makes from an amax is at least the smallest normal float32.
SMALLEST_NORMAL = F32(2.0**-126)
# NVFP4's global scale: amax / (448 * 6), which puts the largest block scale at 448.
NVFP4_GLOBAL_DIVISOR = F32(448.0 * 6.0)


@dataclasses.dataclass(frozen=True)
class Format:
    """How one operand is quantised along its contraction axis: ``kind`` "channel" (FP8,
    one float32 scale ``amax / FP8_MAX`` per row or column), "pow2" (FP8 blocks, e8m0
    scales, the smallest power of two >= ``amax / FP8_MAX``), "nvfp4" or "mxfp4"."""

    kind: str
    dtype: np.dtype
    block: int | None


def _fp8(dtype, block):
    return Format("channel" if block is None else "pow2", dtype, block)


# The spec's table, by recipe: (the weight's format, forward and dgrad's w^T; the output
# gradient's, dgrad's and wgrad's), and whether wgrad takes the norm's columnwise codes
# (the per-row recipe has none: it folds its rows' scales into G).
SPEC_TABLE = {
    "fp8_row": (_fp8(E4M3, None), _fp8(E5M2, None), False),
    "fp8_static": (_fp8(E4M3, None), _fp8(E5M2, None), True),
    "fp8_group128": (_fp8(E4M3, 128), _fp8(E5M2, 128), True),
    "fp8_group128_ue8m0": (_fp8(E4M3, 128), _fp8(E5M2, 128), True),
    "mxfp8": (_fp8(E4M3, 32), _fp8(E4M3, 32), True),
    "nvfp4": (Format("nvfp4", FP4, 16), Format("nvfp4", FP4, 16), True),
    "mxfp4": (Format("mxfp4", FP4, 32), Format("mxfp4", FP4, 32), True),
}


def _power_of_two_exponent(q: np.ndarray, a: np.ndarray, fmt_max, floor: int) -> np.ndarray:
    """The exponent of P(q), the smallest power of two >= q (float32, finite, >= 0), at
    least 2^floor; below 2^-126 decided from ``a`` (q = a / fmt_max): 2^-126 where ``a >
    fmt_max * 2^-127``, else the floor."""
    bits = q.view(np.uint32)
    biased = (bits >> 23).astype(np.int32)
    exponent = biased - 127 + ((bits & 0x7FFFFF) != 0)
    tiny = np.where(a > fmt_max * F32(2.0**-127), -126, -127)
    return np.maximum(np.where(biased == 0, tiny, exponent), floor)


def _pow2(exponent: np.ndarray) -> np.ndarray:
    return np.ldexp(F32(1.0), exponent).astype(F32)


def _e8m0(exponent: np.ndarray) -> np.ndarray:
    return (exponent + 127).astype(np.uint8).view(E8M0)


def nvfp4_global_scale(amax) -> np.ndarray:
    """``max(amax / 2688, 2^-126)``, 1 for a zero amax (float32)."""
    amax = np.asarray(amax, F32)
    return np.where(amax == 0, F32(1.0), np.maximum(amax / NVFP4_GLOBAL_DIVISOR, SMALLEST_NORMAL))


# The E2M1 magnitudes, in increasing order.
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], F32)


def round_e2m1(q: np.ndarray, bits: np.ndarray | None) -> np.ndarray:
    """float32 ``q`` (scaled, clamped to +-6) as E2M1 codes: to nearest even without
    ``bits``; else stochastically (the spec's rule): ``lo <= |q| <= hi`` the adjacent
    magnitudes, ``frac = (|q| - lo) / (hi - lo)``, ``u = (b >> 8) * 2^-24``, ``hi`` where
    ``u < frac``, else ``lo``, with q's sign. A magnitude below the smallest normal float32
    counts as zero (flushing it cannot change a code)."""
    if bits is None:
        return q.astype(FP4)
    a = np.abs(q)
    a = np.where(a < SMALLEST_NORMAL, F32(0.0), a)
    i = np.searchsorted(E2M1_GRID, a, side="right") - 1
    lo, hi = E2M1_GRID[i], E2M1_GRID[np.minimum(i + 1, len(E2M1_GRID) - 1)]
    frac = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, F32(1.0)), F32(0.0))
    u = (np.asarray(bits, np.uint32) >> 8).astype(F32) * F32(2.0**-24)
    magnitude = np.where(u < frac.astype(F32), hi, lo)
    return np.where(np.signbit(q), -magnitude, magnitude).astype(FP4)


def quantize_rows(v: np.ndarray, fmt: Format, global_scale=None, bits=None):
    """float32 ``v [R, C]`` quantised along C, each row in blocks of ``fmt.block`` (the
    whole row for None): ``(codes [R, C], scales [R, C // block])``; NVFP4 divides by
    ``global_scale`` (a float32 scalar, or one per row ``[R, 1]``) first. FP4 codes are
    rounded stochastically with ``bits`` (uint32 ``[R, C]``) where given."""
    v = np.asarray(v, F32)
    rows, cols = v.shape
    block = cols if fmt.block is None else fmt.block
    groups = v.reshape(rows, cols // block, block)
    if bits is not None:
        bits = np.asarray(bits, np.uint32).reshape(groups.shape)
    if fmt.kind == "nvfp4":
        t = groups / np.asarray(global_scale, F32).reshape(-1, 1, 1)
        scales = np.minimum(np.abs(t).max(-1) / FP4_MAX, F32(448.0)).astype(E4M3)
        s32 = scales.astype(F32)[..., None]
        q = np.where(s32 == 0, F32(0.0), t / np.where(s32 == 0, F32(1.0), s32))
        codes = round_e2m1(np.clip(q, -FP4_MAX, FP4_MAX), bits)
        return codes.reshape(rows, cols), scales
    fmt_max = FP4_MAX if fmt.kind == "mxfp4" else FP8_MAX[fmt.dtype]
    amax = np.abs(groups).max(-1)
    if fmt.kind == "channel":
        scales = np.where(amax > 0, np.maximum(amax / fmt_max, SMALLEST_NORMAL), F32(1.0))
        codes = (groups / scales[..., None]).astype(fmt.dtype)
        return codes.reshape(rows, cols), scales.astype(F32)
    # Power-of-two scales: MXFP4's at least 2^-127 (e8m0's code 0), the FP8 blocks' at
    # least 2^-126 (the layer's floor for every scale it makes).
    exponent = _power_of_two_exponent(
        amax / fmt_max, amax, fmt_max, -127 if fmt.kind == "mxfp4" else -126
    )
    q = groups * _pow2(-exponent)[..., None]
    if fmt.kind == "mxfp4":
        codes = round_e2m1(np.clip(q, -FP4_MAX, FP4_MAX), bits)
        return codes.reshape(rows, cols), _e8m0(exponent)
    return q.astype(fmt.dtype).reshape(rows, cols), _e8m0(exponent)


def quantize_columns(v: np.ndarray, fmt: Format, global_scale=None, bits=None):
    """float32 ``v [R, C]`` quantised along R in each column, as fp8_matmul takes its
    ``w``: ``(codes [R, C], scales [C] (one per column) or [R // block, C])``; ``bits``
    ``[R, C]``, element ``(i, j)``'s random bits."""
    bits = None if bits is None else np.asarray(bits).T
    codes, scales = quantize_rows(np.asarray(v, F32).T, fmt, global_scale, bits)
    scales = scales[:, 0] if fmt.block is None else scales.T
    return codes.T, scales


def quantize_tiles(w: np.ndarray, fmt: Format, global_scale=None):
    """float32 ``w [K, F]`` FP4 in square tiles of ``fmt.block`` (one scale per tile by the
    format's rule, NVFP4 under the tensor's ``global_scale``; a partial tile at F's end as
    the tile padded with zeros): ``(codes [K, F], forward scales [K // block, F] (blocks
    along K), dgrad scales [ceil(F / block), K] for ``codes.T`` (blocks along F))``: the
    two GEMMs read the same codes."""
    b = fmt.block
    k, f = w.shape
    fp = f + (-f % b)
    padded = np.zeros((k, fp), F32)
    padded[:, :f] = w
    tiles = padded.reshape(k // b, b, fp // b, b).transpose(0, 2, 1, 3).reshape(-1, b * b)
    codes, scales = quantize_rows(tiles, Format(fmt.kind, FP4, b * b), global_scale)
    codes = codes.reshape(k // b, fp // b, b, b).transpose(0, 2, 1, 3).reshape(k, fp)[:, :f]
    scales = scales.reshape(k // b, fp // b)
    return codes, np.repeat(scales, b, axis=1)[:, :f], np.repeat(scales.T, b, axis=1)


def hadamard_rows(v: np.ndarray, d: int, mask: int) -> np.ndarray:
    """``M v`` for float32 ``v [R, C]``: per block of ``d`` rows of each column, row ``i``
    negated where bit ``i`` of ``mask`` is set, then the unnormalised Walsh-Hadamard
    butterfly in float32, stage ``s`` mapping the pair ``(i, i + 2^s)`` (bit ``s`` of ``i``
    clear) to ``(a + b, a - b)``, stages in increasing ``s``."""
    rows, cols = v.shape
    out = np.asarray(v, F32).reshape(rows // d, d, cols).copy()
    for i in range(d):
        if (mask >> i) & 1:
            out[:, i] = -out[:, i]
    span = 1
    while span < d:
        for i in range(d):
            if not i & span:
                a, b = out[:, i].copy(), out[:, i + span].copy()
                out[:, i], out[:, i + span] = a + b, a - b
        span *= 2
    return out.reshape(rows, cols)


def gradient_bits(key, stream: int, rows: int, cols: int) -> np.ndarray | None:
    """The random bits of the gradient's copy ``stream`` (uint32 ``[rows, cols]``), or None
    without a key."""
    if key is None:
        return None
    return np.asarray(random_bits(stream_key(key_words(key), stream), rows, cols))


@dataclasses.dataclass(frozen=True)
class Parts:
    """The FP4 training parts of a twin call: the caller's key (stochastic rounding of the
    gradient's copies; None: to nearest), the Hadamard sign mask (None: no transform), and
    whether the weight is quantised in 2-D tiles."""

    key: object = None
    hadamard: int | None = None
    weight_tiles: bool = False


def _nvfp4(fmt: Format) -> bool:
    return fmt.kind == "nvfp4"


@functools.cache
def _gemm_program(out_dtype, global_scales: bool):
    if global_scales:
        return jax.jit(
            lambda a, s, w, t, ga, gw: fp8_matmul(
                a, s, w, t, out_dtype=out_dtype, a_global_scale=ga, w_global_scale=gw
            )
        )
    return jax.jit(lambda a, s, w, t: fp8_matmul(a, s, w, t, out_dtype=out_dtype))


def _gemm(a, a_scales, w, w_scales, out_dtype, a_global=None, w_global=None):
    """fp8_matmul on the CPU, float32 products; NVFP4 with both global scales."""
    operands = [a, a_scales, w, w_scales]
    if a_global is not None:
        operands += [np.asarray(a_global, F32), np.asarray(w_global, F32)]
    cpu = jax.devices("cpu")[0]
    program = _gemm_program(np.dtype(out_dtype), a_global is not None)
    return np.asarray(program(*(jax.device_put(np.asarray(v), cpu) for v in operands)))


def layer(
    name,
    keywords,
    x,
    gamma,
    w,
    g,
    residual=None,
    d_residual_out=None,
    result_dtype=None,
    parts: Parts = Parts(),
):
    """The layer of recipe ``name`` (``keywords``: the norm's keywords, the recipe's data
    included) on ``x [M, K]`` (and ``residual``), ``gamma``, ``w [K, F]``, with the
    cotangent ``g [M, F]`` of ``out`` (and ``d_residual_out`` of ``residual_out``) and an
    FP4 recipe's training ``parts``: ``{"out", "dx", "dgamma", "dw"}`` (and
    ``"residual_out"``, ``"dresidual"``), each in the dtype the layer returns."""
    weight_fmt, grad_fmt, columnwise = SPEC_TABLE[name]
    # Rows that are not whole blocks of the columnwise codes: the spec's zero rows, whose
    # cotangents are zero, appended; the caller's rows returned.
    rows = x.shape[0]
    extra = -rows % weight_fmt.block if columnwise and weight_fmt.block else 0
    if extra:
        padded = [
            None if v is None else np.concatenate([v, np.zeros((extra, v.shape[1]), v.dtype)])
            for v in (x, g, residual, d_residual_out)
        ]
        result = layer(
            name, keywords, padded[0], gamma, w, padded[1], *padded[2:], result_dtype, parts
        )
        return {k: v if k in ("dgamma", "dw") else v[:rows] for k, v in result.items()}
    result_dtype = np.dtype(x.dtype if result_dtype is None else result_dtype)
    nvfp4 = _nvfp4(weight_fmt)
    # NVFP4's activations: each row's own global scale unless the caller gives one (and
    # then each column's for the columnwise codes), returned by the norm.
    per_row = nvfp4 and keywords.get("global_scale") in (None, "per_row")
    norm = dict(keywords, columnwise=columnwise)
    if per_row:
        norm["global_scale"] = "per_row"
    if residual is None:
        outs = reference_on_cpu(reference.rms_norm_fp8_training, x, gamma, **norm)
        y, scales, r = outs[:3]
    else:
        outs = reference_on_cpu(reference.add_rms_norm_fp8_training, x, residual, gamma, **norm)
        y, scales, residual_out, r = outs[:4]
    # NVFP4's global scales: the norm's, given by the caller (1 unless given) or each row's;
    # the weight's from max|w| (w and w^T alike); G's per row (dgrad) and for the whole G
    # (wgrad).
    w32, g32 = np.asarray(w, F32), np.asarray(g, F32)
    row_global = np.asarray(outs[4 if residual is not None else 3], F32) if per_row else None
    column_global = np.asarray(outs[-1], F32) if per_row and columnwise else None
    norm_gs = (F32(1.0) if per_row else F32(keywords.get("global_scale", 1.0))) if nvfp4 else None
    w_gs = nvfp4_global_scale(np.abs(w32).max()) if nvfp4 else None

    # Forward: w quantised along K (its rows' axis) in each column, or in 2-D tiles whose
    # codes the dgrad GEMM reads too.
    if parts.weight_tiles:
        w_codes, w_scales, wt_scales = quantize_tiles(w32, weight_fmt, w_gs)
        wt_codes = w_codes.T
    else:
        w_codes, w_scales = quantize_columns(w32, weight_fmt, w_gs)
        # w^T [F, K] along F in each column (w's rows).
        wt_codes, wt_scales = quantize_columns(w32.T, weight_fmt, w_gs)
    if per_row:  # each row's global scale multiplies its row of the float32 product
        out = (_gemm(y, scales, w_codes, w_scales, F32, norm_gs, w_gs) * row_global).astype(
            result_dtype
        )
    else:
        out = _gemm(y, scales, w_codes, w_scales, result_dtype, norm_gs, w_gs)

    # dgrad: G quantised along F in each row, stochastically with the dgrad stream's bits.
    row_gs = nvfp4_global_scale(np.abs(g32).max(1, keepdims=True)) if nvfp4 else None
    bits = gradient_bits(parts.key, DGRAD_STREAM, *g32.shape)
    g_codes, g_scales = quantize_rows(g32, grad_fmt, row_gs, bits)
    dn = _gemm(g_codes, g_scales, wt_codes, wt_scales, F32, F32(1.0) if nvfp4 else None, w_gs)
    if nvfp4:  # each row's global scale multiplies its row of dn after the GEMM
        dn = dn * row_gs

    # wgrad: G quantised along the rows in each column; the columnwise codes of n, or for
    # the per-row recipe y^T with unit scales and G's rows multiplied by y's scales.
    # With the Hadamard transform, both operands transformed in blocks of d rows before
    # their columnwise quantisation: n (the norm's step 5, (h * r) * (gamma + offset)) and
    # G; dW = (M X)^T (M G) / d.
    if columnwise:
        n_codes, n_scales = outs[-3:-1] if per_row else outs[-2:]
        gw = g32
    else:
        n_codes, n_scales = np.asarray(y).T, np.ones((y.shape[1], 1), F32)
        gw = g32 * np.asarray(scales, F32)
    if parts.hadamard is not None:
        d = grad_fmt.block
        h = np.asarray(x, F32) + (0 if residual is None else np.asarray(residual, F32))
        gamma32 = np.asarray(gamma, F32) + F32(keywords.get("weight_offset", 0.0))
        n = (h * np.asarray(r, F32).reshape(-1, 1)) * gamma32
        # The transform's values are at most d times n's: its codes are quantised under d
        # times the global scale (the call's, or each column's), which the norm returns.
        if nvfp4:
            column_global = F32(d) * (norm_gs if column_global is None else column_global)
        n_codes, n_scales = quantize_rows(
            hadamard_rows(n, d, parts.hadamard).T, weight_fmt, column_global
        )
        gw = hadamard_rows(gw, d, parts.hadamard)
    gw_gs = nvfp4_global_scale(np.abs(gw).max()) if nvfp4 else None
    bits = gradient_bits(parts.key, WGRAD_STREAM, *gw.shape)
    gw_codes, gw_scales = quantize_columns(gw, grad_fmt, gw_gs, bits)
    if nvfp4 and column_global is not None:  # each column of n's scale multiplies dw's row
        dw = _gemm(n_codes, n_scales, gw_codes, gw_scales, F32, F32(1.0), gw_gs)
        dw = dw * np.asarray(column_global, F32).reshape(-1, 1)
    else:
        dw = _gemm(n_codes, n_scales, gw_codes, gw_scales, F32, norm_gs, gw_gs)
    if parts.hadamard is not None:
        dw = dw * F32(1.0 / grad_fmt.block)

    wo = keywords.get("weight_offset", 0.0)
    if residual is None:
        dx, dgamma = reference_on_cpu(
            reference.rms_norm_backward, dn, x, gamma, r, weight_offset=wo
        )
        result = {"dx": dx}
    else:
        dx, dresidual, dgamma = reference_on_cpu(
            reference.add_rms_norm_backward,
            dn,
            np.asarray(d_residual_out).astype(residual.dtype),
            x,
            residual,
            gamma,
            r,
            weight_offset=wo,
        )
        result = {"dx": dx, "dresidual": dresidual, "residual_out": residual_out}
    return {
        "out": out,
        **result,
        "dgamma": dgamma.astype(gamma.dtype),
        "dw": dw.astype(w.dtype),
    }
