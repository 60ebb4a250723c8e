"""The benchmark's figure, from a run's results or from the JSON a run wrote:

    python -m jax_fp8norm.bench.figure results.json [out.png]

One row of panels per op, two measures side by side: the speed-up over XLA's jit of the
textbook formula (``xla_formula``; log scale, its line at 1x) and the share of the copy's
bandwidth (NumPy's copy where the run timed it, the CPU's ceiling, else XLA's copy; its
line at 100%). Along x the shapes, rows x hidden, grouped by dtype; a bar per
implementation and shape, in the implementation's registry colour in every panel of every
figure; one legend for the figure. With many shapes the two measures are stacked instead,
so that the figure keeps a readable aspect.

:func:`layout` decides what goes where without matplotlib; :func:`draw` draws it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from jax_fp8norm.bench.implementations import REGISTRY
from jax_fp8norm.bench.ops import SCALED_OPS
from jax_fp8norm.bench.report import Result, by_shape, impls_of, read_json

BASELINE = "xla_formula"
# NumPy's copy first: on the CPU backend XLA's element-wise loops don't use every core, so
# its copy is no ceiling there.
CEILINGS = ("numpy_copy", "copy")
# Above this many shapes the two measures are stacked rather than set side by side.
SIDE_BY_SIDE_SHAPES = 14

SUBTITLE = (
    "device time per call; a bar per implementation and shape (rows x hidden), higher is better"
)
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

Shape = tuple[str, int, int]  # (dtype, rows, hidden)


@dataclass(frozen=True)
class Measure:
    key: str  # "speed_up", "share" or "gbps"
    label: str  # the y axis'
    reference: str | None  # the implementation drawn as the line at `level`
    level: float | None
    log: bool


@dataclass
class Panel:
    op: str
    measure: Measure
    # implementation -> (index into Layout.shapes, value), in the registry's order
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    note: str = ""  # why the panel is empty


@dataclass
class Layout:
    shapes: list[Shape]
    ops: list[str]
    measures: list[Measure]
    panels: list[Panel]  # op by op, each op's measures in order
    implementations: list[str]  # what the legend lists: every bar's and line's

    def panel(self, op: str, key: str) -> Panel:
        return next(p for p in self.panels if p.op == op and p.measure.key == key)


def _order(names: Sequence[str], ran: Sequence[str]) -> list[str]:
    """Implementations in the registry's order, variants where their kernel is, in the
    order they ran."""
    rank = {name: i for i, name in enumerate(REGISTRY.names)}
    return sorted(
        names,
        key=lambda n: (rank.get(n.partition(":")[0], len(rank)), ran.index(n) if n in ran else 0),
    )


def _shapes(results: Sequence[Result]) -> list[Shape]:
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    shapes = {(r.dtype, r.rows, r.hidden) for r in results}
    return sorted(shapes, key=lambda s: (dtypes.index(s[0]), s[2], s[1]))


def _ratio(numerator: float, denominator: float) -> float | None:
    if not (numerator > 0 and denominator > 0):  # also False for NaN
        return None
    value = numerator / denominator
    return value if math.isfinite(value) else None


def _value(measure: Measure, impl: str, row: dict[str, Result]) -> float | None:
    r = row[impl]
    if measure.key == "speed_up":
        if impl == BASELINE or REGISTRY.is_ceiling(impl) or BASELINE not in row:
            return None
        return _ratio(row[BASELINE].seconds, r.seconds)
    if measure.key == "share":
        if impl == measure.reference or measure.reference not in row:
            return None
        share = _ratio(r.gbps, row[measure.reference].gbps)
        return None if share is None else 100 * share
    return r.gbps if r.gbps > 0 and math.isfinite(r.gbps) else None


def _note(op: str, measure: Measure) -> str:
    if measure.key == "speed_up" and op in SCALED_OPS:
        return f"{BASELINE} computes per-row scales only"
    return f"{measure.reference or 'nothing'} was not timed for it"


def layout(results: Sequence[Result]) -> Layout:
    """What the figure of these results shows, panel by panel."""
    ran = impls_of(results)
    names = set(ran)
    measures = []
    if BASELINE in names:
        measures.append(Measure("speed_up", f"speed-up over {BASELINE}", BASELINE, 1.0, True))
    ceiling = next((c for c in CEILINGS if c in names), None)
    if ceiling is not None:
        measures.append(Measure("share", f"% of {ceiling}'s bandwidth", ceiling, 100.0, False))
    if not measures:
        measures.append(Measure("gbps", "effective GB/s", None, None, False))
    shapes = _shapes(results)
    table = by_shape(results)
    ops = list(dict.fromkeys(r.op for r in results))
    panels = []
    for op in ops:
        for measure in measures:
            points: dict[str, list[tuple[int, float]]] = {}
            for i, (dtype, rows, hidden) in enumerate(shapes):
                row = table.get((op, dtype, rows, hidden), {})
                for impl in row:
                    value = _value(measure, impl, row)
                    if value is not None:
                        points.setdefault(impl, []).append((i, value))
            series = {impl: points[impl] for impl in _order(list(points), ran)}
            panels.append(Panel(op, measure, series, "" if series else _note(op, measure)))
    shown = {impl for p in panels for impl in p.series}
    shown |= {m.reference for m in measures if m.reference is not None}
    return Layout(shapes, ops, measures, panels, _order(list(shown), ran))


def _positions(shapes: Sequence[Shape]) -> list[float]:
    """x of each shape: a step per shape, a wider gap where the hidden size or the dtype
    changes, so that each group of rows reads as one."""
    x, positions = 0.0, []
    for i, shape in enumerate(shapes):
        if i:
            before = shapes[i - 1]
            x += 1.0 + (0.8 if shape[0] != before[0] else 0.35 if shape[2] != before[2] else 0)
        positions.append(x)
    return positions


def _label(value: float, measure: Measure) -> str:
    if measure.key == "speed_up":
        return f"{value:.2g}x" if value < 10 else f"{value:.0f}x"
    return f"{value:.0f}%" if measure.key == "share" else f"{value:.3g}"


def _title(info: dict | None) -> str:
    if not info:
        return "jax_fp8norm.bench"
    parts = [f"{info.get('backend', '?')} backend ({info.get('device', '?')})"]
    if info.get("backend") == "cpu" and info.get("cpu_count"):
        cpus = f"{info['cpu_count']} CPUs"
        if info.get("cpu_kernel_variant"):
            cpus += f", {info['cpu_kernel_variant']} kernel"
        parts.append(cpus)
    parts.append(f"jax {info.get('jax', '?')}, jax_fp8norm {info.get('jax_fp8norm', '?')}")
    if info.get("date"):
        parts.append(str(info["date"])[:10])
    return "jax_fp8norm.bench: " + "; ".join(parts)


def _limits(measure: Measure, values: Sequence[float]) -> tuple[float, float]:
    """y limits that hold every value and the reference line, with room above for the
    value labels and the dtype names: the same for every panel of a measure."""
    low = min([*values, measure.level or 0.0])
    high = max([*values, measure.level or 0.0])
    if measure.log:
        return 2 ** math.floor(math.log2(low / 1.3)), 2 ** math.ceil(math.log2(high * 2.5))
    return 0.0, high * 1.25


def _draw_panel(ax, panel: Panel, shapes: Sequence[Shape], xs: Sequence[float], ylim) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter
    from matplotlib.transforms import blended_transform_factory

    measure = panel.measure
    ax.set_title(panel.op, loc="left", fontsize=9, fontweight="bold")
    ax.set_ylabel(measure.label, fontsize=8)
    ax.set_xlim(xs[0] - 0.6, xs[-1] + 0.6)
    ax.set_xticks(xs)
    rotate = len(shapes) > 6
    ax.set_xticklabels(
        [f"{rows}\N{MULTIPLICATION SIGN}{hidden}" for _, rows, hidden in shapes],
        fontsize=7,
        rotation=35 if rotate else 0,
        ha="right" if rotate else "center",
        rotation_mode="anchor",
    )
    ax.tick_params(axis="y", labelsize=7)
    # The dtype groups: a shaded band for every other one, its name on top.
    across = blended_transform_factory(ax.transData, ax.transAxes)
    dtypes = list(dict.fromkeys(s[0] for s in shapes))
    for k, dtype in enumerate(dtypes):
        group = [x for x, s in zip(xs, shapes, strict=True) if s[0] == dtype]
        if k % 2:
            ax.axvspan(group[0] - 0.6, group[-1] + 0.6, color="#f0f0f0", zorder=0)
        ax.text(
            (group[0] + group[-1]) / 2, 0.97, DTYPE_SHORT.get(dtype, dtype), transform=across,
            ha="center", va="top", fontsize=7, color="#555555",
        )  # fmt: skip
    if measure.reference is not None:
        ax.axhline(measure.level, color=REGISTRY.colour(measure.reference), lw=1.2, ls="--",
                   zorder=1)  # fmt: skip
    n = len(panel.series)
    width = 0.8 / n
    base = measure.level if measure.key == "speed_up" else 0.0
    for k, (impl, points) in enumerate(panel.series.items()):
        offset = (k - (n - 1) / 2) * width
        x = [xs[i] + offset for i, _ in points]
        heights = [v - base for _, v in points]
        ax.bar(x, heights, width=width * 0.92, bottom=base, color=REGISTRY.colour(impl),
               zorder=2)  # fmt: skip
        if n <= 2:  # more labels than that would cover each other
            for xi, (_, v) in zip(x, points, strict=True):
                below = measure.key == "speed_up" and v < 1
                ax.annotate(
                    _label(v, measure), (xi, v), xytext=(0, -2 if below else 2),
                    textcoords="offset points", ha="center", va="top" if below else "bottom",
                    fontsize=6, color="#333333", zorder=3,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.4, "alpha": 0.8},
                )  # fmt: skip
    ax.grid(axis="y", alpha=0.3, zorder=0)
    if measure.log:
        ax.set_yscale("log", base=2)
        ticks = [2.0**e for e in range(round(math.log2(ylim[0])), round(math.log2(ylim[1])) + 1)]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_locator(FixedLocator([]))
    ax.set_ylim(*ylim)


def _notes(plan: Layout) -> list[str]:
    """One line per reason panels were left out, naming their ops."""
    left_out: dict[tuple[str, str], list[str]] = {}
    for panel in plan.panels:
        if not panel.series:
            left_out.setdefault((panel.measure.label, panel.note), []).append(panel.op)
    return [f"No {label} for {', '.join(ops)}: {note}." for (label, note), ops in left_out.items()]


def draw(results: Sequence[Result], path: str, info: dict | None = None) -> bool:
    """Draws the figure of ``results`` to ``path`` (info: the run's machine, for the
    title). False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    plan = layout(results)
    xs = _positions(plan.shapes)
    # A section of panels per measure, each op's panel in it; a panel with nothing to show
    # (the speed-up of a scale layout the formula lacks) is left out and said why below.
    sections = [[p for p in plan.panels if p.measure == m and p.series] for m in plan.measures]
    sections = [s for s in sections if s] or [[plan.panels[0]]]
    cols = 2 if len(plan.shapes) <= SIDE_BY_SIDE_SHAPES else 1
    cols = min(cols, max(len(s) for s in sections))
    rows = sum(-(-len(s) // cols) for s in sections)
    span = xs[-1] - xs[0] + 1.2
    width = min(24.0, max(5.5, 0.42 * span + 1.6)) * cols
    fig, axes = plt.subplots(rows, cols, figsize=(width, 2.5 * rows + 1.4), squeeze=False,
                             layout="constrained")  # fmt: skip
    r = 0
    for section in sections:
        values = [v for p in section for points in p.series.values() for _, v in points]
        ylim = _limits(section[0].measure, values or [1.0])
        for k in range(-(-len(section) // cols) * cols):
            ax = axes[r + k // cols][k % cols]
            if k < len(section):
                _draw_panel(ax, section[k], plan.shapes, xs, ylim)
            else:
                ax.set_visible(False)
        r += -(-len(section) // cols)
    handles = [
        Patch(color=REGISTRY.colour(name), label=name + _legend_note(name, plan))
        for name in plan.implementations
    ]
    heading = f"{_title(info)}\n{SUBTITLE}"
    fig.legend(handles=handles, loc="outside upper center", ncol=min(len(handles), 8),
               fontsize=8, frameon=False, title=heading, title_fontsize=9)  # fmt: skip
    notes = _notes(plan)
    if notes:
        fig.supxlabel("\n".join(notes), fontsize=8, color="#555555", style="italic")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _legend_note(name: str, plan: Layout) -> str:
    refs = [m for m in plan.measures if m.reference == name]
    if not refs:
        return ""
    level = ", ".join("1x" if m.key == "speed_up" else "100%" for m in refs)
    return f" (dashed line: {level})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_fp8norm.bench.figure",
        description="Draws the figure of a JSON that python -m jax_fp8norm.bench wrote.",
    )
    parser.add_argument("json", help="the results file")
    parser.add_argument("png", nargs="?", help="the figure (default: the JSON's name, .png)")
    args = parser.parse_args(argv)
    out = args.png or (args.json.removesuffix(".json") + ".png")
    info, results = read_json(args.json)
    if not results:
        parser.error(f"{args.json} holds no results")
    if not draw(results, out, info):
        print("matplotlib is not importable: no figure (pip install matplotlib)", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
