"""The weight quantiser's kernel (jax_fp8norm.quantize.quantize_weight_tiles: FP4 square
tiles, docs/spec.md "2-D weight scales"; and quantize_columns's FP8 E4M3 along K): its bits
against the jnp statements (weight_tiles_reference, quantize_per_channel, quantize_blocks)
on every platform, the forward's and the dgrad's views of one set of codes, the edge
tiles, its argument checks and a global scale whose bits do not depend on how many
threads reduce it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXTENDED, outputs_of_script, run_on, same_bits

from jax_fp8norm import _ffi
from jax_fp8norm._dtypes import E4M3, E8M0, FP4
from jax_fp8norm.quantize import (
    quantize_blocks,
    quantize_columns,
    quantize_per_channel,
    quantize_weight_tiles,
    tile_scales,
    weight_tiles_reference,
)
from jax_fp8norm.recipes import RECIPES

FORMATS = {name: RECIPES[name].weight for name in ("nvfp4", "mxfp4")}
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _weights(k: int, f: int, dtype, seed: int = 0) -> np.ndarray:
    """Normal weights whose magnitude changes from element to element over a few binades
    (so that each tile's scale differs from its neighbours'), with one zero tile."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, f)) * 2.0 ** rng.integers(-6, 7, (k, f))
    w[:16, :16] = 0.0
    return jnp.asarray(w.astype(np.float32)).astype(dtype)


def _reference(w, fmt):
    with jax.default_device(jax.devices("cpu")[0]):
        fn = jax.jit(lambda v: weight_tiles_reference(v, fmt.block, fmt is FORMATS["nvfp4"]))
        return tuple(None if o is None else np.asarray(o) for o in fn(w))


def _kernel(platform, w, fmt):
    def quantize(v):
        codes, scales, gs = quantize_weight_tiles(v, fmt)
        return codes, scales, jnp.float32(1.0) if gs is None else gs

    codes, scales, gs = run_on(platform, quantize, w)
    return codes, scales, gs if fmt is FORMATS["nvfp4"] else None


def _assert_matches_twin(platform, w, fmt):
    got, want = _kernel(platform, w, fmt), _reference(w, fmt)
    for name, g, r in zip(("codes", "scales", "global scale"), got, want, strict=True):
        if r is None:
            assert g is None
        else:
            same_bits(g, r, name)
    return got


# Both formats, F a multiple of the tile and not, every dtype of the master weights; the
# default tier keeps the cases a 64-row weight covers in one dtype each.
CASES = [
    pytest.param(name, f, dtype, marks=() if default else EXTENDED)
    for name in FORMATS
    for f in (64, 70)
    for dtype in DTYPES
    for default in [
        (name, f, dtype)
        in {
            ("nvfp4", 64, jnp.float32),
            ("nvfp4", 70, jnp.bfloat16),
            ("mxfp4", 64, jnp.float16),
            ("mxfp4", 70, jnp.float32),
        }
    ]
]


@pytest.mark.parametrize(("name", "f", "dtype"), CASES, ids=str)
def test_tiles_match_the_twin(platform, name, f, dtype):
    _assert_matches_twin(platform, _weights(64, f, dtype), FORMATS[name])


@pytest.mark.parametrize("name", FORMATS)
def test_forward_and_dgrad_views_read_the_same_codes(name):
    """The codes dequantised with the forward's scales (blocks along K) equal, transposed,
    the same codes dequantised with the dgrad's (blocks along F) exactly; a tile's scale
    taken from its neighbour's tile (along F or along K) changes them, so the bits test
    above catches a kernel that reads the wrong tile."""
    fmt = FORMATS[name]
    block = fmt.block
    k, f = 2 * block, 3 * block
    codes, scales, _ = _kernel("cpu", _weights(k, f, jnp.float32), fmt)
    values = codes.astype(np.float32)

    def forward(s):
        return values * np.asarray(tile_scales(s, block, f, transposed=False)).astype(
            np.float32
        ).repeat(block, axis=0)

    dgrad = values.T * np.asarray(tile_scales(scales, block, f, transposed=True)).astype(
        np.float32
    ).repeat(block, axis=0)
    np.testing.assert_array_equal(forward(scales), dgrad.T)
    assert np.isfinite(dgrad).all()
    for axis in (0, 1):
        assert not np.array_equal(forward(np.roll(scales, 1, axis=axis)), forward(scales))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("special", [np.nan, -np.inf])
