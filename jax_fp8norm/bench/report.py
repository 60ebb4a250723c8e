"""The results of a run and how they are reported: the table, the summary lines, the
machine it ran on, and the JSON file (written after every shape, read back to draw)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform as host_platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import jax

import jax_fp8norm as fp8norm
from jax_fp8norm.bench.timing import METHOD


@dataclass
class Result:
    op: str
    impl: str
    dtype: str
    rows: int
    hidden: int
    bytes: int
    seconds: float  # device time per call
    calls: int  # calls per timed program (K); 1 for numpy_copy, timed one copy at a time
    distinct_inputs: int  # different input sets those calls rotate among
    checked: bool  # outputs held to the reference's accuracy rule in this run

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    @property
    def shape(self) -> tuple[str, str, int, int]:
        return (self.op, self.dtype, self.rows, self.hidden)


def impls_of(results: Sequence[Result]) -> list[str]:
    """The implementations in the results, in the order they ran (variants included)."""
    return list(dict.fromkeys(r.impl for r in results))


def by_shape(results: Sequence[Result]) -> dict[tuple[str, str, int, int], dict[str, Result]]:
    """(op, dtype, rows, hidden) -> implementation -> result, in the order they ran."""
    table: dict[tuple[str, str, int, int], dict[str, Result]] = {}
    for r in results:
        table.setdefault(r.shape, {})[r.impl] = r
    return table


def format_table(results: Sequence[Result]) -> str:
    impls = impls_of(results)
    header = f"{'op':>21} {'dtype':>8} {'rows':>6} {'hidden':>6} " + "".join(
        f"{i:>24}" for i in impls
    )
    lines = [header, " " * 45 + "".join(f"{'us   GB/s':>24}" for _ in impls)]
    for (op, dtype, rows, hidden), row in by_shape(results).items():
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
    for key, row in by_shape(results).items():
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
    """The backend, device, host and versions a run measures, for the JSON."""
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


def read_json(path: str) -> tuple[dict, list[Result]]:
    """(machine, results) of a file write_json wrote, this version's or an earlier one's:
    fields it does not know (gbps, which is derived) are dropped."""
    with open(path) as f:
        data = json.load(f)
    known = {f.name for f in dataclasses.fields(Result)}
    results = []
    for entry in data["results"]:
        fields = {k: v for k, v in entry.items() if k in known}
        fields.setdefault("distinct_inputs", fields.get("calls", 1))
        fields.setdefault("checked", False)
        results.append(Result(**fields))
    return data.get("machine", {}), results
