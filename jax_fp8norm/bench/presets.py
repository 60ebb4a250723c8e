"""The shape grids of a benchmark run, by preset."""

from __future__ import annotations

from collections.abc import Sequence

# The grid of the performance issue: the GPU preset. The CPU preset is the part of it a
# development machine runs in minutes; "smoke" is for the tests of this package.
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


def default_preset(backend: str) -> str:
    return "gpu" if backend == "gpu" else "cpu"


def grid(
    preset: dict,
    rows: Sequence[int] | None = None,
    hidden: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
) -> list[tuple[str, int, int]]:
    """(dtype, rows, hidden) of a run: the main grid, then the spot checks in other dtypes."""
    rows = rows or preset["rows"]
    hidden = hidden or preset["hidden"]
    shapes = [(d, r, h) for d in (dtypes or preset["dtypes"]) for h in hidden for r in rows]
    if dtypes is None:
        shapes += [(d, r, h) for d in preset["spot_dtypes"] for r, h in preset["spot_shapes"]]
    return shapes
