"""The mutation check of the SIMT emulation (docs/simt.md): plants known bugs (the list in
simt_mutant_list.py), one at a time, into a copy of src/cuda and src/cpu, rebuilds the
emulated kernels (tests/simt/kernel_check) and shows that each is caught. The unmutated
copy must pass first, or a catch proves nothing.

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

from simt_mutant_list import MUTANTS, Mutant
from worker_pool import map_on_workers

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
COPIED = ("cuda", "cpu")  # the directories the mutants patch, copied for the build


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
