"""``python -m jax_fp8norm.bench``: device time of the fused kernels next to the other ways
of computing the same thing, in one run, on the default backend (docs/performance.md).

For each op and shape it times, on the same device, the implementations of
:mod:`jax_fp8norm.bench.implementations`: the kernel (one entry per CUDA kernel variant
with ``--variants``), XLA's jit of the reference twin and of the textbook formula,
``torch.compile`` of the formula when torch is importable, and copies of the same bytes.

Time per call is device time (:mod:`jax_fp8norm.bench.timing`): K calls serialised in one
jitted program, each fed through an ``optimization_barrier`` that holds the previous
call's outputs, minus one call, ``(T(K) - T(1)) / (K - 1)``, T the shortest of
``--repeats`` runs. The K calls rotate among K distinct inputs so that the working set is
past the last-level cache. Effective bandwidth is the op's bytes (x, residual and gamma
read; y, residual_out and scales written) over that time.

Prints a table, writes JSON (``--json``) and, when matplotlib is importable, a PNG
(``--png``, :mod:`jax_fp8norm.bench.figure`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax

import jax_fp8norm as fp8norm
from jax_fp8norm import _ffi
from jax_fp8norm._dtypes import DTYPE_BY_NAME
from jax_fp8norm.bench import figure, runner
from jax_fp8norm.bench.implementations import IMPLS
from jax_fp8norm.bench.ops import OPS
from jax_fp8norm.bench.presets import PRESETS
from jax_fp8norm.bench.report import Result, format_table, machine, summary, write_json


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


def parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="timed runs of each program; the shortest counts, since interference only "
        "adds time (default: 7)",
    )
    parser.add_argument("--json", default="fp8norm_bench.json", help="results file")
    parser.add_argument("--png", default="fp8norm_bench.png", help="plot file ('' for none)")
    return parser


# The all-reduce op runs on every device at once: a report of its own
# (jax_fp8norm.bench.allreduce), which ``--ops allreduce_residual_rms_norm_fp8`` runs with
# its defaults.
ALLREDUCE_OP = "allreduce_residual_rms_norm_fp8"


def main(argv: Sequence[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.ops == (ALLREDUCE_OP,):
        from jax_fp8norm.bench import allreduce

        rows = ["--rows", ",".join(map(str, args.rows))] if args.rows else []
        hidden = ["--hidden", str(args.hidden[0])] if args.hidden else []
        return allreduce.main(rows + hidden)
    for name in args.ops:
        if name not in OPS:
            cli.error(f"--ops: unknown op {name!r}; choose from {(*OPS, ALLREDUCE_OP)}")
    for name in args.impls:
        if name not in IMPLS:
            cli.error(f"--impls: unknown implementation {name!r}; choose from {IMPLS}")
    for name in args.dtypes or ():
        if name not in DTYPE_BY_NAME:
            cli.error(f"--dtypes: unknown dtype {name!r}; choose from {tuple(DTYPE_BY_NAME)}")
    variants = args.variants
    if variants:
        known = fp8norm.cuda_kernel_variants()
        variants = tuple(known) if variants == ("all",) else variants
        for name in variants:
            if name not in known:
                cli.error(f"--variants: unknown CUDA kernel variant {name!r}; choose from {known}")
        if jax.default_backend() != "gpu" and not _ffi.emulating():
            cli.error(
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

    runner.run(
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
        if figure.draw(results, args.png, info):
            print(f"wrote {args.png}")
        else:
            print("matplotlib is not importable: no plot (pip install matplotlib)")
    return 0
