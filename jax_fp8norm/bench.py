"""``python -m jax_fp8norm.bench``: device time of the fused kernels next to the other ways
of computing the same thing, in one run, on the default backend (docs/performance.md).

For each op and shape it times, on the same device:

- ``fp8norm``: this package's kernel; with ``--variants`` one column per CUDA kernel
  variant instead (``fp8norm:warp_rows`` and so on; ``--variants all`` for every one);
- ``xla_reference``: ``jax.jit`` of the pure-jnp twin (``jax_fp8norm.reference``), exact
  to the same bits as the kernel;
- ``xla_formula``: ``jax.jit`` of the textbook jnp formula (mean, rsqrt, amax, divide,
  clip, cast) a user would otherwise write;
- ``torch_compile``: ``torch.compile`` of that formula, when torch is importable;
- ``copy``: an element-wise copy moving the same number of bytes (the ceiling);
- ``numpy_copy`` (CPU backend only): ``np.copyto`` of the same number of bytes, one pair
  of buffers (so cache-resident for small shapes).

Time per call is device time: K calls serialised in one jitted program, each fed through
an ``optimization_barrier`` that holds the previous call's outputs, minus one call,
``(T(K) - T(1)) / (K - 1)``; dispatch and synchronisation cancel. The K calls rotate among
distinct inputs so that the working set is past the last-level cache. Effective bandwidth
is the op's bytes (x, residual and gamma read; y, residual_out and scales written) over
that time.

Prints a table, writes JSON (``--json``) and, when matplotlib is importable, a PNG
(``--png``): bandwidth against rows, one line per implementation, one panel per hidden
size, one row of panels per op and dtype.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform as host_platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm
from jax_fp8norm import _ffi, reference, testing
from jax_fp8norm._dtypes import DTYPE_BY_NAME

# The ops with other scale layouts: name -> (the op, its keywords). Only the kernel and the
# reference twin implement them; the other implementations are skipped for these.
SCALED_OPS = {
    "rms_norm_fp8/group128": ("rms_norm_fp8", {"group_size": 128}),
    "rms_norm_fp8/mxfp8": (
        "rms_norm_fp8",
        {"group_size": 32, "scale_dtype": jnp.float8_e8m0fnu},
    ),
    "rms_norm_fp8/static": ("rms_norm_fp8", {"static_scale": 0.05}),
}
OPS = ("rms_norm_fp8", "add_rms_norm_fp8", *SCALED_OPS)
IMPLS = ("fp8norm", "xla_reference", "xla_formula", "torch_compile", "copy", "numpy_copy")

# The grid of the performance issue: the GPU preset. The CPU preset is the part of it a
# development machine runs in minutes; "smoke" is for the tests of this module.
PRESETS = {
    "gpu": {
        "rows": (1, 16, 64, 256, 1024, 4096, 16384),
        "hidden": (2048, 4096, 7168, 8192, 16384),
        "dtypes": ("bfloat16",),
        "spot_dtypes": ("float16", "float32"),
        "spot_shapes": ((16, 4096), (4096, 4096), (16384, 8192)),
        "working_set": 256 << 20,
        "max_calls": 24,
    },
    "cpu": {
        "rows": (1, 16, 256, 4096),
        "hidden": (4096, 8192),
        "dtypes": ("bfloat16",),
        "spot_dtypes": ("float16", "float32"),
        "spot_shapes": ((4096, 4096),),
        "working_set": 128 << 20,
        "max_calls": 32,
    },
    "smoke": {
        "rows": (1, 8),
        "hidden": (256,),
        "dtypes": ("bfloat16",),
        "spot_dtypes": ("float32",),
        "spot_shapes": ((8, 256),),
        "working_set": 1 << 20,
        "max_calls": 4,
    },
}

# Long enough that timer resolution and launch jitter are small next to T(K) - T(1).
TARGET_SECONDS = 0.02


@dataclass
class Result:
    op: str
    impl: str
    dtype: str
    rows: int
    hidden: int
    bytes: int
    seconds: float  # device time per call
    calls: int  # K
    distinct_inputs: int  # input sets the K calls use: one per call, so equal to calls
    checked: bool  # outputs held to the reference's accuracy rule in this run

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


def base_op(op: str) -> str:
    """The op behind a benchmark op name ("rms_norm_fp8/group128" -> "rms_norm_fp8")."""
    return SCALED_OPS[op][0] if op in SCALED_OPS else op


def op_bytes(op: str, rows: int, hidden: int, dtype) -> int:
    """Bytes an op must move: x (and residual) and gamma read; y (and residual_out) and
    the scales written. gamma is counted in x's dtype, y as one byte per element."""
    keywords = SCALED_OPS[op][1] if op in SCALED_OPS else {}
    groups = hidden // keywords["group_size"] if "group_size" in keywords else 1
    scale_bytes = jnp.dtype(keywords.get("scale_dtype", jnp.float32)).itemsize
    itemsize = jnp.dtype(dtype).itemsize
    elements = rows * hidden
    moved = elements * itemsize + hidden * itemsize + elements + rows * groups * scale_bytes
    if base_op(op) == "add_rms_norm_fp8":
        moved += 2 * elements * itemsize
    return moved


