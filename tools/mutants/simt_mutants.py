"""The mutation check of the SIMT emulation (docs/simt.md): plants known bugs, one at a
time, into a copy of src/cuda and src/cpu, rebuilds the emulated kernels
(tests/simt/kernel_check) and shows that each is caught. The unmutated copy must pass
first, or a catch proves nothing.

    python tools/mutants/simt_mutants.py [--build DIR] [--tsan] [--workers N] [--only TEXT]

--tsan also builds each mutant that plants a race with ThreadSanitizer and requires a
data-race report; a mutant only ThreadSanitizer can see (tsan_only: the emulation's
turns give it the right bits) runs only then. A mutant counts as caught only when the
check ran and reported it: one that does not build, or hangs, fails the check as a
survivor does. Exits non-zero when the
baseline fails or any mutant is not caught. The mutants are shared among N workers (one
per core, at most 2), each with its own copy and builds (tools/mutants/worker_pool.py).
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from worker_pool import map_on_workers

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
COPIED = ("cuda", "cpu")  # the directories the mutants patch, copied for the build


# The one-kernel all-reduce's files: its kernel, its workspaces' set-up and their layout.
ALLREDUCE_FILES = ("cuda/allreduce.cu", "cuda/peer_workspaces.cc", "cuda/peer_allreduce.h")


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    race: bool = False  # a missing ordering ThreadSanitizer should report
    # Only ThreadSanitizer can see it: the bits stay right, because one device runs at a
    # time until all its block's threads wait. Caught only by a race report, with --tsan.
    tsan_only: bool = False
    count: int = 1  # the occurrences of `old`, every one replaced

    @property
    def scope(self) -> list[str]:
        """kernel_check's arguments for the part of it the mutated file reaches: the
        all-reduce's files only its own checks, every other file the rest."""
        return ["--only-allreduce"] if self.file in ALLREDUCE_FILES else ["--no-allreduce"]


