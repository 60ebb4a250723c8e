"""Runs jobs on a fixed set of workers (each with its own copy and builds), as many at once
as there are workers; shared by the mutation checks (tools/mutants/simt_mutants.py,
tools/mutants/math_mutants.py)."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

W = TypeVar("W")
J = TypeVar("J")
R = TypeVar("R")


def map_on_workers(workers: list[W], run: Callable[[W, J], R], jobs: Iterable[J]) -> list[R]:
    """``[run(worker, job) for job in jobs]``, in order, each job on whichever worker is
    free, never one worker on two jobs at once."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for worker in workers:
        free.put(worker)

    def on_a_free_worker(job: J) -> R:
        worker = free.get()
        try:
            return run(worker, job)
        finally:
            free.put(worker)

    with ThreadPoolExecutor(len(workers)) as pool:
        return list(pool.map(on_a_free_worker, jobs))