# ---------------------------------------------------------------------------------------
# The implementations. Each takes (x, gamma) or (x, residual, gamma) and returns a tuple.
# ---------------------------------------------------------------------------------------


def formula_rms_norm_fp8(x, gamma, eps=reference.DEFAULT_EPS):
    """The textbook formula, without the reference's exactness (rsqrt, divide by scale)."""
    h = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    normed = h * r * gamma.astype(jnp.float32)
    scale = jnp.max(jnp.abs(normed), axis=-1, keepdims=True) / 448.0
    y = jnp.clip(normed / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return y, scale


def formula_add_rms_norm_fp8(x, residual, gamma, eps=reference.DEFAULT_EPS):
    h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    y, scale = formula_rms_norm_fp8(h, gamma, eps)
    return y, scale, h.astype(x.dtype)


JAX_IMPLS: dict[str, dict[str, Callable]] = {
    "fp8norm": {
        "rms_norm_fp8": fp8norm.rms_norm_fp8,
        "add_rms_norm_fp8": fp8norm.add_rms_norm_fp8,
        **{op: functools.partial(getattr(fp8norm, b), **k) for op, (b, k) in SCALED_OPS.items()},
    },
    "xla_reference": {
        "rms_norm_fp8": reference.rms_norm_fp8,
        "add_rms_norm_fp8": reference.add_rms_norm_fp8,
        **{op: functools.partial(getattr(reference, b), **k) for op, (b, k) in SCALED_OPS.items()},
    },
    "xla_formula": {
        "rms_norm_fp8": formula_rms_norm_fp8,
        "add_rms_norm_fp8": formula_add_rms_norm_fp8,
    },
}


def serialised(fn: Callable, calls: int) -> Callable:
    """A jitted program of ``calls`` calls of ``fn``, call k on input set k, each ordered
    after the previous one by an optimization_barrier that holds its outputs (so XLA
    neither reorders nor overlaps calls)."""

    def program(input_sets):
        outs = [fn(*input_sets[0])]
        for k in range(1, calls):
            args, _ = jax.lax.optimization_barrier((input_sets[k], outs[-1]))
            outs.append(fn(*args))
        # Every call's outputs are results: XLA drops a call whose outputs are unused.
        return outs

    return jax.jit(program)


def _min_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed runs after a warm-up: interference only adds."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def device_seconds(fn: Callable, input_sets: Sequence[tuple], calls: int, repeats: int) -> float:
    """(T(calls) - T(1)) / (calls - 1), T the shortest wall time of the jitted program."""
    one, many = serialised(fn, 1), serialised(fn, calls)
    inputs = tuple(input_sets)
    t_one = _min_seconds(lambda: jax.block_until_ready(one(inputs[:1])), repeats)
    assert len(inputs) == calls, "one input set per call"
    t_many = _min_seconds(lambda: jax.block_until_ready(many(inputs)), repeats)
    return max(t_many - t_one, 0.0) / (calls - 1)


def _plan(bytes_per_call: int, preset: dict, probe_seconds: float) -> int:
    """K: enough calls that they take about TARGET_SECONDS and that their inputs, one set
    per call, span the preset's working set, within the preset's limit."""
    for_time = TARGET_SECONDS / max(probe_seconds, 1e-7)
    for_working_set = preset["working_set"] / bytes_per_call
    return int(min(preset["max_calls"], max(4, for_time, for_working_set)))


def _inputs(op: str, rows: int, hidden: int, dtype, start: int, stop: int, device) -> list[tuple]:
    """Input sets start..stop-1 of a shape (the same values whenever asked for)."""
    key = jax.random.PRNGKey(rows * 7919 + hidden)
    gamma = jax.device_put(
        (1.0 + 0.1 * np.random.default_rng(hidden).standard_normal(hidden)).astype(dtype), device
    )
    sets = []
    for i in range(start, stop):
        kx, kr = jax.random.split(jax.random.fold_in(key, i))
        with jax.default_device(device):
            x = jax.random.normal(kx, (rows, hidden), dtype)
            if base_op(op) == "add_rms_norm_fp8":
                residual = jax.random.normal(kr, (rows, hidden), dtype)
                sets.append((x, residual, gamma))
            else:
                sets.append((x, gamma))
    return sets


def _copy_inputs(total_bytes: int, count: int, device) -> list[tuple]:
    # Half the op's bytes read and half written: the same traffic as the op.
    words = max(1, total_bytes // 8)
    key = jax.device_put(np.uint32(0x5A5A5A5A), device)
    return [(jax.device_put(np.full(words, i, np.uint32), device), key) for i in range(count)]


def _copy(words, key):
    return (words ^ key,)


def _numpy_copy_seconds(total_bytes: int, repeats: int) -> float:
    src = np.ones(max(1, total_bytes // 2), np.uint8)
    dst = np.empty_like(src)
    return _min_seconds(lambda: np.copyto(dst, src), repeats)


def _torch_seconds(op: str, input_sets: Sequence[tuple], calls: int, repeats: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    fp8 = torch.float8_e4m3fn

    def formula(x, gamma, residual=None):
        h = x.float() if residual is None else x.float() + residual.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + reference.DEFAULT_EPS)
        normed = h * r * gamma.float()
        scale = normed.abs().amax(-1, keepdim=True) / 448.0
        y = (normed / scale).clamp(-448.0, 448.0).to(fp8)
        return (y, scale) if residual is None else (y, scale, h.to(x.dtype))

    compiled = torch.compile(formula)
    sets = []
    for s in input_sets:
        t = [torch.from_numpy(np.asarray(a).astype(np.float32)).to(device) for a in s]
        t = [a.to(_torch_dtype(torch, s[0].dtype)) for a in t]
        sets.append((t[0], t[-1]) if op == "rms_norm_fp8" else (t[0], t[2], t[1]))

    def run(k: int):
        for i in range(k):
            compiled(*sets[i % len(sets)])
        if cuda:
            torch.cuda.synchronize()

    t_one = _min_seconds(lambda: run(1), repeats)
    t_many = _min_seconds(lambda: run(calls), repeats)
    return max(t_many - t_one, 0.0) / (calls - 1)


def _torch_dtype(torch, dtype):
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        jnp.dtype(dtype).name
    ]


def _check_kernel(op: str, args: tuple) -> None:
    """Holds the kernel's outputs on the timed inputs to the spec's accuracy rule against
    the reference twin (which meets it by definition)."""
    out = jax.jit(JAX_IMPLS["fp8norm"][op])(*args)
    ref = jax.jit(JAX_IMPLS["xla_reference"][op])(*args)
    testing.assert_matches_reference(out, ref)


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
    device = jax.devices()[0]
    dtype = DTYPE_BY_NAME[dtype_name]
    nbytes = op_bytes(op, rows, hidden, dtype)
    first = _inputs(op, rows, hidden, dtype, 0, 1, device)
    probe = jax.jit(JAX_IMPLS["fp8norm"][op])
    probe_seconds = _min_seconds(lambda: jax.block_until_ready(probe(*first[0])), 3)
    # One input set per call: XLA merges calls whose inputs are the same values, barrier
    # or not.
    calls = _plan(nbytes, preset, probe_seconds)
    input_sets = first + _inputs(op, rows, hidden, dtype, 1, calls, device)
    results = []
    for impl in impls:
        # The kernel and the reference twin promise the accuracy rule; the others do not.
        checked = impl in ("fp8norm", "xla_reference")
        if impl == "fp8norm" and variants:
            # The launch reads the variant on every call: one compiled program serves all.
            for variant in variants:
                with fp8norm.use_cuda_kernel(variant):
                    _check_kernel(op, input_sets[0])
                    seconds = device_seconds(JAX_IMPLS[impl][op], input_sets, calls, repeats)
                results.append(
                    Result(op, f"fp8norm:{variant}", dtype_name, rows, hidden, nbytes, seconds,
                           calls, calls, True)
                )  # fmt: skip
            continue
        if impl == "fp8norm":
            _check_kernel(op, input_sets[0])
        if op in SCALED_OPS and impl in ("xla_formula", "torch_compile"):
            continue  # per-row formulas only
        if impl in JAX_IMPLS:
            seconds = device_seconds(JAX_IMPLS[impl][op], input_sets, calls, repeats)
        elif impl == "copy":
            seconds = device_seconds(_copy, _copy_inputs(nbytes, calls, device), calls, repeats)
        elif impl == "numpy_copy":
            if device.platform != "cpu":
                continue
            seconds = _numpy_copy_seconds(nbytes, repeats)
        elif impl == "torch_compile":
            seconds = _torch_seconds(op, input_sets, calls, repeats)
            if seconds is None:
                continue
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        results.append(
            Result(op, impl, dtype_name, rows, hidden, nbytes, seconds, calls, calls, checked)
        )
    return results


def grid(preset: dict, rows=None, hidden=None, dtypes=None) -> list[tuple[str, int, int]]:
    """(dtype, rows, hidden) of a run: the main grid, then the spot checks in other dtypes."""
    rows = rows or preset["rows"]
    hidden = hidden or preset["hidden"]
    shapes = [(d, r, h) for d in (dtypes or preset["dtypes"]) for h in hidden for r in rows]
    if dtypes is None:
        shapes += [(d, r, h) for d in preset["spot_dtypes"] for r, h in preset["spot_shapes"]]
    return shapes


def _impls_of(results: Sequence[Result]) -> list[str]:
    """The implementations in the results, in the order they ran (variants included)."""
    return list(dict.fromkeys(r.impl for r in results))


def format_table(results: Sequence[Result]) -> str:
    impls = _impls_of(results)
    header = f"{'op':>21} {'dtype':>8} {'rows':>6} {'hidden':>6} " + "".join(
        f"{i:>24}" for i in impls
    )
    lines = [header, " " * 45 + "".join(f"{'us   GB/s':>24}" for _ in impls)]
    keys = dict.fromkeys((r.op, r.dtype, r.rows, r.hidden) for r in results)
    for op, dtype, rows, hidden in keys:
        row = {
            r.impl: r
            for r in results
            if (r.op, r.dtype, r.rows, r.hidden) == (op, dtype, rows, hidden)
        }
        cells = "".join(
            f"{row[i].seconds * 1e6:>15.1f} {row[i].gbps:>7.1f} " if i in row else f"{'-':>24}"
            for i in impls
        )
        lines.append(f"{op:>21} {dtype:>8} {rows:>6} {hidden:>6} {cells}")
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> list[str]:
    """Per shape: the kernel's speed-up over the fastest other implementation and its
    share of the copy bandwidth."""
    lines = []
    keys = dict.fromkeys((r.op, r.dtype, r.rows, r.hidden) for r in results)
    for key in keys:
        row = {r.impl: r for r in results if (r.op, r.dtype, r.rows, r.hidden) == key}
        others = [
            row[i].seconds for i in ("xla_reference", "xla_formula", "torch_compile") if i in row
        ]
        for impl in (i for i in row if i.startswith("fp8norm")):
            mine = row[impl]
            parts = [f"{key[0]:>21} {key[1]:>8} {key[2]:>6} x {key[3]:<6}"]
            if impl != "fp8norm":
                parts.append(f"{impl.removeprefix('fp8norm:'):>15}")
            if mine.seconds <= 0:
                parts.append("below the timer's resolution")
            elif others:
                parts.append(f"speed-up over the fastest other {min(others) / mine.seconds:6.2f}x")
            if "copy" in row:
                parts.append(f"{mine.gbps / row['copy'].gbps:6.1%} of copy bandwidth")
            if "numpy_copy" in row:
                parts.append(f"{mine.gbps / row['numpy_copy'].gbps:6.1%} of NumPy copy")
            lines.append("  ".join(parts))
    return lines


def machine() -> dict:
    device = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "host": host_platform.node(),
        "cpu": host_platform.processor() or host_platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jax_fp8norm": fp8norm.__version__,
        "cpu_kernel_variant": fp8norm.cpu_kernel_variant(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def draw(results: Sequence[Result], path: str) -> bool:
    """Bandwidth against rows: one panel per hidden size, one row of panels per op and
    dtype, one line per implementation. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = list(dict.fromkeys((r.op, r.dtype) for r in results))
    hiddens = sorted({r.hidden for r in results})
    fig, axes = plt.subplots(
        len(groups),
        len(hiddens),
        figsize=(3.2 * len(hiddens), 2.8 * len(groups)),
        squeeze=False,
        sharey="row",
    )
    for gi, (op, dtype) in enumerate(groups):
        for hi, hidden in enumerate(hiddens):
            ax = axes[gi][hi]
            if not any((r.op, r.dtype, r.hidden) == (op, dtype, hidden) for r in results):
                ax.set_visible(False)  # a spot-check dtype not run at this hidden size
                continue
            for impl in _impls_of(results):
                points = sorted(
                    (r.rows, r.gbps)
                    for r in results
                    if (r.op, r.dtype, r.hidden, r.impl) == (op, dtype, hidden, impl)
                )
                if len(points) > 0:
                    ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {dtype} N={hidden}", fontsize=8)
            ax.set_xlabel("rows", fontsize=8)
            if hi == 0:
                ax.set_ylabel("GB/s", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(
    preset_name: str | None = None,
    ops: Sequence[str] = OPS,
    impls: Sequence[str] = IMPLS,
    rows: Sequence[int] | None = None,
    hidden: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
    repeats: int = 7,
    log=print,
    on_shape: Callable[[list[Result]], None] | None = None,
    variants: Sequence[str] = (),
) -> list[Result]:
    preset = PRESETS[preset_name or ("gpu" if jax.default_backend() == "gpu" else "cpu")]
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


METHOD = (
    "(T(K) - T(1)) / (K - 1), T the shortest wall time of a jitted program of K calls "
    "serialised by optimization_barrier, rotating among distinct inputs"
)


def write_json(path: str, info: dict, results: Sequence[Result]) -> None:
    with open(path, "w") as f:
        json.dump(
            {
                "machine": info,
                "method": METHOD,
                "results": [asdict(r) | {"gbps": r.gbps} for r in results],
            },
            f,
            indent=1,
        )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_fp8norm.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default: gpu on a GPU, else cpu")
    parser.add_argument("--ops", type=_names, default=OPS, help="comma-separated")
    parser.add_argument("--impls", type=_names, default=IMPLS, help="comma-separated")
    parser.add_argument("--rows", type=_ints, help="comma-separated; replaces the preset's")
    parser.add_argument("--hidden", type=_ints, help="comma-separated; replaces the preset's")
    parser.add_argument("--dtypes", type=_names, help="comma-separated; no spot checks then")
    parser.add_argument(
        "--variants",
        type=_names,
        default=(),
        help="CUDA kernel variants to time side by side ('all' for every one); "
        "default: only the one FP8NORM_CUDA_KERNEL selects",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timings per median")
    parser.add_argument("--json", default="fp8norm_bench.json", help="results file")
    parser.add_argument("--png", default="fp8norm_bench.png", help="plot file ('' for none)")
    args = parser.parse_args(argv)
    for name in args.ops:
        if name not in OPS:
            parser.error(f"--ops: unknown op {name!r}; choose from {OPS}")
    for name in args.impls:
        if name not in IMPLS:
            parser.error(f"--impls: unknown implementation {name!r}; choose from {IMPLS}")
    for name in args.dtypes or ():
        if name not in DTYPE_BY_NAME:
            parser.error(f"--dtypes: unknown dtype {name!r}; choose from {tuple(DTYPE_BY_NAME)}")
    variants = args.variants
    if variants:
        known = fp8norm.cuda_kernel_variants()
        variants = tuple(known) if variants == ("all",) else variants
        for name in variants:
            if name not in known:
                parser.error(
                    f"--variants: unknown CUDA kernel variant {name!r}; choose from {known}"
                )
        if jax.default_backend() != "gpu" and not _ffi.emulating_cuda():
            parser.error(
                "--variants: the variants are CUDA kernels; run on a GPU, or with "
                "FP8NORM_EMULATE_CUDA=1 to run them emulated (whose times say nothing)"
            )

    info = machine()
    print(f"jax_fp8norm.bench on {info['backend']} ({info['device']}), jax {info['jax']}")
    results: list[Result] = []

    def save(new_results: list[Result]) -> None:
        # After every shape, so that a run cut short keeps what it measured.
        results.extend(new_results)
        write_json(args.json, info, results)

    run(
        args.preset,
        args.ops,
        args.impls,
        args.rows,
        args.hidden,
        args.dtypes,
        args.repeats,
        on_shape=save,
        variants=variants,
    )
    print()
    print(format_table(results))
    print()
    print("\n".join(summary(results)))
    print(f"\nwrote {args.json}")
    if args.png:
        if draw(results, args.png):
            print(f"wrote {args.png}")
        else:
            print("matplotlib is not importable: no plot (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