# Mutant.file is relative to src/: the mutation check copies src/cuda and src/cpu.
MUTANTS = [
    Mutant(
        "FP4 rows: y's row offset counted in elements, not packed bytes",
        "cuda/row_blocks.cuh",
        "static_cast<uint8_t*>(a.y) + YByte(a, offset)};",
        "static_cast<uint8_t*>(a.y) + offset};",
    ),
    Mutant(
        "shared groups, FP4: a pair's codes stored at the element's index",
        "cuda/block_shared_rows.cuh",
        "StoreFp4<2>(y, j / 2, pair, s, a.y_packed);",
        "StoreFp4<2>(y, j, pair, s, a.y_packed);",
    ),
    Mutant(
        "register groups, FP4: the group's scale stored from every lane",
        "cuda/register_row.cuh",
        "if (index(k) % lanes == 0) StoreScale(a, row * groups + index(k) / lanes, s.scale);\n"
        "        StoreFp4",
        "StoreScale(a, row * groups + index(k) / lanes + index(k) % lanes, s.scale);\n"
        "        StoreFp4",
    ),
    Mutant(
        "block reduction: the barrier after the partial writes removed",
        "cuda/row_blocks.cuh",
        "  if (lane == 0) partial[warp] = v;\n  __syncthreads();\n  if (warp == 0) {",
        "  if (lane == 0) partial[warp] = v;\n  if (warp == 0) {",
        race=True,
    ),
    Mutant(
        "block reduction: the barrier before the result is read removed",
        "cuda/row_blocks.cuh",
        "    if (lane == 0) *result = w;\n  }\n  __syncthreads();\n",
        "    if (lane == 0) *result = w;\n  }\n",
        race=True,
    ),
    Mutant(
        "shared row cache: index off by one",
        "cuda/block_shared_rows.cuh",
        "      if (cache != nullptr) cache[k * num_vecs + i] = h[k];",
        "      if (cache != nullptr) cache[k * num_vecs + i + 1] = h[k];",
    ),
    Mutant(
        "the max reduction's partial slots shared with the sum reduction's result slot",
        "cuda/block_shared_rows.cuh",
        "scratch.max_partial, &scratch.max_result",
        "reinterpret_cast<uint32_t*>(&scratch.sum_result), &scratch.max_result",
        race=True,
    ),
    Mutant(
        "warp sum: the shuffle offset loop stops one step early",
        "cuda/row_blocks.cuh",
        "  for (int offset = kWarp / 2; offset > 0; offset /= 2) {\n    const SumOfSquares",
        "  for (int offset = kWarp / 2; offset > 1; offset /= 2) {\n    const SumOfSquares",
    ),
    Mutant(
        "launch plan: the vectorised path chosen for a misaligned x",
        "cuda/cuda_launch_plan.h",
        "AlignedTo(a.x, kVectorBytes) &&",
        "",
    ),
    Mutant(
        "quantise sweep: a row's last vector skipped",
        "cuda/block_shared_rows.cuh",
        "i < num_vecs; i += blockDim.x) {\n    float normed[kVec];",
        "i < num_vecs - 1; i += blockDim.x) {\n    float normed[kVec];",
    ),
    Mutant(
        "grid-stride loop: rows strided by the block size instead of the grid size",
        "cuda/block_shared.cu",
        "row < a.rows; row += gridDim.x) {\n    float* const row_cache",
        "row < a.rows; row += blockDim.x) {\n    float* const row_cache",
    ),
    Mutant(
        "device setup: the dynamic shared memory attribute left at its default",
        "cuda/block_shared.cu",
        "static_cast<int>(most_dynamic)",
        "0",
    ),
    Mutant(
        "row reduction: the barrier after the partial writes removed",
        "cuda/register_row.cuh",
        "  if (lane == 0) partial[warp] = v;\n  __syncthreads();\n  const int first",
        "  if (lane == 0) partial[warp] = v;\n  const int first",
        race=True,
    ),
    Mutant(
        "row reduction: every row reads the first row's partials",
        "cuda/register_row.cuh",
        "const int first = warp - warp % warps_per_row;",
        "const int first = 0;",
    ),
    Mutant(
        "warp_rows: the threads of a row past the last one skip the reductions",
        "cuda/register_rows.cu",
        "    RegisterRow<TIn, kVecs>(a, first + block_row, a.rows, lane, threads_per_row, "
        "scratch);",
        "    if (first + block_row < a.rows)\n"
        "      RegisterRow<TIn, kVecs>(a, first + block_row, a.rows, lane, threads_per_row, "
        "scratch);",
    ),
    Mutant(
        "register row: one vector past the row held",
        "cuda/register_row.cuh",
        "lane + int64_t{k} * threads_per_row < num_vecs",
        "lane + int64_t{k} * threads_per_row <= num_vecs",
    ),
    Mutant(
        "register row: no barrier in place of the abs-max reduction a group scale skips",
        "cuda/register_row.cuh",
        "  } else if (warps_per_row > 1) {\n    __syncthreads();\n  }",
        "  }",
        race=True,
    ),
    Mutant(
        "register groups: the shuffle loop stops one step early",
        "cuda/register_row.cuh",
        "for (int offset = lanes / 2; offset > 0; offset /= 2)",
        "for (int offset = lanes / 2; offset > 1; offset /= 2)",
    ),
    Mutant(
        "shared groups: a group's last element left unquantised",
        "cuda/block_shared_rows.cuh",
        "j < (g + 1) * group; ++j) {\n      const float normed[1]",
        "j < (g + 1) * group - 1; ++j) {\n      const float normed[1]",
    ),
    Mutant(
        "all-reduce, two-shot: peers' results copied without waiting for their flags",
        "cuda/allreduce.cu",
        "    MeetPeers(a, 1, epoch);\n",
        "    __syncthreads();\n",
        race=True,
    ),
    Mutant(
        "all-reduce: a block's epoch never stored, so every call takes the first call's flags",
        "cuda/allreduce.cu",
        "  if (threadIdx.x == 0) StoreGlobal(epochs + blockIdx.x, epoch);\n",
        "",
    ),
    Mutant(
        "all-reduce: a peer's partial read before its flag (the wait takes the last call's)",
        "cuda/allreduce.cu",
        "while (!FlagReached(LoadAcquireSystem(flag), epoch)) FlagWaitPoint(flag, epoch);",
        "while (!FlagReached(LoadAcquireSystem(flag), epoch - 1)) FlagWaitPoint(flag, epoch - 1);",
    ),
    Mutant(
        "all-reduce: device 1 launched with one block more than its peers (a deadlock)",
        "cuda/allreduce.cu",
        "AllReduceBlocks(args.norm.rows, args.num_devices, args.method, max_blocks),",
        "AllReduceBlocks(args.norm.rows, args.num_devices, args.method, max_blocks) +\n"
        "                          (args.position == 1),",
    ),
    Mutant(
        "all-reduce, two-shot: the last row of each device's slice left out",
        "cuda/allreduce.cu",
        "? SliceBegin(rows, a.num_devices, a.position + 1)\n",
        "? SliceBegin(rows, a.num_devices, a.position + 1) - 1\n",
    ),
    Mutant(
        "all-reduce: the partials not double-buffered (parity fixed at 0)",
        "cuda/allreduce.cu",
        "a.layout.partials + parity * a.layout.partial_bytes",
        "a.layout.partials",
        count=2,
    ),
    Mutant(
        "all-reduce: the workspaces not zeroed by the set-up",
        "cuda/peer_workspaces.cc",
        "      err = cudaMemsetAsync(g->workspaces[p], 0, g->layout.total, stream);\n",
        "",
    ),
    Mutant(
        "all-reduce: the flags stored and loaded relaxed, not release and acquire",
        "cuda/allreduce.cu",
        "    StoreReleaseSystem(FlagOf(a, a.workspaces[p], stage, blockIdx.x, a.position),"
        " epoch);\n"
        "    const uint32_t* flag = FlagOf(a, a.workspaces[a.position], stage, blockIdx.x, p);\n"
        "    while (!FlagReached(LoadAcquireSystem(flag), epoch))",
        "    simt::StoreRelaxed(FlagOf(a, a.workspaces[p], stage, blockIdx.x, a.position), epoch,\n"
        "                       __LINE__);\n"
        "    const uint32_t* flag = FlagOf(a, a.workspaces[a.position], stage, blockIdx.x, p);\n"
        "    while (!FlagReached(simt::LoadRelaxed(flag, __LINE__), epoch))",
        race=True,
        tsan_only=True,
    ),
    Mutant(
        "all-reduce: a block flags its peers before all its threads have copied",
        "cuda/allreduce.cu",
        "uint32_t epoch) {\n  __syncthreads();\n  const int p",
        "uint32_t epoch) {\n  const int p",
        race=True,
        tsan_only=True,
    ),
    Mutant(
        "all-reduce: the flag stored in the peer's slot, not this device's",
        "cuda/allreduce.cu",
        "FlagOf(a, a.workspaces[p], stage, blockIdx.x, a.position), epoch);",
        "FlagOf(a, a.workspaces[p], stage, blockIdx.x, p), epoch);",
    ),
    Mutant(
        "all-reduce: the partials folded in reverse order",
        "cuda/allreduce.cu",
        "PartialOf(a, 0, parity) + row * hidden * in_bytes, a.partial_type, i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, q, parity)",
        "PartialOf(a, a.num_devices - 1, parity) + row * hidden * in_bytes, a.partial_type,"
        " i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, a.num_devices - 1 - q, parity)",
    ),
    Mutant(
        "all-reduce: the fold starts at the device's own partial",
        "cuda/allreduce.cu",
        "PartialOf(a, 0, parity) + row * hidden * in_bytes, a.partial_type, i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, q, parity)",
        "PartialOf(a, a.position, parity) + row * hidden * in_bytes, a.partial_type, i, h);\n"
        "    for (int q = 1; q < a.num_devices; ++q) {\n"
        "      float x[kVec];\n"
        "      LoadAny<kVec>(PartialOf(a, (a.position + q) % a.num_devices, parity)",
    ),
    Mutant(
        "all-reduce: the fold reads the next device's partial in place of each peer's",
        "cuda/allreduce.cu",
        "LoadAny<kVec>(PartialOf(a, q, parity)",
        "LoadAny<kVec>(PartialOf(a, (q + 1) % a.num_devices, parity)",
    ),
    Mutant(
        "all-reduce, two-shot: a slice's outputs copied from the next device's results",
        "cuda/allreduce.cu",
        "a.workspaces[q] + a.layout.results",
        "a.workspaces[(q + 1) % a.num_devices] + a.layout.results",
    ),
    Mutant(
        "all-reduce: the grid not capped at max_blocks",
        "cuda/peer_allreduce.h",
        "own < max_blocks ? (own > 0 ? own : 1) : max_blocks",
        "own > 0 ? own : 1",
    ),
    Mutant(
        "all-reduce: the group's block cap not lowered to its multiprocessors",
        "cuda/peer_workspaces.cc",
        "    g->max_blocks = std::min(g->max_blocks,"
        " static_cast<unsigned>(std::max(1, multiprocessors)));\n",
        "",
    ),
    Mutant(
        "CUDA row offset truncated to 32 bits",
        "cuda/row_blocks.cuh",
        "  const int64_t offset = row * a.hidden;",
        "  const int64_t offset = int32_t(row * a.hidden);",
    ),
    Mutant(
        "CPU row offset truncated to 32 bits",
        "cpu/cpu_rows.inc",
        "    const int64_t offset = row * n;",
        "    const int64_t offset = int32_t(row * n);",
    ),
    Mutant(
        "backward: a row's first term dropped from c",
        "cuda/backward.cu",
        "      Add(c, ProductTerm(ag, u));",
        "      if (j != 0) Add(c, ProductTerm(ag, u));",
    ),
    Mutant(
        "backward: dgamma sums the first row group twice",
        "cuda/backward.cu",
        "for (int g = 1; g < kDgammaRowGroups; ++g)",
        "for (int g = 0; g < kDgammaRowGroups; ++g)",
    ),
    Mutant(
        "backward: dgamma leaves the last row group out",
        "cuda/backward.cu",
        "for (int g = 1; g < kDgammaRowGroups; ++g)",
        "for (int g = 1; g < kDgammaRowGroups - 1; ++g)",
    ),
    Mutant(
        "backward: the rows' grid stops after its 65535 blocks instead of striding on",
        "cuda/backward.cu",
        "row < a.rows; row += gridDim.x) {",
        "row < a.rows; row += a.rows) {",
    ),
    Mutant(
        "backward: a row's parts merged without waiting for every thread's",
        "cuda/backward.cu",
        "    __syncthreads();  // every part written before any is merged",
        "",
        race=True,
    ),
    Mutant(
        "backward: the residual's gradient d_residual_out dropped from dh",
        "cuda/backward.cu",
        "        dx = PlusResidualGradient(dx, ",
        "        dx = PlusResidualGradient(dx, 0.0f * ",
    ),
    Mutant(
        "columnwise: a block's codes taken from the rows one below its own",
        "cuda/columnwise.cu",
        "row0 + i);\n    writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, (row0 + i) * a.hidden",
        "row0 + i);\n    writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, "
        "((row0 + i + 1) % a.rows) * a.hidden",
    ),
    Mutant(
        "columnwise: a block's scale blind to a row that is not finite",
        "cuda/columnwise.cu",
        "    finite = finite && !IsNan(r);",
        "    finite = true;",
    ),
    Mutant(
        "both layouts: the columns read r before every row of the block has stored it",
        "cuda/columnwise.cu",
        "    __syncthreads();\n    for (int64_t column = threadIdx.x;",
        "    for (int64_t column = threadIdx.x;",
        race=True,
    ),
    Mutant(
        "both layouts: a block's last row left out of its rows' pass",
        "cuda/columnwise.cu",
        "RegisterRow<TIn, kVecs>(a, first + block_row, row_end, lane",
        "RegisterRow<TIn, kVecs>(a, first + block_row, row_end - 1, lane",
    ),
]


