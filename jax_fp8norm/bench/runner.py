"""One benchmark run: every implementation asked for, looked up in the registry, timed on
each op and shape of the grid, on the default backend's first device."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from jax_fp8norm._dtypes import DTYPE_BY_NAME
from jax_fp8norm.bench import timing
from jax_fp8norm.bench.implementations import IMPLS, REGISTRY, kernel_function
from jax_fp8norm.bench.ops import OPS, op_bytes, shape_inputs
from jax_fp8norm.bench.presets import PRESETS, default_preset, grid
from jax_fp8norm.bench.registry import Case
from jax_fp8norm.bench.report import Result


def bench_shape(
    op: str,
    rows: int,
    hidden: int,
    dtype_name: str,
    impls: Sequence[str],
    preset: dict,
    repeats: int,
    variants: Sequence[str] = (),
) -> list[Result]:
    """Times the implementations named on one op and shape, in the order named; those that
    do not compute the op, or do not run on this backend, are left out."""
    device = jax.devices()[0]
    dtype = DTYPE_BY_NAME[dtype_name]
    nbytes = op_bytes(op, rows, hidden, dtype)
    first = shape_inputs(op, rows, hidden, dtype, 0, 1, device)
    probe = jax.jit(kernel_function(op))
    probe_seconds = timing.shortest_seconds(lambda: jax.block_until_ready(probe(*first[0])), 3)
    # One input set per call: XLA merges calls whose inputs are the same values, barrier
    # or not.
    calls = timing.calls_for(nbytes, preset, probe_seconds)
    input_sets = first + shape_inputs(op, rows, hidden, dtype, 1, calls, device)
    case = Case(op, rows, hidden, dtype_name, nbytes, tuple(input_sets), calls, repeats, device)
    results = []
    for name in impls:
        if name not in REGISTRY:
            raise ValueError(f"unknown implementation {name!r}")
        for impl in REGISTRY.expand(name, variants):
            if not impl.supports(op, device.platform):
                continue
            measured = impl.measure(case)
            if measured is None:
                continue
            results.append(
                Result(op, impl.name, dtype_name, rows, hidden, nbytes, measured.seconds,
                       measured.calls, measured.distinct_inputs, impl.checked)
            )  # fmt: skip
    return results


def run(
    preset_name: str | None = None,
    ops: Sequence[str] = OPS,
    impls: Sequence[str] = IMPLS,
    rows: Sequence[int] | None = None,
    hidden: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
    repeats: int = 7,
    log: Callable[[str], None] | None = print,
    on_shape: Callable[[list[Result]], None] | None = None,
    variants: Sequence[str] = (),
) -> list[Result]:
    """Every op over the preset's grid (or the rows, hidden sizes and dtypes given)."""
    preset = PRESETS[preset_name or default_preset(jax.default_backend())]
    results = []
    for op in ops:
        for dtype, r, h in grid(preset, rows, hidden, dtypes):
            shape_results = bench_shape(op, r, h, dtype, impls, preset, repeats, variants)
            results += shape_results
            if on_shape is not None:
                on_shape(shape_results)
            if log is not None:
                log(
                    f"  {op} {dtype} {r} x {h}: "
                    + ", ".join(f"{x.impl} {x.seconds * 1e6:.1f} us" for x in shape_results)
                )
    return results