def test_a_non_finite_tile(platform, name, special):
    """MXFP4: the tile holding NaN or Inf gets a NaN scale and zero codes, the others
    theirs. NVFP4: the global scale is NaN or Inf, and no tile scale takes it."""
    fmt = FORMATS[name]
    w = np.array(_weights(64, 70, jnp.float32))
    w[fmt.block + 3, 2 * fmt.block - 1] = special
    codes, scales, gs = _assert_matches_twin(platform, jnp.asarray(w), fmt)
    nan_scale = 0x7F if name == "nvfp4" else 0xFF
    bad = (1, 1)
    assert scales.view(np.uint8)[bad] == nan_scale
    tile = codes.view(np.uint8)[fmt.block : 2 * fmt.block, fmt.block : 2 * fmt.block]
    assert not tile.any()
    others = np.delete(scales.view(np.uint8).reshape(-1), bad[0] * scales.shape[1] + bad[1])
    if name == "nvfp4":
        assert (others == nan_scale).all() and not codes.view(np.uint8).any()
        assert np.isnan(gs) if np.isnan(special) else np.isinf(gs)
    else:
        assert (others != nan_scale).all()


@pytest.mark.parametrize("name", FORMATS)
def test_zero_tiles(platform, name):
    """A zero tile: scale 0 (NVFP4) or 2^-127 (MXFP4, e8m0's byte 0) and zero codes; an
    all-zero weight's global scale is 1."""
    fmt = FORMATS[name]
    codes, scales, gs = _assert_matches_twin(platform, jnp.zeros((64, 40), jnp.bfloat16), fmt)
    assert not codes.view(np.uint8).any() and not scales.view(np.uint8).any()
    if name == "nvfp4":
        assert gs == 1.0


@pytest.mark.parametrize("name", FORMATS)
def test_k_not_a_multiple_of_the_tile(name):
    fmt = FORMATS[name]
    with pytest.raises(ValueError, match=f"K a multiple of {fmt.block}; got K = {fmt.block + 2}"):
        quantize_weight_tiles(jnp.ones((fmt.block + 2, 64)), fmt)


def test_an_fp8_format_is_refused():
    with pytest.raises(ValueError, match="2-D weight tiles are FP4's"):
        quantize_weight_tiles(jnp.ones((64, 64)), RECIPES["mxfp8"].weight)


def test_vmap_quantises_each_weight_alone():
    fmt = FORMATS["nvfp4"]
    ws = jnp.stack([_weights(32, 48, jnp.float32, seed) for seed in (1, 2)])
    batched = jax.vmap(lambda w: quantize_weight_tiles(w, fmt))(ws)
    for i in range(2):
        for got, want in zip(batched, quantize_weight_tiles(ws[i], fmt), strict=True):
            same_bits(got[i], want)


_ONE_THREAD_SCRIPT = """
import sys
import jax.numpy as jnp, numpy as np
from test_quantize_weight import FORMATS, threads_case
from jax_fp8norm.quantize import quantize_weight_tiles
codes, scales, gs = quantize_weight_tiles(jnp.asarray(threads_case({nan})), FORMATS["nvfp4"])
np.savez(sys.argv[1], codes=np.asarray(codes).view(np.uint8),
         scales=np.asarray(scales).view(np.uint8), gs=np.asarray(gs))
"""


def threads_case(nan: bool) -> np.ndarray:
    """A weight the CPU kernel splits into 16 tasks; with ``nan``, NaNs of different signs
    and payloads in different tasks' bands: a reduction that kept the first NaN it met
    would give bits that depend on the order of the tasks."""
    w = np.array(_weights(1024, 256, jnp.float32, seed=3))
    if nan:
        nans = np.array([0x7FC00001, 0xFFC00002, 0x7F800003, 0xFFFFFFFF], np.uint32)
        for i, value in enumerate(nans.view(np.float32)):
            w[100 + 250 * i, 7 * i] = value
    return w


@pytest.mark.parametrize("nan", [False, True])
def test_the_global_scale_does_not_depend_on_the_thread_count(nan, tmp_path):
    """One thread (FP8NORM_CPU_THREADS=1, in a process of its own) and the pool's give the
    same bits, the twin's global scale among them."""
    w = jnp.asarray(threads_case(nan))
    codes, scales, gs = (np.asarray(o) for o in quantize_weight_tiles(w, FORMATS["nvfp4"]))
    script = _ONE_THREAD_SCRIPT.format(nan=nan)
    one_thread = outputs_of_script(script, tmp_path / "one.npz", FP8NORM_CPU_THREADS="1")
    same_bits(one_thread["gs"], gs, "global scale")
    same_bits(one_thread["codes"], codes.view(np.uint8), "codes")
    same_bits(one_thread["scales"], scales.view(np.uint8), "scales")
    same_bits(gs, _reference(w, FORMATS["nvfp4"])[2], "the twin's global scale")