def _run(cmd, log, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, **kwargs)


class Builder:
    """A configured build of tests/simt whose CUDA and CPU sources are those of `source_dir`
    (a copy of src/cuda and src/cpu)."""

    def __init__(self, build: Path, source_dir: Path, sanitize: str = ""):
        self.build = build
        cmd = [
            "cmake", "-S", str(ROOT / "tests" / "simt"), "-B", str(build),
            f"-DFP8NORM_CUDA_SOURCE_DIR={source_dir / 'cuda'}",
            f"-DFP8NORM_CPU_SOURCE_DIR={source_dir / 'cpu'}", f"-DFP8NORM_SANITIZE={sanitize}",
            # Debug information only where a sanitizer reports (tests/simt/CMakeLists.txt
            # adds it): each mutant builds faster.
            "-DCMAKE_BUILD_TYPE=Release",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    def make(self) -> str | None:
        """Brings the build up to date with the sources; None, or why it did not build."""
        built = subprocess.run(
            ["cmake", "--build", str(self.build), "-j", str(os.cpu_count() or 2)],
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode != 0:
            return "build failed:\n" + built.stdout[-3000:] + built.stderr[-3000:]
        return None

    def run(
        self,
        quick: bool = False,
        scope: tuple[str, ...] = (),
        stop: bool = False,
        shard: str = "",
        make: bool = True,
    ) -> tuple[str, str]:
        """('passed' | 'failed' | 'error', output). 'failed': the check ran and reported a
        failure (its exit code 1, or a sanitizer's report). 'error': no verdict on the
        code, because it did not build, hung or died some other way. `shard` ("K/N"): the
        K-th of N parts of the checks (kernel_check --shard); `make`: build first."""
        why = self.make() if make else None
        if why is not None:
            return "error", why
        env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=0")
        cmd = [str(self.build / "kernel_check"), "--name-cases"]
        cmd += (
            (["--quick"] if quick else [])
            + (["--stop-at-failure"] if stop else [])
            + (["--shard", shard] if shard else [])
            + list(scope)
        )
        try:
            ran = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=600, check=False
            )
        except subprocess.TimeoutExpired:
            return "error", "timed out after 600 s (a hang)"
        output = ran.stdout + ran.stderr
        if ran.returncode == 0:
            return "passed", output
        reported = re.search(r"^FAIL |ThreadSanitizer: data race|ERROR: AddressSanitizer|"
                             r"runtime error", output, re.M)  # fmt: skip
        return ("failed" if reported else "error"), output


def first_catch(output: str) -> str:
    """The line that says how a run failed; for a sanitizer's report, which names no case,
    with the case that was running (kernel_check --name-cases)."""
    for pattern in (r"ThreadSanitizer: data race.*", r"ERROR: AddressSanitizer.*",
                    r"runtime error.*", r"FAIL .*", r"build failed.*", r"timed out.*"):  # fmt: skip
        found = re.search(pattern, output)
        if found:
            line = found.group(0)[:220]
            if not line.startswith(("FAIL", "build", "timed")):
                running = re.findall(r"^case: (.*)$", output[: found.start()], re.M)
                line += f" in {running[-1][:200]}" if running else ""
            return line
    return output.strip().splitlines()[-1][:220] if output.strip() else "(no output)"


class Worker:
    """A copy of src/cuda and src/cpu with its own builds (plain, and TSan with --tsan):
    the mutants are shared among workers that build and run side by side, one per core."""

    def __init__(self, build: Path, tsan: bool):
        self.copy = build / "src"
        shutil.rmtree(self.copy, ignore_errors=True)
        # Fresh timestamps (shutil.copy, not copy2): a build left by an earlier run holds
        # objects of its last mutant, newer than the sources' own times.
        for name in COPIED:
            shutil.copytree(SRC / name, self.copy / name, copy_function=shutil.copy)
        self.plain = Builder(build / "plain", self.copy)
        self.tsan = Builder(build / "tsan", self.copy, "thread") if tsan else None

    def restore(self) -> None:
        """Puts back the files a mutant changed, with a fresh timestamp so that the build
        sees the swap; the others keep theirs, so that each mutant rebuilds only what
        includes its file."""
        for name in COPIED:
            for path in (SRC / name).iterdir():
                copy = self.copy / name / path.name
                if not copy.exists() or copy.read_bytes() != path.read_bytes():
                    shutil.copy2(path, copy)
                    os.utime(copy)

    def plain_baseline(self) -> str | None:
        """None when the unmutated copy passes the plain check (every launch path, and each
        reached), else why not."""
        verdict, output = self.plain.run()
        if verdict != "passed":
            return f"BASELINE FAILED: the unmutated kernels do not pass\n{output[-4000:]}"
        return None

    def check(self, mutant: Mutant) -> tuple[bool | None, str]:
        """(caught, the report's lines) for one mutant; caught is None when it did not run
        (a tsan_only mutant without --tsan)."""
        self.restore()
        target = self.copy / mutant.file
        text = target.read_text()
        count = text.count(mutant.old)
        if count != mutant.count:
            return False, (f"SETUP ERROR {mutant.name}: the text to mutate occurs {count} times,"
                           f" not {mutant.count}")  # fmt: skip
        target.write_text(text.replace(mutant.old, mutant.new))
        start = time.monotonic()
        if mutant.tsan_only:
            if self.tsan is None:
                return (
                    None,
                    f"NOT RUN  {mutant.name}\n         (only ThreadSanitizer sees it: --tsan)",
                )
            verdict, output = self.tsan.run(quick=True, scope=mutant.scope)
            raced = verdict == "failed" and "ThreadSanitizer: data race" in output
            label = "caught" if raced else ("SURVIVED" if verdict == "passed" else "NO VERDICT")
            by = first_catch(output) if verdict != "passed" else "-"
            return raced, (f"{label:8} {mutant.name}\n         by: {by} (ThreadSanitizer only,"
                           f" {time.monotonic() - start:.0f} s)\n         TSan: "
                           f"{'data race reported' if raced else 'NO RACE REPORTED'}")  # fmt: skip
        # One failure is a catch; ThreadSanitizer's run goes on, to reach the race it needs.
        verdict, output = self.plain.run(scope=mutant.scope, stop=True)
        label = {"passed": "SURVIVED", "failed": "caught", "error": "NO VERDICT"}[verdict]
        caught = verdict == "failed"
        by = first_catch(output) if verdict != "passed" else "-"
        report = f"{label:8} {mutant.name}\n         by: {by} ({time.monotonic() - start:.0f} s)"
        if self.tsan is not None and mutant.race:
            verdict, output = self.tsan.run(quick=True, scope=mutant.scope)
            raced = verdict == "failed" and "ThreadSanitizer: data race" in output
            caught = caught and raced
            report += (f"\n         TSan: {'data race reported' if raced else 'NO RACE REPORTED'}"
                       f" ({first_catch(output)})")  # fmt: skip
        return caught, report


def baseline(workers: list[Worker]) -> tuple[str | None, str]:
    """(None when the unmutated sources pass the plain check and, with --tsan,
    ThreadSanitizer's over the block-level paths, else why not; how long each part took).
    The workers' copies are the same, so one plain build makes the plain check while one
    ThreadSanitizer build is made, whose run is then cut in shards (each emulated launch runs
    on one core): two per core, taken in turn by whichever core is free. Each worker's other
    build is made by its first mutant."""
    tsan = next((w.tsan for w in workers[1:] + workers[:1] if w.tsan is not None), None)
    took: dict[str, float] = {}

    def timed(name: str, work: Callable[[], T]) -> T:
        start = time.monotonic()
        result = work()
        took[name] = time.monotonic() - start
        return result

    def report() -> str:
        return ", ".join(f"{name} {seconds:.0f} s" for name, seconds in took.items())

    for worker in workers:
        worker.restore()
    shards = 2 * len(workers)
    with ThreadPoolExecutor(len(workers)) as pool:
        plain = pool.submit(timed, "plain build and run", workers[0].plain_baseline)
        why = timed("TSan build", tsan.make) if tsan is not None else None
        why = f"BASELINE FAILED: the ThreadSanitizer {why}" if why is not None else None
        runs = []
        if why is None and tsan is not None:
            runs = [
                pool.submit(
                    timed,
                    f"TSan shard {k}/{shards}",
                    lambda k=k: tsan.run(quick=True, shard=f"{k}/{shards}", make=False),
                )
                for k in range(shards)
            ]
        why = plain.result() or why
        if why is not None:
            return why, report()
        outputs = []
        for run in runs:
            verdict, output = run.result()
            if verdict != "passed":
                return f"BASELINE FAILED under ThreadSanitizer\n{output[-4000:]}", report()
            outputs.append(output)
    unseen = unseen_by_every_shard(outputs) if outputs else []
    if unseen:
        why = "BASELINE FAILED under ThreadSanitizer: no shard's cases\n" + "\n".join(unseen)
        return why, report()
    return None, report()


def unseen_by_every_shard(outputs: list[str]) -> list[str]:
    """What every shard of kernel_check says its cases did not show (its "UNSEEN" lines):
    a launch path none reached, an all-reduce property none tested."""
    sets = [set(re.findall(r"^UNSEEN (.*)", output, re.M)) for output in outputs]
    return sorted(set.intersection(*sets))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=str(ROOT / "build" / "simt-mutants"))
    parser.add_argument("--tsan", action="store_true")
    parser.add_argument("--only", default="", help="run the mutants whose name has this text")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    build = Path(args.build)
    mutants = [m for m in MUTANTS if args.only in m.name]
    workers = [Worker(build / f"worker{i}", args.tsan) for i in range(max(1, args.workers))]
    # The unmutated sources must pass both checks before any catch counts.
    why, took = baseline(workers)
    if why is not None:
        print(why)
        return 1
    print(
        "baseline: the unmutated kernels pass"
        + (" (and under TSan)" if args.tsan else "")
        + f" ({took})"
    )
    survivors = not_run = 0
    for caught, report in map_on_workers(workers, Worker.check, mutants):
        survivors += caught is False
        not_run += caught is None
        print(report)
    print(
        f"{len(mutants)} mutants, {survivors} not caught"
        + (f", {not_run} not run (only ThreadSanitizer sees them: --tsan)" if not_run else "")
    )
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
