"""The benchmark's PNG: bandwidth against rows, one line per implementation, one panel per
hidden size, one row of panels per op and dtype."""

from __future__ import annotations

from collections.abc import Sequence

from jax_fp8norm.bench.report import Result, impls_of


def draw(results: Sequence[Result], path: str, info: dict | None = None) -> bool:
    """Draws the results to ``path``. False when matplotlib is missing."""
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
            for impl in impls_of(results):
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
