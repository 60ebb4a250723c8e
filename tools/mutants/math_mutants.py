"""The mutation check of the shared arithmetic (src/common/fp8norm_math.h, backward_math.h,
the Hadamard butterfly of fp4_parts.h) and of the CPU backward (src/cpu/cpu_backward.cc,
cpu_backward_rows.inc, cpu_exact_sums.h): plants known bugs, one at a time, into a copy
of the file, rebuilds the CPU kernels' module from that copy and shows that the default
tier's cpu tests fail on each. The
headers are also what the CUDA kernels and their emulation compute with, so only these
tests, which hold the kernels to the reference and to the exact oracle, can show such a
bug; the SIMT mutants (tools/mutants/simt_mutants.py) cover the kernels' own code.

    python tools/mutants/math_mutants.py [--build DIR] [--workers N] [--only TEXT]

The tests run with FP8NORM_CPU_ISA=baseline, the CPU variant that computes with the
header's scalar functions (tools/checks/cpu_check.sh holds the AVX2 variant's vector arithmetic to
those functions on every float32 input). Each mutant runs first, alone, the test that shows
its kind of error, and every listed test only should that one pass. A mutant counts as
caught only when tests ran and one failed that passes on the unmutated header: after the
mutants, the unmutated build runs every test that caught one (the baseline). A mutant
that does not build, a run that collects no test or stops on an error outside a test, or
one that hangs, fails the check. Exits non-zero unless the baseline passes and every
mutant is caught. The mutants are shared among N workers (one per core, at most 2), each
with its own build.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from worker_pool import map_on_workers

ROOT = Path(__file__).resolve().parents[2]
HEADER = Path("src") / "common" / "fp8norm_math.h"
# Every test a mutant may need, should its first test (Mutant.first) pass: in this order, so
# that most mutants fail one of the first, quicker files.
TESTS = ["tests/test_sum_of_squares.py", "tests/test_rounding.py", "tests/test_block_scaling.py",
         "tests/test_fp4.py", "tests/test_ops.py"]  # fmt: skip
# The cpu platform's items of those files (the simt ones build their own module).
SELECT = "cpu and not virtual"
# The backward's arithmetic (ExactSum, the flushing rule) reaches only the backward: its
# mutants run the backward's exact-sum and twin checks alone.
BACKWARD_TESTS = ["tests/test_backward.py", "tests/test_backward_invariance.py"]
BACKWARD_SELECT = (
    "cpu and (kernel_sums or twins_bits or oracle or smallest_normal or weight_offset"
    " or exact_sum_over or every_batch or every_split)"
)
# The tests that show each kind of mutant (Mutant.first).
ROUNDING = "tests/test_rounding.py::test_boundaries_and_ties_match_ml_dtypes"
EXACT_SUM = "tests/test_sum_of_squares.py::test_constant_rows_match_the_exact_sum"
GROUP_SIZES = "tests/test_block_scaling.py::test_group_sizes"
KERNEL_SUMS = "tests/test_backward.py::test_kernel_sums_are_exact"
MANY_TASKS = "tests/test_backward_invariance.py::test_dgamma_is_the_exact_sum_over_many_row_groups"
WEIGHT_OFFSET = "tests/test_backward.py::test_weight_offset_is_rounded_through_x_dtype"
PER_ROW_EDGES = "tests/test_per_row_global_scale.py::test_edge_rows"
BACKWARD_CC = "src/cpu/cpu_backward.cc"
BACKWARD_MATH = "src/common/backward_math.h"
# The FP4 training parts (the Hadamard butterfly of the columnwise outputs), and the test
# that holds the CPU kernel's transformed columns to the twin.
FP4_PARTS = "src/common/fp4_parts.h"
HADAMARD = "tests/test_columnwise_hadamard.py::test_kernels_give_the_twins_bits"
TIMEOUT_S = 900
# Each mutant rebuilds the CPU kernels and then runs small inputs: -O1 compiles them in a
# third of -O3's time, and under the CMakeLists' float rules (no contraction, no
# fast-math) gives the same bits at any level.
OPTIMIZATION = "-O1"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    old: str
    new: str
    # The test run first, alone (a file::function): where the mutant's kind of error shows,
    # so that most mutants cost one short run. Should it pass, the whole list runs.
    first: str
    backward: bool = False  # the backward's arithmetic: BACKWARD_TESTS, not TESTS
    file: str = str(HEADER)  # relative to the root

    def runs(self) -> list[list[str]]:
        """The pytest runs, in order, until one does not pass."""
        return [[self.first], BACKWARD_TESTS if self.backward else TESTS]


MUTANTS = [
    Mutant(
        "FP4 rounding: ties away from zero instead of to even",
        "(22u << 23);\n  const uint32_t steps = BitsOf(FloatOf(capped) + FloatOf(c)) - c;",
        "(22u << 23);\n  const uint32_t steps = BitsOf(FloatOf(capped | 1u) + FloatOf(c)) - c;",
        first=ROUNDING,
    ),
    Mutant(
        "FP4 packing: element 2k in the high nibble",
        "return uint8_t(even | (odd << 4));",
        "return uint8_t(odd | (even << 4));",
        first=ROUNDING,
    ),
    Mutant(
        "NVFP4: one division by the product of the two scales",
        "(normed / s.global_scale) / s.scale",
        "normed / (s.global_scale * s.scale)",
        first="tests/test_fp4.py::test_nvfp4_ties",
    ),
    Mutant(
        "sum of squares: each addition's rounding error dropped",
        "  lo += sum_error + square_error;",
        "  lo += square_error;",
        first=EXACT_SUM,
    ),
    Mutant(
        "sum of squares: each square's rounding error dropped",
        "  lo += sum_error + square_error;",
        "  lo += sum_error;",
        first=EXACT_SUM,
    ),
    Mutant(
        "FP8 rounding: exact ties rounded up instead of to even",
        "(20u << 23);\n  const uint32_t steps = BitsOf(FloatOf(capped) + FloatOf(c)) - c;",
        "(20u << 23);\n  const uint32_t steps = "
        "BitsOf(FloatOf(capped + (capped != 0 ? 1u : 0u)) + FloatOf(c)) - c;",
        first=ROUNDING,
    ),
    Mutant(
        "scale rule: the abs-max not rounded to the scale dtype before the division",
        "  const float amax = RoundTo(scale_type, FloatOf(amax_bits));",
        "  const float amax = FloatOf(amax_bits);",
        first="tests/test_block_scaling.py::test_every_dtype_with_groups",
    ),
    Mutant(
        "scale rule: the reciprocal of a zero scale not guarded",
        "(scale == 0.0f || !IsFinite(inverse)) ? 0.0f : inverse;",
        "inverse;",
        first="tests/test_sum_of_squares.py::test_squares_at_the_flushing_boundary",
    ),
    Mutant(
        "power-of-two rule: q rounded down to a power of two, not up",
        "    exponent += (q & 0x007fffffu) != 0 ? 1u : 0u;",
        "    exponent += 0u;",
        first=GROUP_SIZES,
    ),
    Mutant(
        "normalise: h * (r * gamma) instead of the spec's (h * r) * gamma",
        "  return (h * r) * gamma_plus_offset;",
        "  return h * (r * gamma_plus_offset);",
        first=GROUP_SIZES,
    ),
    Mutant(
        "inverse rms: eps added before the mean",
        "  const float denom = (hidden > 0 ? sum_sq / float(hidden) : 0.0f) + eps;",
        "  const float denom = hidden > 0 ? (sum_sq + eps) / float(hidden) : eps;",
        first=EXACT_SUM,
    ),
    Mutant(
        "backward's exact sum: a rounding tie rounded up instead of to even",
        "if (round_bit && (sticky || (significand & 1u) != 0)) {",
        "if (round_bit) {",
        first=KERNEL_SUMS,
        backward=True,
        file=BACKWARD_MATH,
    ),
    Mutant(
        "backward's exact sum: a level's top digit dropped when folded in",
        "int64_t((low >> 32) + (high & 0xffffffffu)), int64_t(high >> 32)};",
        "int64_t((low >> 32) + (high & 0xffffffffu)), 0};",
        first=KERNEL_SUMS,
        backward=True,
        file=BACKWARD_MATH,
    ),
    Mutant(
        "backward's exact sum: the bits below the rounding bit ignored",
        "      sticky = sticky || (digit & ((uint64_t{1} << -at) - 1)) != 0;",
        "",
        first=KERNEL_SUMS,
        backward=True,
        file=BACKWARD_MATH,
    ),
    Mutant(
        "CPU backward: the tasks' dgamma partials merged in float32",
        "      a.dgamma[j] = Round(total);",
        "      float merged = Round(partials[j]);\n"
        "      for (int64_t task = 1; task < row_tasks; ++task)\n"
        "        merged += Round(partials[task * n + j]);\n"
        "      a.dgamma[j] = merged;",
        first=MANY_TASKS,
        backward=True,
        file=BACKWARD_CC,
    ),
    Mutant(
        "CPU backward: dgamma leaves the last task out",
        "task < row_tasks; ++task) Merge(",
        "task < row_tasks - 1; ++task) Merge(",
        first=MANY_TASKS,
        backward=True,
        file=BACKWARD_CC,
    ),
    Mutant(
        "CPU backward: dgamma sums the first task twice",
        "for (int64_t task = 1; task < row_tasks; ++task) Merge(",
        "for (int64_t task = 0; task < row_tasks; ++task) Merge(",
        first=MANY_TASKS,
        backward=True,
        file=BACKWARD_CC,
    ),
    Mutant(
        "CPU backward: weight_offset rounded again, through bfloat16",
        "GammaPlusOffset(FlushTiny(LoadAt<T>(gamma, j)), weight_offset)",
        "GammaPlusOffset(FlushTiny(LoadAt<T>(gamma, j)), ToFloat(FromFloat<BF16>(weight_offset)))",
        first=WEIGHT_OFFSET,
        backward=True,
        file=BACKWARD_CC,
    ),
    Mutant(
        "CPU backward: a row's first term dropped from c",
        "      AddTerms(c, terms, n);",
        "      AddTerms(c, terms + 1, n - 1);",
        first=KERNEL_SUMS,
        backward=True,
        file="src/cpu/cpu_backward_rows.inc",
    ),
    Mutant(
        "CPU backward: dgamma's column sums keep only the top level of each block",
        "      AddScaled(acc[j], levels[level], LevelOffset(top, level));",
        "      if (level == 0) AddScaled(acc[j], levels[level], LevelOffset(top, level));",
        first=MANY_TASKS,
        backward=True,
        file="src/cpu/cpu_exact_sums.h",
    ),
    Mutant(
        "per-row global scale: no floor under a tiny row's quotient",
        "BitsOf(quotient) < kF32MinNormalBits ? kF32MinNormalBits : BitsOf(quotient);",
        "BitsOf(quotient);",
        first=PER_ROW_EDGES,
    ),
    Mutant(
        "per-row global scale: the amax over 448 alone",
        "constexpr float kPerRowGlobalDivisor = 448.0f * kFp4Max;",
        "constexpr float kPerRowGlobalDivisor = 448.0f;",
        first="tests/test_per_row_global_scale.py::test_per_row_matches_the_reference",
    ),
    Mutant(
        "per-row global scale: an infinite abs-max (a huge gamma) taken as finite",
        "const bool finite = IsFinite(sum_sq) && IsFinite(FloatOf(amax_bits));",
        "const bool finite = IsFinite(sum_sq);",
        first=PER_ROW_EDGES,
    ),
    Mutant(
        "Hadamard butterfly: its first stage skipped",
        "for (int s = 0; s < HadamardStages(D); ++s) {",
        "for (int s = 1; s < HadamardStages(D); ++s) {",
        first=HADAMARD,
        file=FP4_PARTS,
    ),
    Mutant(
        "Hadamard butterfly: the sign of a block's first row flipped",
        "v[i * stride] *= HadamardSign(mask, i);",
        "v[i * stride] *= HadamardSign(mask ^ 1u, i);",
        first=HADAMARD,
        file=FP4_PARTS,
    ),
    Mutant(
        "Hadamard butterfly: the pair's difference taken the other way round",
        "v[(i + span) * stride] = a - b;",
        "v[(i + span) * stride] = b - a;",
        first=HADAMARD,
        file=FP4_PARTS,
    ),
]


def installed_kernels() -> Path:
    """The installed compiled-module package, whose other modules the mutant build joins."""
    script = "import jax_fp8norm_kernels, os; print(os.path.dirname(jax_fp8norm_kernels.__file__))"
    found = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd="/"
    )
    return Path(found.stdout.strip())


class CpuModule:
    """A configured CMake build of _fp8norm_cpu from a copy of the sources, and a package
    directory where the built module replaces the installed one."""

    def __init__(self, work: Path):
        self.tree, self.build, self.package = work / "tree", work / "build", work / "package"
        shutil.rmtree(self.tree, ignore_errors=True)
        (self.tree / "jax_fp8norm").mkdir(parents=True)
        shutil.copytree(ROOT / "src", self.tree / "src")
        shutil.copy2(ROOT / "CMakeLists.txt", self.tree)
        shutil.copytree(ROOT / "cmake", self.tree / "cmake")
        shutil.copy2(ROOT / "jax_fp8norm" / "_version.py", self.tree / "jax_fp8norm")
        subprocess.run(
            ["cmake", "-S", str(self.tree), "-B", str(self.build), "-DFP8NORM_CUDA=OFF",
             "-DCMAKE_BUILD_TYPE=Release", f"-DFP8NORM_CPU_OPTIMIZATION={OPTIMIZATION}",
             f"-DPython_EXECUTABLE={sys.executable}"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        shutil.rmtree(self.package, ignore_errors=True)
        shutil.copytree(installed_kernels(), self.package / "jax_fp8norm_kernels")

    def write_source(self, file: str, text: str) -> None:
        path = self.tree / file
        path.write_text(text)
        os.utime(path)  # a fresh timestamp: the build must see every swap of the file

    def build_module(self) -> str | None:
        """Builds and places the module; None, or why it did not build."""
        built = subprocess.run(
            ["cmake", "--build", str(self.build), "--target", "_fp8norm_cpu", "-j",
             str(os.cpu_count() or 2)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if built.returncode != 0:
            return (built.stdout + built.stderr)[-3000:]
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        shutil.copy2(self.build / f"_fp8norm_cpu{suffix}",
                     self.package / "jax_fp8norm_kernels" / f"_fp8norm_cpu{suffix}")  # fmt: skip
        return None

    def run_tests(self, tests: list[str], select: str) -> tuple[str, str, list[str]]:
        """(verdict, output's tail, the failed tests' ids) of `tests` (files or test ids)
        narrowed by `select`, with the baseline CPU variant: pytest's exit code 1 is a
        failing test; any other non-zero code is no verdict on the mutant."""
        env = dict(os.environ, PYTHONPATH=str(self.package), FP8NORM_CPU_ISA="baseline")
        cache = self.build / "pytest-cache"  # where pytest records the failed tests' ids
        # Only the last run's record goes: the compiled programs the suite keeps there
        # (tests/conftest.py) call the kernels by name, so every mutant's runs reuse them.
        shutil.rmtree(cache / "v", ignore_errors=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-o",
               f"cache_dir={cache}", "-k", select, *tests]  # fmt: skip
        try:
            ran = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=TIMEOUT_S, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {TIMEOUT_S} s (a hang)", []
        tail = (ran.stdout + ran.stderr)[-3000:]
        if ran.returncode == 0 and re.search(r"\b\d+ passed", ran.stdout):
            return "passed", tail, []
        if ran.returncode == 1 and re.search(r"\b1 failed", ran.stdout):
            failed = json.loads((cache / "v" / "cache" / "lastfailed").read_text())
            return "failed", tail, list(failed)
        return "error", f"pytest exit code {ran.returncode}\n{tail}", []


def check(module: CpuModule, mutant: Mutant) -> tuple[list[str], str]:
    """(the ids of the tests that caught the mutant, none if none did; the report's lines)
    for one mutant, built and tested in `module`, whose copy of the file is then restored."""
    original = (module.tree / mutant.file).read_text()
    try:
        return _check(module, original, mutant)
    finally:
        module.write_source(mutant.file, original)


def _check(module: CpuModule, original: str, mutant: Mutant) -> tuple[list[str], str]:
    start = time.monotonic()
    if original.count(mutant.old) != 1:
        return [], (
            f"SETUP ERROR {mutant.name}: the text to mutate occurs "
            f"{original.count(mutant.old)} times"
        )
    module.write_source(mutant.file, original.replace(mutant.old, mutant.new))
    why = module.build_module()
    select = BACKWARD_SELECT if mutant.backward else SELECT
    verdict, output, failed = "error", f"build failed:\n{why}", []
    if not why:
        for tests in mutant.runs():
            verdict, output, failed = module.run_tests(tests, select)
            if verdict != "passed":
                break
    took = f"({time.monotonic() - start:.0f} s)"
    if verdict == "failed":
        return failed, f"caught   {mutant.name}\n         by: {' '.join(failed)} {took}"
    label = "SURVIVED" if verdict == "passed" else "NO VERDICT"
    return [], f"{label} {mutant.name} {took}" + (f"\n{output}" if verdict == "error" else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=str(ROOT / "build" / "math-mutants"))
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--only", default="", help="run the mutants whose name has this text")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if args.only in m.name]
    modules = [CpuModule(Path(args.build) / f"worker{i}") for i in range(max(1, args.workers))]

    results = map_on_workers(modules, check, mutants)
    # The baseline: every test that caught a mutant passes on the unmutated header, or its
    # catch proves nothing.
    start = time.monotonic()
    catchers = sorted({test for failed, _ in results for test in failed})
    if catchers:
        why = modules[0].build_module()
        verdict, output, _ = ("error", why, []) if why else modules[0].run_tests(catchers, "cpu")
        if verdict != "passed":
            print(f"BASELINE FAILED: the tests that caught mutants fail unmutated\n{output}")
            return 1
        print(f"baseline: the {len(catchers)} tests that caught mutants pass on the unmutated "
              f"header ({time.monotonic() - start:.0f} s)")  # fmt: skip
    failures = 0
    for failed, report in results:
        failures += not failed
        print(report)
    files = ", ".join(sorted({Path(m.file).name for m in mutants}))
    print(f"{len(mutants)} mutants of {files}, {failures} not caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
