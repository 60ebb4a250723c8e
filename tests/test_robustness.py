"""Reliability beyond single calls: very many rows and (on request on the CPU) more than
2^31 elements, inputs XLA hands over at an offset, threads and devices at once, memory
over 10,000 calls, bad input and exhausted host memory in a subprocess, and bit-for-bit
determinism."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    SIMT_PLATFORMS,
    TIERS,
    assert_kernel_matches,
    assert_same_bits,
    check_against_reference,
    device_of,
    is_simt,
    outputs_of_script,
    random_gamma,
    random_rows,
    reference_on_cpu,
    rerun_with_virtual_cpu_devices,
    run_on,
)

import jax_fp8norm as fp8norm

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
HUGE_ON_CPU = os.environ.get("FP8NORM_HUGE_TESTS", "") not in ("", "0")


# ------------------------------------------------------------------ sizes


GRID_SHAPES = [(65536, 2), (70001, 8), (131073, 1)]


@pytest.mark.default_platforms("cpu")
@pytest.mark.long_running
@pytest.mark.parametrize("rows,hidden", GRID_SHAPES)
def test_more_rows_than_a_grid_dimension(platform, rows, hidden):
    # 65535 is the CUDA limit of a grid's y and z dimensions; rows must not be bound by it.
    # The emulated variants take a shape each (10 to 20 s an emulated call): kernel_check
    # runs each variant on grids strided past a lowered limit (tests/simt).
    if is_simt(platform):
        turn = SIMT_PLATFORMS.index(platform) % len(GRID_SHAPES)
        if GRID_SHAPES[turn] != (rows, hidden):
            pytest.skip("another emulated variant's shape")
    x = random_rows(rows, (rows, hidden), jnp.bfloat16)
    gamma = random_gamma(1, hidden, jnp.float32)
    check_against_reference(platform, "rms_norm_fp8", x, gamma)
    residual = random_rows(2, (rows, hidden), jnp.bfloat16)
    check_against_reference(platform, "add_rms_norm_fp8", x, residual, gamma)


@pytest.mark.default_platforms("cpu", "simt-block_shared")
def test_more_rows_than_a_grid_dimension_on_every_platform(platform):
    # The default tier's share of the test above on the emulated kernels too (about 2 to
    # 5 s each there): 65537 short rows, one op.
    rows, hidden = 65537, 16
    x = random_rows(rows, (rows, hidden), jnp.bfloat16)
    gamma = random_gamma(1, hidden, jnp.float32)
    check_against_reference(platform, "rms_norm_fp8", x, gamma)


HUGE_ROWS, HUGE_HIDDEN, PERIOD = 16385, 131072, 5  # 2^31 + 131072 elements


def _periodic_rows(first_row, num_rows):
    """bfloat16 rows whose values depend on (row mod PERIOD, column) only."""
    row = jax.lax.broadcasted_iota(jnp.int32, (num_rows, HUGE_HIDDEN), 0) + first_row
    col = jax.lax.broadcasted_iota(jnp.int32, (num_rows, HUGE_HIDDEN), 1)
    phase = row % PERIOD
    pattern = ((col * 7 + phase * 13) % 251 - 125).astype(jnp.float32)
    return (pattern * (0.01 * (phase + 1).astype(jnp.float32))).astype(jnp.bfloat16)


def test_more_than_2_to_the_31_elements(platform):
    """16385 x 131072 bfloat16 (4 GiB in, 2 GiB out). Rows repeat with a period of 5, so
    every row past element 2^31 must equal its twin below it, bit for bit; a 32-bit index
    would wrap to the wrong row. The first rows are checked against the reference."""
    if platform == "cpu" and not HUGE_ON_CPU:
        pytest.skip("about 7 GiB of host memory; FP8NORM_HUGE_TESTS=1 runs it on the CPU")
    if is_simt(platform):
        pytest.skip("2^31 elements through fibers would take hours; the GPU run covers it")
    device = device_of(platform)
    with jax.default_device(device):
        x = jax.jit(lambda: _periodic_rows(0, HUGE_ROWS))()
        y, scales = jax.jit(fp8norm.rms_norm_fp8)(x, jnp.ones((HUGE_HIDDEN,), jnp.float32))
        del x
        scales = np.asarray(scales)[:, 0]
        for row in range(HUGE_ROWS):
            assert scales[row] == scales[row % PERIOD], row
        for row in (16383, 16384, HUGE_ROWS - 1):  # row 16384 starts at element 2^31
            twin = row % PERIOD
            np.testing.assert_array_equal(
                np.asarray(y[row]).view(np.uint8), np.asarray(y[twin]).view(np.uint8), str(row)
            )
        first = np.asarray(jax.jit(lambda: _periodic_rows(0, PERIOD))())
        head = (np.asarray(y[:PERIOD]), scales[:PERIOD, None])
    ref = reference_on_cpu(fp8norm.reference.rms_norm_fp8, first, np.ones(HUGE_HIDDEN, np.float32))
    assert_kernel_matches(platform, head, ref)


# ------------------------------------------------------------------ buffers at an offset


@pytest.mark.sampled(3)
@pytest.mark.parametrize("offset", [0, 1, 3, 8, 13])
def test_inputs_sliced_at_an_offset_inside_jit(platform, offset):
    # A contiguous slice of a larger buffer at an element offset that breaks every vector
    # alignment: XLA may pass it to the custom call as a pointer into that buffer.
    rows, hidden = 6, 512
    total = rows * hidden
    flat = random_rows(offset, (total + 32,), jnp.bfloat16).reshape(-1)
    flat_residual = random_rows(offset + 1, (total + 32,), jnp.bfloat16).reshape(-1)
    gamma = random_gamma(offset, hidden, jnp.bfloat16)

    def sliced(v):
        return jax.lax.slice(v, (offset,), (offset + total,)).reshape(rows, hidden)

    def fn(flat, flat_residual, gamma):
        x, residual = sliced(flat), sliced(flat_residual)
        return fp8norm.rms_norm_fp8(x, gamma) + fp8norm.add_rms_norm_fp8(x, residual, gamma)

    out = run_on(platform, fn, flat, flat_residual, gamma)
    x = flat[offset : offset + total].reshape(rows, hidden)
    residual = flat_residual[offset : offset + total].reshape(rows, hidden)
    assert_kernel_matches(
        platform, out[:2], reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma)
    )
    assert_kernel_matches(
        platform, out[2:], reference_on_cpu(fp8norm.reference.add_rms_norm_fp8, x, residual, gamma)
    )


def test_strided_slices_inside_jit(platform):
    # Column and row slices of a larger array: XLA makes dense copies or passes offsets.
    full = random_rows(3, (9, 1030), jnp.float16)
    gamma = random_gamma(4, 1027, jnp.float32)

    def fn(full, gamma):
        return fp8norm.rms_norm_fp8(full[1:8, 3:], gamma) + fp8norm.rms_norm_fp8(
            full[::2, :1027], gamma
        )

    out = run_on(platform, fn, full, gamma)
    ref = reference_on_cpu(fp8norm.reference.rms_norm_fp8, full[1:8, 3:], gamma)
    assert_kernel_matches(platform, out[:2], ref)
    ref = reference_on_cpu(fp8norm.reference.rms_norm_fp8, full[::2, :1027], gamma)
    assert_kernel_matches(platform, out[2:], ref)


# ------------------------------------------------------------------ concurrency

THREAD_CASES = [
    ("rms_norm_fp8", (1, 64), jnp.bfloat16),
    ("add_rms_norm_fp8", (7, 100), jnp.float16),
    ("rms_norm_fp8", (33, 1000), jnp.float32),
    ("add_rms_norm_fp8", (128, 4096), jnp.bfloat16),
    ("rms_norm_fp8", (3, 70001), jnp.bfloat16),
    ("rms_norm_fp8", (0, 16), jnp.float16),
    ("add_rms_norm_fp8", (3, 2, 257), jnp.float32),
    ("rms_norm_fp8", (512, 512), jnp.bfloat16),
]


def _thread_case_args(i):
    op, shape, dtype = THREAD_CASES[i]
    x = random_rows(i, shape, dtype)
    gamma = random_gamma(i, shape[-1], jnp.float32)
    if op == "rms_norm_fp8":
        return op, (x, gamma)
    return op, (x, random_rows(i + 100, shape, dtype), gamma)


@pytest.mark.default_platforms("cpu", "simt-block_shared")
def test_eight_threads_at_once(platform):
    """8 Python threads, each its own op, shape and dtype, 25 calls each, all at once: every
    result equals (bit for bit) the one computed alone, which matches the reference."""
    device = device_of(platform)
    cases = [_thread_case_args(i) for i in range(len(THREAD_CASES))]
    alone = [check_against_reference(platform, op, *args)[0] for op, args in cases]
    start = threading.Barrier(len(cases))

    def worker(i):
        op, args = cases[i]
        placed = [jax.device_put(a, device) for a in args]
        fn = jax.jit(getattr(fp8norm, op))
        start.wait()
        for _ in range(25):
            assert_same_bits([np.asarray(o) for o in fn(*placed)], alone[i])
        return i

    with ThreadPoolExecutor(len(cases)) as pool:
        assert sorted(pool.map(worker, range(len(cases)))) == list(range(len(cases)))


NUM_VIRTUAL_DEVICES = 8

if len(jax.devices("cpu")) < NUM_VIRTUAL_DEVICES:

    @pytest.mark.parametrize("tier", TIERS)
    def test_on_eight_virtual_cpu_devices(tier):
        rerun_with_virtual_cpu_devices(
            __file__, 8, tier, "-k", "test_eight_devices_at_once or test_every_gpu_at_once"
        )

else:

    def test_eight_devices_at_once():
        """One thread per virtual CPU device, each calling on its own device at once, and
        one call sharded over all eight."""
        devices = jax.devices("cpu")[:NUM_VIRTUAL_DEVICES]
        cases = [_thread_case_args(i) for i in range(len(THREAD_CASES))]
        alone = [check_against_reference("cpu", op, *args)[0] for op, args in cases]
        start = threading.Barrier(len(devices))

        def worker(i):
            op, args = cases[i]
            placed = [jax.device_put(a, devices[i]) for a in args]
            start.wait()
            for _ in range(10):
                outs = jax.jit(getattr(fp8norm, op))(*placed)
                assert {o.devices().pop() for o in outs} == {devices[i]}
                assert_same_bits([np.asarray(o) for o in outs], alone[i])

        mesh = jax.sharding.Mesh(np.array(devices), ("rows",))
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows", None))

        def sharded_call():
            op, args = _thread_case_args(3)  # 128 x 4096: 16 rows per device
            placed = [jax.device_put(a, rows) for a in args[:-1]] + [args[-1]]
            outs = jax.jit(getattr(fp8norm, op))(*placed)
            assert all(len(o.sharding.device_set) == len(devices) for o in outs)
            assert_same_bits([np.asarray(o) for o in outs], alone[3])

        with ThreadPoolExecutor(len(devices) + 1) as pool:
            calls = [pool.submit(worker, i) for i in range(len(devices))]
            calls.append(pool.submit(sharded_call))
            for call in calls:
                call.result()


@pytest.mark.default_platforms("cpu", "simt-block_shared")
def test_every_gpu_at_once(platform):
    """One thread per GPU, each calling on its own GPU at once, on hidden sizes whose rows
    are cached with opted-in shared memory (14336 bf16, 12189 float32) or too long to
    cache: every result lands on its device and matches the reference. On the CPU: the
    same over its devices. XLA makes the stream's device current before it calls a
    handler, so this cannot tell whether the handler's own device switch is needed; it
    holds the multi-GPU path to the right answers."""
    devices = jax.devices("gpu" if platform == "gpu" else "cpu")
    if len(devices) < 2 and platform != "gpu":
        pytest.skip("one CPU device here; test_on_eight_virtual_cpu_devices runs this on 8")
    shapes = [((64, 14336), jnp.bfloat16), ((9, 12189), jnp.float32), ((3, 70001), jnp.bfloat16)]
    cases = []
    for i, (shape, dtype) in enumerate(shapes):
        args = (random_rows(i, shape, dtype), random_gamma(i, shape[-1], jnp.float32))
        cases.append((args, reference_on_cpu(fp8norm.reference.rms_norm_fp8, *args)))
    start = threading.Barrier(len(devices))

    def worker(device):
        start.wait()
        for args, want in cases:
            placed = [jax.device_put(a, device) for a in args]
            outs = jax.jit(fp8norm.rms_norm_fp8)(*placed)
            assert {o.devices().pop() for o in outs} == {device}
            assert_kernel_matches(platform, [np.asarray(o) for o in outs], want)

    with ThreadPoolExecutor(len(devices)) as pool:
        list(pool.map(worker, devices))


# ------------------------------------------------------------------ memory


def _host_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_bytes_in_use(device) -> int | None:
    stats = device.memory_stats()
    return None if stats is None else stats.get("bytes_in_use")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
@pytest.mark.default_platforms("cpu")
def test_memory_flat_over_10000_calls(platform):
    """10,000 jitted calls and 2,000 eager ones (after a warm-up) leave host memory within
    16 MiB and the device's bytes in use unchanged. Every call's scratch is 16 KiB or more
    (4096 float32), so a per-call leak would show as 160 MiB or more. The emulated kernels
    make 2,000 and 400 calls on 2 rows: a leak still shows as 32 MiB or more."""
    device = device_of(platform)
    rows, count = (2, 2000) if is_simt(platform) else (8, 10000)
    x = jax.device_put(random_rows(1, (rows, 4096), jnp.bfloat16), device)
    residual = jax.device_put(random_rows(2, (rows, 4096), jnp.bfloat16), device)
    gamma = jax.device_put(random_gamma(3, 4096, jnp.float32), device)
    rms, add = jax.jit(fp8norm.rms_norm_fp8), jax.jit(fp8norm.add_rms_norm_fp8)

    def calls(count):
        for i in range(count):
            if i % 2:
                jax.block_until_ready(rms(x, gamma))
            else:
                jax.block_until_ready(add(x, residual, gamma))
        for _ in range(count // 5):
            jax.block_until_ready(fp8norm.rms_norm_fp8(x, gamma))

    calls(count // 10)
    host_before, device_before = _host_rss_bytes(), _device_bytes_in_use(device)
    calls(count)
    host_growth = _host_rss_bytes() - host_before
    assert host_growth < 16 * 2**20, f"host memory grew by {host_growth / 2**20:.1f} MiB"
    if device_before is not None:
        assert _device_bytes_in_use(device) == device_before


# ------------------------------------------------------------------ bad input


@pytest.mark.extended
def test_bad_input_never_kills_the_process():
    """Every bad input of the spec, the handler-level refusals and the awkward shapes of
    tests/children/bad_input.py, in a subprocess: each raises the expected exception or
    matches the reference, and the process exits normally."""
    result = subprocess.run(
        [sys.executable, os.path.join(TESTS_DIR, "children", "bad_input.py")],
        cwd=TESTS_DIR,
        env=dict(os.environ, PYTHONPATH=TESTS_DIR),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    lines = result.stdout.splitlines()
    started = [line.split(" ", 1)[1] for line in lines if line.startswith("START ")]
    passed = [line.split(" ", 1)[1] for line in lines if line.startswith("PASS ")]
    if result.returncode < 0:
        pytest.fail(
            f"killed by {signal.Signals(-result.returncode).name} in case {started[-1]}\n"
            + result.stderr[-3000:]
        )
    failures = [line for line in lines if line.startswith("FAIL ")]
    assert not failures, "\n".join(failures)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    done = re.search(r"^DONE (\d+)$", result.stdout, re.M)
    assert done and int(done.group(1)) == len(passed) == len(started) > 150, result.stdout[-2000:]


# ------------------------------------------------------------------ determinism


@pytest.mark.default_platforms("cpu", "simt-warp_rows")
def test_same_input_same_bits(platform):
    x = random_rows(5, (300, 4099), jnp.bfloat16)
    residual = random_rows(6, (300, 4099), jnp.bfloat16)
    gamma = random_gamma(7, 4099, jnp.float32)
    op = fp8norm.add_rms_norm_fp8
    first = run_on(platform, op, x, residual, gamma)
    for jit in (True, True, False):
        assert_same_bits(run_on(platform, op, x, residual, gamma, jit=jit), first)


DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import jax, numpy as np
    import jax_fp8norm as fp8norm
    from helpers import random_gamma, random_rows
    jax.config.update("jax_platforms", "cpu")
    outs = {}
    for hidden, rows in ((4099, 700), (70001, 9), (64, 20000)):
        x = random_rows(hidden, (rows, hidden), "bfloat16")
        residual = random_rows(hidden + 1, (rows, hidden), "bfloat16")
        gamma = random_gamma(hidden, hidden, "float32")
        for name, v in zip("ysr", fp8norm.add_rms_norm_fp8(x, residual, gamma)):
            outs[f"{hidden}-{name}"] = np.asarray(v).view(np.uint8)

    # The threads that work on one call: each thread's CPU time before and after each of
    # 40 calls, read from its CPU-time clock (Linux's clock id of thread tid), which is
    # exact at the moment of reading (/proc's statistics lag by up to a tick); a thread
    # that took a fifth of a call's CPU time or more worked on it.
    import time

    def cpu_ns():
        times = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                times[tid] = time.clock_gettime_ns((~int(tid) << 3) | 6)
            except OSError:
                pass  # a thread that ended
        return times

    x = jax.device_put(random_rows(1, (4096, 2048), "bfloat16"))
    gamma = jax.device_put(random_gamma(1, 2048, "float32"))
    call = jax.jit(fp8norm.rms_norm_fp8).lower(x, gamma).compile()
    jax.block_until_ready(call(x, gamma))
    busy = []
    for _ in range(40):
        before = cpu_ns()
        jax.block_until_ready(call(x, gamma))
        after = cpu_ns()
        spent = [after[t] - before.get(t, 0) for t in after]
        busy.append(sum(d >= sum(spent) / 5 for d in spent))
    outs["threads per call"] = np.asarray(busy)
    np.savez(sys.argv[1], **outs)
    """
)


