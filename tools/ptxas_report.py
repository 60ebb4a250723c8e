"""Registers, spills and static shared memory of every CUDA kernel, as ptxas reports them
for one architecture (default sm_90a): the figures docs/performance.md records per kernel
variant. Needs nvcc, no GPU.

    python tools/ptxas_report.py [--arch sm_90a] [--nvcc PATH]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def report(arch: str, nvcc: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [
                nvcc,
                "-std=c++17",
                "-O3",
                "--expt-relaxed-constexpr",
                "--fmad=false",  # as CMakeLists.txt builds them
                f"-arch={arch}",
                "-cubin",
                "-Xptxas",
                "-v",
                f"-I{ROOT / 'src/common'}",
                f"-I{ROOT / 'src/cuda'}",
                "-o",
                str(Path(tmp) / "kernels.cubin"),
                str(ROOT / "src/cuda/cuda_kernels.cu"),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        sys.exit(f"nvcc failed:\n{done.stderr}")
    rows, name, spill = [], None, (0, 0, 0)
    for line in done.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            name = m.group(1)
        if m := re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        ):
            spill = tuple(int(v) for v in m.groups())
        if (m := re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)) and name:
            rows.append(
                {
                    "kernel": name,
                    "registers": int(m.group(1)),
                    "static_shared": int(m.group(2) or 0),
                    "stack": spill[0],
                    "spill_stores": spill[1],
                    "spill_loads": spill[2],
                }
            )
            name = None
    demangled = subprocess.run(
        ["c++filt"],
        input="\n".join(r["kernel"] for r in rows),
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    for row, text in zip(rows, demangled, strict=True):
        text = text.replace("fp8norm::(anonymous namespace)::", "").replace("fp8norm::", "")
        row["kernel"] = re.sub(r"\((?:RmsNormFp8Args|RoundArgs).*", "", text).removeprefix("void ")
        row["kernel"] = (
            row["kernel"].replace("(Fp8Format)0", "e4m3fn").replace("(Fp8Format)1", "e4m3fnuz")
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    args = parser.parse_args()
    rows = report(args.arch, args.nvcc)
    print(
        f"| kernel ({args.arch}) | registers | spill stores / loads (bytes) "
        "| static shared (bytes) |"
    )
    print("|---|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: r["kernel"]):
        print(
            f"| `{r['kernel']}` | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} "
            f"| {r['static_shared']} |"
        )
    return 1 if any(r["spill_stores"] or r["spill_loads"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
