"""How the benchmark times a call: device time from K calls serialised in one jitted
program, less one call.

``(T(K) - T(1)) / (K - 1)``, T the shortest of ``repeats`` wall-clock runs of the program
after a warm-up: dispatch and synchronisation are in both T(K) and T(1) and cancel. The
shortest, not the median, because interference (other processes, page-cache and frequency
drift) only ever adds time to a run; the shortest is the run it disturbed least.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import jax

# Long enough that timer resolution and launch jitter are small next to T(K) - T(1).
TARGET_SECONDS = 0.02

METHOD = (
    "(T(K) - T(1)) / (K - 1), T the shortest wall time of a jitted program of K calls "
    "serialised by optimization_barrier, rotating among distinct inputs"
)


def serialised(fn: Callable, calls: int) -> Callable:
    """A jitted program of ``calls`` calls of ``fn``, call k on input set k, each ordered
    after the previous one by an optimization_barrier that holds its outputs (so XLA
    neither reorders nor overlaps calls)."""

    def program(input_sets):
        outs = [fn(*input_sets[0])]
        for k in range(1, calls):
            args, _ = jax.lax.optimization_barrier((input_sets[k], outs[-1]))
            outs.append(fn(*args))
        # Every call's outputs are results: XLA drops a call whose outputs are unused.
        return outs

    return jax.jit(program)


def shortest_seconds(
    run: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The shortest of ``repeats`` timed runs of ``run``, after one untimed warm-up run."""
    run()
    times = []
    for _ in range(repeats):
        start = clock()
        run()
        times.append(clock() - start)
    return min(times)


def blocking(fn: Callable, *args) -> Callable[[], object]:
    """A call of ``fn(*args)`` that returns once its results are ready."""
    return lambda: jax.block_until_ready(fn(*args))


def interleaved_seconds(
    calls: Mapping[str, Callable[[], object]],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Wall time of each of ``calls`` (each waits for its own results): one untimed-for-
    comparison first call each (compilation, set-up), then ``rounds`` rounds that time
    every call once, so that drift and interference reach every call alike. Returns the
    first calls' seconds and each call's ``rounds`` timed seconds."""
    first, times = {}, {name: [] for name in calls}
    for name, call in calls.items():
        start = clock()
        call()
        first[name] = clock() - start
    for _ in range(rounds):
        for name, call in calls.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    return first, times


def per_call(t_one: float, t_many: float, calls: int) -> float:
    """(T(calls) - T(1)) / (calls - 1), never negative."""
    return max(t_many - t_one, 0.0) / (calls - 1)


def device_seconds(fn: Callable, input_sets: Sequence[tuple], calls: int, repeats: int) -> float:
    """Device time per call of ``fn``: T(1) and T(calls) of the serialised program, each the
    shortest of ``repeats`` runs."""
    one, many = serialised(fn, 1), serialised(fn, calls)
    inputs = tuple(input_sets)
    t_one = shortest_seconds(lambda: jax.block_until_ready(one(inputs[:1])), repeats)
    assert len(inputs) == calls, "one input set per call"
    t_many = shortest_seconds(lambda: jax.block_until_ready(many(inputs)), repeats)
    return per_call(t_one, t_many, calls)


def distinct_input_sets(input_sets: Sequence[tuple]) -> int:
    """How many different input sets the calls rotate among: sets that share every array
    (the same buffers) count once; a set that shares only some (gamma) is its own."""
    return len({tuple(id(a) for a in s) for s in input_sets})


def calls_for(bytes_per_call: int, preset: dict, probe_seconds: float) -> int:
    """K: enough calls that they take about TARGET_SECONDS and that their inputs, one set
    per call, span the preset's working set, within the preset's limit."""
    for_time = TARGET_SECONDS / max(probe_seconds, 1e-7)
    for_working_set = preset["working_set"] / bytes_per_call
    return int(min(preset["max_calls"], max(4, for_time, for_working_set)))
