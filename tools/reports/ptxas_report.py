"""Registers, spills and static shared memory of every CUDA kernel, as ptxas reports them
for one architecture (default sm_90a): the figures docs/performance.md records per kernel
variant. Needs nvcc and the CUDA sources (a checkout's src/), no GPU.

    python tools/reports/ptxas_report.py [--arch sm_90a] [--nvcc PATH] [--source DIR]

``--source`` defaults to the checkout this script sits in. Exits 1 when a kernel spills.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

# tools/reports/ptxas_report.py in a checkout: the checkout's root.
DEFAULT_SOURCE = Path(__file__).resolve().parents[2]
# The build's list of the kernel families' .cu files, read rather than repeated.
SOURCE_LIST = Path("cmake/fp8norm_cuda_sources.cmake")


def kernel_files(source: Path) -> list[Path]:
    """The kernel families' .cu files of the checkout ``source``, as its build lists them."""
    text = (Path(source) / SOURCE_LIST).read_text()
    listed = re.search(r"set\(FP8NORM_CUDA_KERNEL_FILES ([^)]*)\)", text)
    if listed is None:
        raise ValueError(f"no FP8NORM_CUDA_KERNEL_FILES in {SOURCE_LIST}")
    return [Path("src/cuda") / name for name in listed.group(1).split()]


def report(arch: str, nvcc: str, source: Path = DEFAULT_SOURCE) -> list[dict]:
    """One row per kernel of ``source``'s kernel files: its demangled name, registers,
    static shared memory, stack frame and spills, compiled for ``arch``."""
    root = Path(source)
    stderr = []
    for kernel_file in kernel_files(root):
        stderr.append(_ptxas_verbose(arch, nvcc, root, kernel_file))
    return _rows("\n".join(stderr))


def _ptxas_verbose(arch: str, nvcc: str, root: Path, kernel_file: Path) -> str:
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
                f"-I{root / 'src/common'}",
                f"-I{root / 'src/cuda'}",
                "-o",
                str(Path(tmp) / "kernels.cubin"),
                str(root / kernel_file),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        sys.exit(f"nvcc failed on {kernel_file}:\n{done.stderr}")
    return done.stderr


def _rows(ptxas_output: str) -> list[dict]:
    rows, name, spill = [], None, (0, 0, 0)
    for line in ptxas_output.splitlines():
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
            row["kernel"].replace("(OutFormat)0", "e4m3fn").replace("(OutFormat)1", "e4m3fnuz")
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/reports/ptxas_report.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--nvcc", default="nvcc", help="the CUDA compiler (default: on PATH)")
    parser.add_argument(
        "--source",
        type=Path,
        default=DEFAULT_SOURCE,
        help="a jax_fp8norm checkout, the root holding src/ (default: the one this module is in)",
    )
    args = parser.parse_args(argv)
    if not (args.source / SOURCE_LIST).is_file():
        parser.error(
            f"--source: no {SOURCE_LIST} under {args.source}; pass the root of a jax_fp8norm "
            "checkout (an installed package carries no CUDA sources)"
        )
    nvcc = shutil.which(args.nvcc)
    if nvcc is None:
        parser.error(
            f"--nvcc: {args.nvcc!r} is not an executable on PATH; install the CUDA toolkit "
            "or pass --nvcc /path/to/nvcc"
        )
    if shutil.which("c++filt") is None:
        parser.error("c++filt (binutils) is not on PATH: it names the kernels")
    rows = report(args.arch, nvcc, args.source)
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
