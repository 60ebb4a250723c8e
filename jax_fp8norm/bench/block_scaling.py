"""Per-row against block-scaled (FP8 and FP4) and static scales in one process, calls
interleaved.

``python -m jax_fp8norm.bench`` times one op over its whole grid before the next, so on a
noisy machine (a shared 2-core VM) its ops meet different conditions. This compares the
scale layouts of rms_norm_fp8 on one shape with their calls interleaved: each round calls
every layout once; the report gives each layout's minimum and median wall time per call
(the jitted function, dispatch included) and its ratio to the per-row op's.

    python -m jax_fp8norm.bench.block_scaling [--rows 4096] [--hidden 4096] [--rounds 40]
    FP8NORM_CPU_THREADS=1 python -m jax_fp8norm.bench.block_scaling   # one CPU thread
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jax_fp8norm as fp8norm
from jax_fp8norm.bench.ops import NVFP4_GLOBAL_SCALE
from jax_fp8norm.bench.timing import blocking, interleaved_seconds
from jax_fp8norm.recipes import RECIPES

# Each recipe, with the data it takes: a calibrated scale, NVFP4's global scale.
_RECIPE_DATA = {name: {} for name in RECIPES} | {
    "fp8_static": {"static_scale": 0.01},
    "nvfp4": {"global_scale": NVFP4_GLOBAL_SCALE},
}

# The recipes, and two layouts beside them: DeepSeek's group of 128 with its scales as
# e8m0 bytes, and a group of 32 with float32 scales (MXFP8's group without its format).
LAYOUTS = {
    **{name: dict(keywords, recipe=name) for name, keywords in _RECIPE_DATA.items()},
    "fp8_group128_ue8m0, e8m0 bytes": {
        "recipe": "fp8_group128_ue8m0",
        "scale_dtype": jnp.float8_e8m0fnu,
    },
    "group 32": {"group_size": 32},
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_fp8norm.bench.block_scaling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    x = jax.random.normal(jax.random.PRNGKey(0), (args.rows, args.hidden), jnp.bfloat16)
    gamma = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(1), (args.hidden,), jnp.float32)
    fns = {
        name: jax.jit(functools.partial(fp8norm.rms_norm_fp8, **kw)) for name, kw in LAYOUTS.items()
    }
    calls = {name: blocking(fn, x, gamma) for name, fn in fns.items()}
    _, times = interleaved_seconds(calls, args.rounds)
    base = min(times["fp8_row"])
    print(
        f"rms_norm_fp8, x bfloat16 {args.rows} x {args.hidden}, gamma float32, on "
        f"{jax.devices()[0].device_kind}; {args.rounds} interleaved rounds"
    )
    for name, t in times.items():
        print(
            f"  {name:>30}: min {min(t) * 1e3:8.3f} ms  median {statistics.median(t) * 1e3:8.3f}"
            f" ms  min / per-row min {min(t) / base:5.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