@pytest.mark.long_running
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-thread CPU clocks")
def test_same_bits_for_every_cpu_thread_count(tmp_path):
    """The CPU kernel on 1 thread, 2, and every core (FP8NORM_CPU_THREADS): bit-for-bit the
    same outputs; and the cap takes effect: one thread works on a call under
    FP8NORM_CPU_THREADS=1, two under 2 (where there are two cores)."""
    counts = sorted({1, 2, os.cpu_count() or 1})
    results = [
        outputs_of_script(
            DETERMINISM_SCRIPT, tmp_path / f"threads{count}.npz", FP8NORM_CPU_THREADS=str(count)
        )
        for count in counts
    ]
    for count, result in zip(counts, results, strict=True):
        busy = result.pop("threads per call")
        assert busy.min() >= 1 and busy.max() <= count, (count, busy)
        # A helper may start too late for a call now and then, so the most threads seen
        # on one call of the 40 is what the cap allows.
        if count == 1:
            assert busy.max() == 1, busy
        elif (os.cpu_count() or 1) >= 2:
            assert busy.max() >= 2, (count, busy)
    for count, result in zip(counts[1:], results[1:], strict=True):
        assert result.keys() == results[0].keys()
        for key in result:
            np.testing.assert_array_equal(result[key], results[0][key], f"{count} threads: {key}")


