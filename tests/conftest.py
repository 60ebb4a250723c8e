"""pytest's configuration of the suite: the tiers' markers and the ``platform`` fixture.

Every kernel test takes the ``platform`` fixture and runs on ``cpu`` (the CPU kernels),
``simt-<variant>`` (the CUDA kernels and handlers, emulated on the CPU backend; see
jax_fp8norm.simt) and ``gpu``. With no GPU the GPU runs skip; with FP8NORM_REQUIRE_GPU=1
they fail instead. ``pytest -k simt`` selects the emulated runs. The helpers the tests
import are in helpers.py.
"""

from __future__ import annotations

import pytest

# First: helpers sets XLA's flags for the suite before jax starts.
from helpers import (
    EXTENDED,
    REQUIRE_GPU,
    SIMT_PLATFORMS,
    gpu_devices,
    is_simt,
    kernels_of,
    unexpected_skips,
)

import jax_fp8norm.simt


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The default tier's share of the big tests: the rest of their items are marked
    extended. ``@pytest.mark.sampled(n)`` keeps every n-th combination of a test's
    parameters, and any combination that brings a value of a parameter no kept one has
    (so every value of every parameter appears), on all platforms alike, so that they
    share the reference's outputs. ``@pytest.mark.default_platforms(*names)`` keeps the
    test's items on those platforms (and "gpu", which skips without a GPU)."""
    kept: dict = {}  # test function -> ({combination: kept}, {(parameter, value) kept})
    for item in items:
        callspec = getattr(item, "callspec", None)
        sampled = item.get_closest_marker("sampled")
        if sampled is not None and callspec is not None:
            combination = tuple(
                sorted((k, repr(v)) for k, v in callspec.params.items() if k != "platform")
            )
            decided, covered = kept.setdefault(item.function, ({}, set()))
            if combination not in decided:
                first_of_n = len(decided) % sampled.args[0] == 0
                decided[combination] = first_of_n or not covered.issuperset(combination)
                if decided[combination]:
                    covered.update(combination)
            if not decided[combination]:
                item.add_marker(EXTENDED)
        platforms = item.get_closest_marker("default_platforms")
        if platforms is not None and callspec is not None:
            if callspec.params.get("platform") not in (*platforms.args, "gpu"):
                item.add_marker(EXTENDED)


@pytest.fixture(params=["cpu", *SIMT_PLATFORMS, "gpu"])
def platform(request):
    if request.param == "gpu" and not gpu_devices():
        message = "no GPU backend available to jax"
        if REQUIRE_GPU:
            pytest.fail(f"FP8NORM_REQUIRE_GPU is set but {message}")
        pytest.skip(message)
    if is_simt(request.param) and not jax_fp8norm.simt.available():
        pytest.fail("this build of jax_fp8norm has no SIMT emulation (_fp8norm_simt)")
    with kernels_of(request.param):
        yield request.param


_skip_reasons: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        _skip_reasons.append(report.longrepr[2].removeprefix("Skipped: "))


def _unexpected() -> list[str]:
    return sorted(set(unexpected_skips(_skip_reasons)))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """A run with a skip that helpers.EXPECTED_SKIPS does not name fails: a skip must not
    hide a test. (The controller decides; pytest-xdist's workers report to it.)"""
    if not hasattr(session.config, "workerinput") and _unexpected() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unexpected = [] if hasattr(config, "workerinput") else _unexpected()
    if unexpected:
        terminalreporter.section("unexpected skips (tests/helpers.py, EXPECTED_SKIPS)", red=True)
        for reason in unexpected:
            terminalreporter.write_line(f"  {reason}", red=True)