FP8_RECIPES = ("fp8_row", "mxfp8", "fp8_group128")
FP8_CASES = [
    pytest.param(name, f, dtype, marks=() if default else EXTENDED)
    for name in FP8_RECIPES
    for f in (48, 300)
    for dtype in DTYPES
    for default in [
        (name, f, dtype)
        in {
            ("fp8_row", 300, jnp.bfloat16),
            ("mxfp8", 48, jnp.float32),
            ("fp8_group128", 300, jnp.float16),
        }
    ]
]


def _fp8_reference(w, fmt):
    with jax.default_device(jax.devices("cpu")[0]):
        if fmt.block is None:
            fn = jax.jit(lambda v: quantize_per_channel(v, fmt.element))
        else:
            fn = jax.jit(lambda v: quantize_blocks(v, fmt.block, fmt.element))
        return tuple(np.asarray(o) for o in fn(w))


@pytest.mark.parametrize(("name", "f", "dtype"), FP8_CASES, ids=str)
@pytest.mark.parametrize("special", [False, True])
def test_fp8_columns_match_the_twin(platform, name, f, dtype, special):
    """quantize_columns in an FP8 weight format (per channel, e8m0 blocks of 32 and 128
    rows) against quantize_per_channel and quantize_blocks; with a NaN in one column and
    an Inf in another (the block's scale NaN and its codes zero; per channel, a NaN
    column's scale 1, an Inf column's Inf)."""
    fmt = RECIPES[name].weight
    w = np.array(_weights(256, f, jnp.float32, seed=f))
    if special:
        w[5, 0], w[200, f - 1] = np.nan, np.inf
    w = jnp.asarray(w).astype(dtype)
    got = run_on(platform, lambda v: quantize_columns(v, fmt)[:2], w)
    want = _fp8_reference(w, fmt)
    for what, g, r in zip(("codes", "scales"), got, want, strict=True):
        same_bits(g, r, what)


@pytest.mark.parametrize(
    "fmt",
    [RECIPES[n].weight for n in ("nvfp4", "mxfp4", "fp8_row", "mxfp8")],
    ids=["nvfp4", "mxfp4", "fp8_row", "mxfp8"],
)
def test_the_quantisers_lower_to_the_kernel(fmt):
    """The weight's quantisers call the kernel, not their jnp statements."""
    quantize = quantize_weight_tiles if fmt.element == jnp.float4_e2m1fn else quantize_columns
    hlo = jax.jit(lambda v: quantize(v, fmt)).lower(jnp.ones((64, 64), jnp.bfloat16)).as_text()
    assert "fp8norm_quantize_weight" in hlo


def _handler_call(handler: str, w, results, **attributes):
    target = (_ffi.EMULATED_TARGETS if handler == "simt" else _ffi.TARGETS)["quantize_weight"]
    attributes = {k: np.int64(v) for k, v in attributes.items()}
    return jax.jit(lambda v: jax.ffi.ffi_call(target, results)(v, **attributes))(w)


# Calls that bypass the Python checks: each handler refuses them with an error naming what
# is wrong, before any kernel runs.
HANDLER_CASES = {
    "K": ((24, 32), "nvfp4_tiles", 16, ((24, 32), FP4), ((1, 2), E4M3), "K = 24"),
    "format": ((32, 32), 7, 16, ((32, 32), FP4), ((2, 2), E4M3), "unknown format 7"),
    "scales": ((32, 32), "mxfp4_tiles", 32, ((32, 32), FP4), ((1, 2), E8M0), "scales must"),
    "codes": ((32, 32), "fp8_blocks", 32, ((32, 32), FP4), ((1, 32), E8M0), "codes must"),
    "block": ((32, 32), "nvfp4_tiles", 15, ((32, 32), FP4), ((2, 3), E4M3), "block must"),
}


@pytest.mark.parametrize("handler", ["cpu", "simt"])
@pytest.mark.parametrize("case", HANDLER_CASES)
def test_the_handlers_refuse_bad_calls(handler, case):
    shape, fmt, block, codes, scales, message = HANDLER_CASES[case]
    code = _ffi.WEIGHT_FORMAT_CODES.get(fmt, fmt)
    results = [
        jax.ShapeDtypeStruct(*codes),
        jax.ShapeDtypeStruct(*scales),
        jax.ShapeDtypeStruct((), jnp.float32),
    ]
    with pytest.raises(Exception, match=message):
        _handler_call(
            handler,
            jnp.ones(shape, jnp.float32),
            results,
            format=code,
            block=block,
            fp4_layout=_ffi.fp4_layout("cpu"),
        )