OUT_OF_MEMORY_SCRIPT = textwrap.dedent(
    """
    import os, resource
    import jax, jax.numpy as jnp, numpy as np
    import jax_fp8norm as fp8norm
    jax.config.update("jax_platforms", "cpu")
    n = 1 << 25  # two rows: two tasks, one of them on a pool thread
    x = jnp.ones((2, n), jnp.bfloat16)
    gamma = jnp.ones((n,), jnp.bfloat16)
    call = jax.jit(fp8norm.rms_norm_fp8).lower(x, gamma).compile()
    # Rows of ones: the scale does not depend on the row's length.
    _, want = jax.jit(fp8norm.reference.rms_norm_fp8)(x[:, :64], gamma[:64])
    want = float(np.asarray(want)[0, 0])
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    def attempt(label, limit):
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        try:
            y, scales = call(x, gamma)
            scales = np.asarray(scales)
        except Exception as error:
            message = str(error).splitlines()[0]
            print("ERROR", label, message[:200], flush=True)
            return False
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
        ok = bool((scales == want).all())
        print("OK" if ok else "WRONG", label, flush=True)
        return ok
    # Up in 20 MiB steps until two calls in a row succeed: how much headroom a call needs
    # beside our buffers depends on the jax release and on how many threads have touched
    # malloc (each arena reserves address space), so the sweep finds the edge itself.
    successes = 0
    for headroom in range(0, 4 << 30, 20 << 20):
        successes = successes + 1 if attempt(headroom >> 20, base + headroom) else 0
        if successes == 2:
            break
    # After every failure above, a call without a limit gives the right answer.
    attempt("unlimited", resource.RLIM_INFINITY)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="address-space limit (Linux)")
def test_running_out_of_host_memory_raises():
    """Address-space limits from none to plenty around a 2 x 2^25 call: every call raises
    an error or gives the right answer; no allocation failure on a pool thread, where an
    exception would end the process, gets through."""
    result = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY_SCRIPT],
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, (lines[-3:], result.stderr[-3000:])
    assert not [line for line in lines if line.startswith("WRONG")], lines
    assert any("jax_fp8norm: out of host memory" in line for line in lines), lines
    assert lines[-3].startswith("OK") and lines[-2].startswith("OK"), lines
    assert lines[-1] == "OK unlimited", lines
