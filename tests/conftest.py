"""pytest's configuration of the suite: the tiers' markers and the ``platform`` fixture.

Every kernel test takes the ``platform`` fixture and runs on ``cpu`` (the CPU kernels),
``simt-<variant>`` (the CUDA kernels and handlers, emulated on the CPU backend; see
jax_fp8norm.simt) and ``gpu``. With no GPU the GPU runs skip; with FP8NORM_REQUIRE_GPU=1
they fail instead. ``pytest -k simt`` selects the emulated runs. The helpers the tests
import are in helpers.py.
"""

from __future__ import annotations

import os

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


def pytest_configure(config):
    """The suite's compiled programs go to jax's persistent compilation cache, in pytest's
    cache folder: the two workers of a run share the programs they both compile (the
    reference twins of a test's platforms), and a later run (the extended tier after the
    default one) reuses them. Only compiling is skipped: every program still runs, and the
    kernels it calls are looked up by name in the build that is installed. A cache the
    caller names (JAX_COMPILATION_CACHE_DIR) wins; ``-p no:cacheprovider`` turns it off."""
    cache = getattr(config, "cache", None)
    if cache is None or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax  # after helpers has set XLA's flags: a top-level import would sort above it

    jax.config.update("jax_compilation_cache_dir", str(cache.mkdir("jax-compilation-cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _combination(item) -> tuple:
    """The item's parameters other than the platform, as sorted (name, repr) pairs."""
    params = item.callspec.params
    return tuple(sorted((k, repr(v)) for k, v in params.items() if k != "platform"))


def _sampled_combinations(items) -> dict:
    """Test function -> the combinations of its parameters that the default tier keeps:
    every n-th (``@pytest.mark.sampled(n)``), then, while some value of some parameter is
    in none of those, the combination that brings the most such values (the first of
    equals). Combinations already in the extended tier take no part: they are not counted
    for the every n-th, and a value only they have is not sought."""
    candidates: dict = {}  # function -> (n, {combination: None} in order)
    for item in items:
        sampled = item.get_closest_marker("sampled")
        callspec = getattr(item, "callspec", None)
        if sampled is None or callspec is None or item.get_closest_marker("extended"):
            continue
        n, combinations = candidates.setdefault(item.function, (sampled.args[0], {}))
        combinations.setdefault(_combination(item))
    kept: dict = {}
    for function, (n, combinations) in candidates.items():
        ordered = list(combinations)
        chosen = set(ordered[::n])
        covered = {pair for combination in chosen for pair in combination}
        wanted = {pair for combination in ordered for pair in combination}
        while covered != wanted:
            best = max(ordered, key=lambda c: len(set(c) - covered))
            chosen.add(best)
            covered.update(best)
        kept[function] = chosen
    return kept


def _rotated_simt_platforms(items) -> dict:
    """Test function -> {combination: the one emulated variant the default tier runs it
    on}, for the tests on the ``platform`` fixture, with no ``default_platforms`` marker,
    that run on two or more variants and have at least one combination per variant in the
    default tier: their combinations take the test's variants in turn (a combination
    without its turn's variant takes the next it has), so that each combination runs on
    cpu and one variant, and each variant runs each such test."""
    combinations: dict = {}  # function -> {combination: [its variants]} in order
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "platform" not in callspec.params:
            continue
        if item.get_closest_marker("extended") or item.get_closest_marker("default_platforms"):
            continue
        present = combinations.setdefault(item.function, {}).setdefault(_combination(item), [])
        if is_simt(callspec.params["platform"]):
            present.append(callspec.params["platform"])
    rotation = {}
    for function, ordered in combinations.items():
        variants = [v for v in SIMT_PLATFORMS if any(v in p for p in ordered.values())]
        if len(variants) < 2 or len(ordered) < len(variants):
            continue
        rotation[function] = {}
        for i, (combination, present) in enumerate(ordered.items()):
            turn = variants[i % len(variants) :] + variants[: i % len(variants)]
            rotation[function][combination] = next((v for v in turn if v in present), None)
    return rotation


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The default tier's share of the big tests: the rest of their items are marked
    extended. ``@pytest.mark.sampled(n)`` keeps every n-th combination of a test's
    parameters and as few more as bring every value of every parameter
    (_sampled_combinations), on all platforms alike, so that they share the reference's
    outputs. ``@pytest.mark.default_platforms(*names)`` keeps the test's items on those
    platforms (and "gpu", which skips without a GPU). Then each combination of the other
    platform tests keeps one emulated variant, in turn (_rotated_simt_platforms). Items
    marked ``long_running`` go first."""
    kept = _sampled_combinations(items)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if item.function in kept and _combination(item) not in kept[item.function]:
            item.add_marker(EXTENDED)
        platforms = item.get_closest_marker("default_platforms")
        if platforms is not None and callspec is not None:
            if callspec.params.get("platform") not in (*platforms.args, "gpu"):
                item.add_marker(EXTENDED)
    rotation = _rotated_simt_platforms(items)
    for item in items:
        if item.function not in rotation or item.get_closest_marker("extended"):
            continue
        keep = rotation[item.function].get(_combination(item))
        platform = item.callspec.params["platform"]
        if keep is not None and is_simt(platform) and platform != keep:
            item.add_marker(EXTENDED)
    # Long items first: pytest-xdist hands each worker a share of the items in order, and a
    # long item among the last would run alone while the other worker waits.
    items.sort(key=lambda item: item.get_closest_marker("long_running") is None)


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


def _record_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        _skip_reasons.append(report.longrepr[2].removeprefix("Skipped: "))


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):
    """A module skipped while it is collected (a module-level ``pytest.importorskip``,
    ``pytest.skip(..., allow_module_level=True)``) goes through the same rule as a test's
    skip: it hides every test of the module. (pytest-xdist's workers send their skipped
    collections to the controller, which calls this hook too.)"""
    _record_skip(report)


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
