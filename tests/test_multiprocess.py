"""The ops across processes, multi-host style, with JAX's own runtime: two processes on
localhost join one jax.distributed job (4 virtual CPU devices each, gloo collectives)
and run tests/children/multiprocess.py on one 8-device mesh spanning both:
allreduce_residual_rms_norm_fp8 under shard_map (reduce_dtype None and float32) and the
row-sharded rms_norm_fp8 under plain jit, each process checking its own shards against
references it computes alone. Gloo missing from jaxlib fails the test; it does not skip.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(TESTS_DIR, "children", "multiprocess.py")
NUM_PROCESSES = 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    # The child sets its own device count and platform; a device count in XLA_FLAGS
    # (from a virtual-device rerun) would fight it.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    if flags.strip():
        env["XLA_FLAGS"] = flags.strip()
    else:
        env.pop("XLA_FLAGS", None)
    return env


def _kill(child: subprocess.Popen) -> None:
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()


def _run_children(logs_dir, *extra_args: str) -> tuple[list[int | None], list[str], bool]:
    """Starts the processes, waits for all of them (or the first failure, or the
    deadline) and returns their exit codes (None: killed), outputs and whether the
    deadline passed."""
    port = _free_port()
    logs = [os.path.join(logs_dir, f"process{i}.log") for i in range(NUM_PROCESSES)]
    children: list[subprocess.Popen] = []
    timed_out = False
    try:
        for i, log in enumerate(logs):
            with open(log, "wb") as out:
                children.append(
                    subprocess.Popen(
                        [sys.executable, CHILD, str(i), str(port), *extra_args],
                        cwd=TESTS_DIR,
                        env=_child_env(),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while any(c.poll() is None for c in children):
            # A process that failed leaves the other waiting in a collective: stop there.
            if any(c.poll() not in (None, 0) for c in children):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        codes = [c.poll() for c in children]
        for child in children:
            _kill(child)
    outputs = []
    for log in logs:
        with open(log, errors="replace") as f:
            outputs.append(f.read())
    return codes, outputs, timed_out


@pytest.mark.extended
def test_two_processes_on_one_mesh(tmp_path):
    start = time.monotonic()
    codes, outputs, timed_out = _run_children(tmp_path)
    elapsed = time.monotonic() - start
    report = "\n".join(
        f"===== process {i}: exit code {code}{' (killed)' if code is None else ''} =====\n"
        f"{out[-8000:]}"
        for i, (code, out) in enumerate(zip(codes, outputs, strict=True))
    )
    assert not timed_out, f"no result within {TIMEOUT_S} s; both processes killed\n{report}"
    assert codes == [0] * NUM_PROCESSES, f"after {elapsed:.0f} s\n{report}"
    for i, out in enumerate(outputs):
        # Not anchored to a line: the collectives library writes to the same stream
        # unsynchronised, and a line of its may run into ours.
        assert re.search(rf"PASS process {i}: all checks", out), report
        assert "FAIL" not in out, report


@pytest.mark.extended
def test_a_wrong_result_fails(tmp_path):
    # The same run with one bit of one expected value flipped in process 0's checks: the
    # harness must report it (and still end both processes).
    codes, outputs, timed_out = _run_children(tmp_path, "--corrupt")
    assert not timed_out
    assert codes[0] == 1, outputs[0][-4000:]
    assert re.search(r"^FAIL process 0 rows-\w+-bits-vs-one-device", outputs[0], re.MULTILINE)
