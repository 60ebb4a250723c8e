"""Global-memory traffic of the CUDA kernel variants at the benchmark's hidden sizes,
measured by the SIMT emulation's accounting (docs/simt.md); prints the Markdown table of
docs/performance.md.

    python tools/reports/simt_memory_report.py [--rows 4] [--variants block_shared,warp_rows]
        [--layout fp8|nvfp4|mxfp4] [--hidden 4096,7168]

Each shape runs `--rows` rows on the emulated kernels (every row of a shape takes the same
path, so the per-row figures hold for any row count) and is checked against the reference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm
from jax_fp8norm import simt
from jax_fp8norm._dtypes import DTYPE_BY_NAME
from jax_fp8norm.bench.presets import PRESETS
from jax_fp8norm.testing import assert_matches_reference

# The benchmark's GPU preset: its dtype at every hidden size, the spot-check dtypes at the
# spot shapes' hidden sizes.
_GPU = PRESETS["gpu"]
SHAPES = [(DTYPE_BY_NAME[d], h) for d in _GPU["dtypes"] for h in _GPU["hidden"]] + [
    (DTYPE_BY_NAME[d], h)
    for d in _GPU["spot_dtypes"]
    for h in sorted({h for _, h in _GPU["spot_shapes"]})
]


# The scale layouts it can count: per-row FP8 scales, and the FP4 formats.
LAYOUTS = {
    "fp8": {},
    "nvfp4": {"recipe": "nvfp4", "global_scale": 0.002},
    "mxfp4": {"recipe": "mxfp4"},
}


def measure(op: str, dtype, hidden: int, rows: int, variant: str, layout: str = "fp8") -> dict:
    """The traffic of one emulated launch of a variant, per row, checked against the
    reference."""
    keywords = LAYOUTS[layout]
    rng = np.random.default_rng(hidden)
    x = rng.standard_normal((rows, hidden)).astype(jnp.dtype(dtype))
    gamma = rng.uniform(-2, 2, hidden).astype(np.float32)
    args = (x, gamma) if op == "rms_norm_fp8" else (x, x[::-1].copy(), gamma)
    with simt.kernels(), fp8norm.use_cuda_kernel(variant):
        simt.take_launches()
        out = jax.jit(lambda *a: getattr(fp8norm, op)(*a, **keywords))(*args)
        jax.block_until_ready(out)
        (launch,) = [entry for entry in simt.take_launches() if "x" in entry["buffers"]]
    ref = jax.jit(lambda *a: getattr(fp8norm.reference, op)(*a, **keywords))(*args)
    assert_matches_reference([np.asarray(o) for o in out], [np.asarray(r) for r in ref])
    assert launch["error"] == "", launch["error"]
    inputs = ("x", "gamma") if op == "rms_norm_fp8" else ("x", "residual", "gamma")
    inputs += ("scale_operand",) if "scale_operand" in launch["buffers"] else ()
    buffers = launch["buffers"]
    # What each row must move at the least: its x (and residual) and gamma read once, its
    # outputs written once.
    ideal_read = sum(buffers[n]["bytes"] for n in inputs if n not in ("gamma", "scale_operand"))
    ideal_read += rows * sum(buffers[n]["bytes"] for n in inputs if n in ("gamma", "scale_operand"))
    ideal_written = sum(b["bytes"] for n, b in buffers.items() if n not in inputs)
    read = sum(buffers[n]["bytes_read"] for n in inputs)
    written = sum(b["bytes_written"] for n, b in buffers.items() if n not in inputs)
    sectors = sum(b["sectors"] for b in buffers.values())
    min_sectors = sum(b["min_sectors"] for b in buffers.values())
    return {
        # The kernel that ran: a register variant that cannot hold the row runs block_shared.
        "kernel": launch["kernel"],
        "threads": launch["threads"],
        "blocks": launch["blocks"],
        "barriers": launch["barriers"] / rows,
        "cached": launch["dynamic_shared_bytes"] > 0,
        "vector": buffers["x"]["widest_access"],
        "read": read / rows,
        "written": written / rows,
        "read_ratio": read / ideal_read,
        "written_ratio": written / ideal_written,
        "requests": sum(b["requests"] for b in buffers.values()) / rows,
        "sectors": sectors / rows,
        "min_sectors": min_sectors / rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/reports/simt_memory_report.py",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument(
        "--variants",
        default="block_shared,warp_rows,block_registers",
        help="comma-separated CUDA kernel variants",
    )
    parser.add_argument("--layout", default="fp8", choices=list(LAYOUTS))
    parser.add_argument(
        "--hidden", default="", help="comma-separated hidden sizes (default: the GPU preset's)"
    )
    args = parser.parse_args(argv)
    shapes = SHAPES
    if args.hidden:
        shapes = [(jnp.bfloat16, int(h)) for h in args.hidden.split(",")]
    print(
        "| variant (ran) | op | dtype | hidden | threads x blocks | row in shared memory "
        "| bytes per load | read per row (x ideal) | written per row (x ideal) "
        "| warp requests per row | sectors per row (fewest possible) | barriers per row |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for variant in args.variants.split(","):
        for op in ("rms_norm_fp8", "add_rms_norm_fp8"):
            for dtype, hidden in shapes:
                m = measure(op, dtype, hidden, args.rows, variant, args.layout)
                ran = variant if m["kernel"] == variant else f"{variant} ({m['kernel']})"
                print(
                    f"| {ran} | {op} | {jnp.dtype(dtype).name} | {hidden} "
                    f"| {m['threads']} x {m['blocks']} | {'yes' if m['cached'] else 'no'} "
                    f"| {m['vector']} | {m['read']:.0f} ({m['read_ratio']:.2f}) "
                    f"| {m['written']:.0f} ({m['written_ratio']:.2f}) | {m['requests']:.0f} "
                    f"| {m['sectors']:.0f} ({m['min_sectors']:.0f}) | {m['barriers']:.1f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
