"""A skip must not hide a test: a run with a skip whose reason tests/helpers.py's
EXPECTED_SKIPS does not name fails (conftest.py), here and in the virtual-device reruns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import EXPECTED_SKIPS, unexpected_skips

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_the_allowlist():
    assert unexpected_skips(["no GPU backend available to jax"]) == []
    assert unexpected_skips(["no test of the extended tier in test_allreduce_xla.py"]) == []
    assert unexpected_skips(["NVIDIA H200 has no block-scaled tensor cores"]) == []
    missing = ["could not import 'hypothesis': No module named 'hypothesis'"]
    assert unexpected_skips(missing) == missing
    assert unexpected_skips(["built without the emulation"]) == ["built without the emulation"]
    assert len(set(EXPECTED_SKIPS)) == len(EXPECTED_SKIPS)


def _session(tmp_path, reason: str, *module_skips: str) -> subprocess.CompletedProcess:
    """A pytest session with the suite's conftest, of one test that passes and one that
    skips with ``reason``; with ``module_skips`` (module-level skips' statements), of a
    test that passes and a module per statement, skipped by it while it is collected."""
    probes = [tmp_path / "test_probe.py"]
    if not module_skips:
        probes[0].write_text(
            "import pytest\n\n"
            "def test_runs():\n    pass\n\n"
            f"def test_skips():\n    pytest.skip({reason!r})\n"
        )
    else:
        probes[0].write_text("def test_runs():\n    pass\n")
        for i, skip in enumerate(module_skips):
            probes.append(tmp_path / f"test_skipped_module_{i}.py")
            probes[-1].write_text(f"import pytest\n\n{skip}\n\ndef test_hidden():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider"]
    command += ["-n", "0", "-o", "addopts=", *map(str, probes)]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.long_running
def test_an_unexpected_skip_fails_the_run(tmp_path):
    expected = _session(tmp_path, "no GPU backend available to jax")
    assert expected.returncode == 0, expected.stdout + expected.stderr
    unexpected = _session(tmp_path, "could not import 'flax'")
    assert unexpected.returncode == 1, unexpected.stdout + unexpected.stderr
    assert (
        "unexpected skips" in unexpected.stdout and "could not import 'flax'" in unexpected.stdout
    )


@pytest.mark.long_running
def test_an_unexpected_module_level_skip_fails_the_run(tmp_path):
    """A module skipped while it is collected (test_nnx.py's and test_fuzz.py's
    importorskip) hides all of its tests: the same rule (conftest.py's
    pytest_collectreport). An expected reason beside it is not reported."""
    ran = _session(
        tmp_path,
        "",
        'pytest.skip("no GPU backend available to jax", allow_module_level=True)',
        'nnx = pytest.importorskip("no_such_module.nnx")',
    )
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "1 passed, 2 skipped" in ran.stdout, ran.stdout
    unexpected = ran.stdout.partition("unexpected skips")[2]
    assert "could not import 'no_such_module.nnx'" in unexpected, ran.stdout
    assert "no GPU backend" not in unexpected, ran.stdout
