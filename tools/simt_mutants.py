"""The mutation check of the SIMT emulation (docs/simt.md): plants known bugs, one at a
time, into a copy of src/cuda, rebuilds the emulated kernels (tests/simt/kernel_check) and
shows that each is caught. The unmutated copy must pass first, or a catch proves nothing.

    python tools/simt_mutants.py [--build DIR] [--tsan]

--tsan also builds each mutant that plants a race with ThreadSanitizer and requires a
data-race report. Exits non-zero when the baseline fails or any mutant survives.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "src" / "cuda"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    race: bool = False  # a missing ordering ThreadSanitizer should report


MUTANTS = [
    Mutant(
        "block reduction: the barrier after the partial writes removed",
        "cuda_kernels.cu",
        "  if (lane == 0) partial[warp] = v;\n  __syncthreads();\n  if (warp == 0) {",
        "  if (lane == 0) partial[warp] = v;\n  if (warp == 0) {",
        race=True,
    ),
    Mutant(
        "block reduction: the barrier before the result is read removed",
        "cuda_kernels.cu",
        "    if (lane == 0) *result = w;\n  }\n  __syncthreads();\n",
        "    if (lane == 0) *result = w;\n  }\n",
        race=True,
    ),
    Mutant(
        "shared row cache: index off by one",
        "cuda_kernels.cu",
        "      if (cache != nullptr) cache[k * num_vecs + i] = h[k];",
        "      if (cache != nullptr) cache[k * num_vecs + i + 1] = h[k];",
    ),
    Mutant(
        "the max reduction's partial slots shared with the sum reduction's result slot",
        "cuda_kernels.cu",
        "scratch.max_partial, &scratch.max_result",
        "reinterpret_cast<uint32_t*>(&scratch.sum_result), &scratch.max_result",
        race=True,
    ),
    Mutant(
        "warp sum: the shuffle offset loop stops one step early",
        "cuda_kernels.cu",
        "  for (int offset = kWarp / 2; offset > 0; offset /= 2) {\n    const SumOfSquares",
        "  for (int offset = kWarp / 2; offset > 1; offset /= 2) {\n    const SumOfSquares",
    ),
    Mutant(
        "launch plan: the vectorised path chosen for a misaligned x",
        "cuda_launch_plan.h",
        "AlignedTo(a.x, kVectorBytes) &&",
        "",
    ),
    Mutant(
        "quantise sweep: a row's last vector skipped",
        "cuda_kernels.cu",
        "i < num_vecs; i += blockDim.x) {\n    float normed[kVec];",
        "i < num_vecs - 1; i += blockDim.x) {\n    float normed[kVec];",
    ),
    Mutant(
        "grid-stride loop: rows strided by the block size instead of the grid size",
        "cuda_kernels.cu",
        "row < a.rows; row += gridDim.x) {\n    float* const row_cache",
        "row < a.rows; row += blockDim.x) {\n    float* const row_cache",
    ),
    Mutant(
        "device setup: the dynamic shared memory attribute left at its default",
        "cuda_kernels.cu",
        "static_cast<int>(most_dynamic)",
        "0",
    ),
    Mutant(
        "group reduction: the barrier after the partial writes removed",
        "cuda_kernels.cu",
        "  if (lane == 0) partial[warp] = v;\n  __syncthreads();\n  const int first",
        "  if (lane == 0) partial[warp] = v;\n  const int first",
        race=True,
    ),
    Mutant(
        "group reduction: every group reads the first group's partials",
        "cuda_kernels.cu",
        "const int first = warp - warp % group_warps;",
        "const int first = 0;",
    ),
    Mutant(
        "warp_rows: a group past the last row skips the reductions",
        "cuda_kernels.cu",
        "    RegisterRow<TIn, kVecs>(a, first + group, lane, threads_per_row, scratch);",
        "    if (first + group < a.rows)\n"
        "      RegisterRow<TIn, kVecs>(a, first + group, lane, threads_per_row, scratch);",
    ),
    Mutant(
        "register row: one vector past the row held",
        "cuda_kernels.cu",
        "lane + int64_t{k} * group_threads < num_vecs",
        "lane + int64_t{k} * group_threads <= num_vecs",
    ),
    Mutant(
        "register row: no barrier in place of the abs-max reduction a group scale skips",
        "cuda_kernels.cu",
        "  } else if (group_warps > 1) {\n    __syncthreads();\n  }",
        "  }",
        race=True,
    ),
    Mutant(
        "register groups: the shuffle loop stops one step early",
        "cuda_kernels.cu",
        "for (int offset = lanes / 2; offset > 0; offset /= 2)",
        "for (int offset = lanes / 2; offset > 1; offset /= 2)",
    ),
    Mutant(
        "shared groups: a group's last element left unquantised",
        "cuda_kernels.cu",
        "j < (g + 1) * group; ++j) {\n      const float normed[1]",
        "j < (g + 1) * group - 1; ++j) {\n      const float normed[1]",
    ),
]


def _run(cmd, log, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **kwargs)


class Builder:
    """A configured build of tests/simt whose CUDA sources are `source_dir`."""

    def __init__(self, build: Path, source_dir: Path, sanitize: str = ""):
        self.build = build
        cmd = [
            "cmake", "-S", str(ROOT / "tests" / "simt"), "-B", str(build),
            f"-DFP8NORM_CUDA_SOURCE_DIR={source_dir}", f"-DFP8NORM_SANITIZE={sanitize}",
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    def run(self, quick: bool = False) -> tuple[bool, str]:
        """(built and passed, output)."""
        built = subprocess.run(
            ["cmake", "--build", str(self.build), "-j", str(os.cpu_count() or 2)],
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode != 0:
            return False, "build failed:\n" + built.stdout[-3000:] + built.stderr[-3000:]
        env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=0")
        cmd = [str(self.build / "kernel_check")] + (["--quick"] if quick else [])
        try:
            ran = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=600, check=False
            )
        except subprocess.TimeoutExpired:
            return False, "timed out after 600 s (a hang)"
        return ran.returncode == 0, ran.stdout + ran.stderr


def first_catch(output: str) -> str:
    """The line that says how a run failed."""
    for pattern in (r"ThreadSanitizer: data race.*", r"ERROR: AddressSanitizer.*",
                    r"runtime error.*", r"FAIL .*", r"build failed.*", r"timed out.*"):  # fmt: skip
        found = re.search(pattern, output)
        if found:
            return found.group(0)[:220]
    return output.strip().splitlines()[-1][:220] if output.strip() else "(no output)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=str(ROOT / "build" / "simt-mutants"))
    parser.add_argument("--tsan", action="store_true")
    args = parser.parse_args()
    build = Path(args.build)
    copy = build / "cuda"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(CUDA, copy)
    plain = Builder(build / "plain", copy)
    tsan = Builder(build / "tsan", copy, "thread") if args.tsan else None

    def restore():
        for path in CUDA.iterdir():
            shutil.copy2(path, copy / path.name)
            # A fresh timestamp: the build must see every swap of the file.
            os.utime(copy / path.name)

    restore()
    ok, output = plain.run()
    if not ok:
        print(f"BASELINE FAILED: the unmutated kernels do not pass\n{output[-4000:]}")
        return 1
    if tsan is not None:
        ok, output = tsan.run(quick=True)
        if not ok:
            print(f"BASELINE FAILED under ThreadSanitizer\n{output[-4000:]}")
            return 1
    print("baseline: the unmutated kernels pass" + (" (and under TSan)" if tsan else ""))

    survivors = 0
    for mutant in MUTANTS:
        restore()
        target = copy / mutant.file
        text = target.read_text()
        count = text.count(mutant.old)
        if count != 1:
            print(f"SETUP ERROR {mutant.name}: the text to mutate occurs {count} times")
            survivors += 1
            continue
        target.write_text(text.replace(mutant.old, mutant.new))
        start = time.monotonic()
        ok, output = plain.run()
        verdict = "SURVIVED" if ok else "caught"
        survivors += ok
        print(f"{verdict:8} {mutant.name}\n         by: {first_catch(output) if not ok else '-'}"
              f" ({time.monotonic() - start:.0f} s)")  # fmt: skip
        if tsan is not None and mutant.race:
            ok, output = tsan.run(quick=True)
            raced = "ThreadSanitizer: data race" in output
            survivors += not raced
            print(f"         TSan: {'data race reported' if raced else 'NO RACE REPORTED'}"
                  f" ({first_catch(output)})")  # fmt: skip
    restore()
    print(f"{len(MUTANTS)} mutants, {survivors} survived")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
