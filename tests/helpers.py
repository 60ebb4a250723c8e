"""The tests' helpers, imported by the test modules and the child scripts (``from helpers
import ...``): the platforms and how to run on each, the comparisons with the reference
(bits on cpu and simt, the accuracy rule on a GPU), data generators and subprocess
reruns. pytest's hooks and fixtures are in conftest.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import threading
import warnings

# The tests compile many small jitted functions, and LLVM's optimisation passes are most of
# XLA's compile time on the CPU backend, and level 0 skips them. It
# changes no result (no pass at any level may change IEEE float semantics). A level in
# the caller's XLA_FLAGS wins, coming later.
os.environ["XLA_FLAGS"] = (
    "--xla_backend_optimization_level=0 " + os.environ.get("XLA_FLAGS", "")
).strip()
# The tensor-parallel tests need 8 devices, which the CPU backend makes virtual only when
# asked before jax starts. The session asks for them, so that those tests run among the
# others on the workers; the other tests run on one device unless they test several. A
# device count in the caller's XLA_FLAGS wins, and then the modules that need 8 rerun
# themselves in a subprocess (rerun_with_virtual_cpu_devices).
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The default tier runs in two worker processes (pyproject.toml): on a GPU each takes the
# memory it needs, instead of jax's default of most of the GPU for the first one.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
    import jax_fp8norm
    import jax_fp8norm.simt
except ImportError as error:
    raise pytest.UsageError(
        f"jax_fp8norm is not importable with its compiled modules ({error}). Install it: "
        "`python -m pip install .`."
    ) from error

from jax_fp8norm._dtypes import FLOAT_DTYPES, OUT_DTYPES
from jax_fp8norm.recipes import RECIPES, apply_recipe, recipe_keywords
from jax_fp8norm.testing import assert_matches_reference, assert_same_bits

# The tests' vocabulary, from the package's own tables: the input dtypes (as jnp's scalar
# types: float32, float16, bfloat16), the output dtypes, the recipes.
FLOATS = [getattr(jnp, dtype.name) for dtype in FLOAT_DTYPES]
OUTS = [getattr(jnp, dtype.name) for dtype in OUT_DTYPES]
FP8S = [dtype for dtype in OUTS if dtype is not jnp.float4_e2m1fn]
RECIPE_NAMES = tuple(RECIPES)
# The data the recipes that take it are given in the tests: a calibrated scale, NVFP4's
# global decode scale (amax / (448 * 6) for the tests' rows).
RECIPE_DATA = {"fp8_static": {"static_scale": 0.02}, "nvfp4": {"global_scale": 0.0021}}


def recipe(name: str, **changes) -> dict:
    """The keywords of a call with the recipe ``name``: ``recipe=name`` and the data it
    takes (RECIPE_DATA), with ``changes`` on top."""
    return {"recipe": name, **RECIPE_DATA.get(name, {}), **changes}


def layout(name: str, *, data: bool = True, **changes) -> dict:
    """The recipe ``name`` spelled out as the keywords it sets to a value (no ``recipe=``,
    no keyword it leaves at None), with its data (unless ``data=False``) and ``changes``:
    for tests that read a layout's keywords."""
    spelled = {k: v for k, v in recipe_keywords(name).items() if v is not None}
    return {**spelled, **(RECIPE_DATA.get(name, {}) if data else {}), **changes}


REQUIRE_GPU = os.environ.get("FP8NORM_REQUIRE_GPU", "") not in ("", "0")


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# The emulated CUDA kernels, once per kernel variant (auto chooses among these; its table is
# tests/test_cuda_launch_plan.py's): "simt-block_shared", "simt-warp_rows", "simt-block_registers".
SIMT_VARIANTS = tuple(jax_fp8norm.cuda_kernel_variants()[1:])
SIMT_PLATFORMS = tuple(f"simt-{v}" for v in SIMT_VARIANTS)


# The extended tier: the full cross products, the long rows and the subprocess-heavy
# tests. `pytest` leaves them out (pyproject.toml's addopts); `pytest -m extended` runs
# them, and CI runs both.
EXTENDED = pytest.mark.extended
# The tiers a test that reruns a module in a subprocess takes as a parameter: each tier's
# item reruns that tier's tests of the module.
TIERS = ["default", pytest.param("extended", marks=EXTENDED)]
TIER_MARKS = {"default": "not extended", "extended": "extended"}


# The reasons a test may skip on a machine like CI's (no GPU) or the GPU machine's:
# regular expressions, searched in each skip's reason. Any other skip fails the run
# (conftest.py, and the child sessions of rerun_with_virtual_cpu_devices), so a skip can
# no longer hide a test: a missing package the set-up installs, a module that lost its
# build, a platform check gone wrong.
EXPECTED_SKIPS = (
    r"no GPU backend available to jax",
    r"command buffers are a GPU feature",
    r"a GPU-only check",
    r"^NVIDIA .* has no ",  # a GPU below the feature's compute capability
    r"about 7 GiB of host memory; FP8NORM_HUGE_TESTS=1 runs it",
    r"2\^31 elements through fibers",
    r"one CPU device here; test_on_eight_virtual_cpu_devices runs this on 8",
    r"no test of the (default|extended) tier in test_\w+\.py",
    r"the emulated device's grid limit",
    r"another emulated variant's shape",
)


def _skips_expected_here() -> tuple[str, ...]:
    """EXPECTED_SKIPS, and the skips of checks that this machine cannot make: those of
    the CPU backend where jax defaults to a GPU, of Linux elsewhere, of the AVX2 variant
    on other instruction sets. On CI's machine (x86-64 Linux, the CPU backend) none."""
    expected = list(EXPECTED_SKIPS)
    if jax.default_backend() != "cpu":
        expected += [r"bit for bit on the CPU backend", r"the default backend is not the CPU"]
    if not sys.platform.startswith("linux"):
        expected += [r"\(Linux\)$", r"Linux's per-thread CPU clocks"]
    if jax_fp8norm.cpu_kernel_variant() != "avx2":
        expected += [r"no AVX2 variant here"]
    return tuple(expected)


def unexpected_skips(reasons) -> list[str]:
    """The skip reasons that this machine's expected skips do not name."""
    expected = _skips_expected_here()
    return [r for r in reasons if not any(re.search(p, r) for p in expected)]


def is_simt(platform: str) -> bool:
    return platform.startswith("simt")


def is_gpu(platform: str) -> bool:
    """The one platform held to the spec's accuracy rule; cpu and simt give the
    reference's bits."""
    return platform == "gpu"


@contextlib.contextmanager
def kernels_of(platform: str):
    """Makes the ops use the platform's kernels: for `simt-<variant>` the emulated CUDA
    kernels, that variant; the other platforms need nothing."""
    if not is_simt(platform):
        yield
        return
    variant = platform.partition("-")[2] or "auto"
    with jax_fp8norm.simt.kernels(), jax_fp8norm.use_cuda_kernel(variant):
        yield


def device_of(platform: str) -> jax.Device:
    """The jax device a platform's kernels run on: the emulated ones on the CPU."""
    return jax.devices("cpu" if is_simt(platform) else platform)[0]


def run_on(platform: str, fn, *args, jit: bool = True, **kwargs):
    """Runs ``fn(*args, **kwargs)`` on ``platform`` and returns its outputs as NumPy."""
    device = device_of(platform)
    placed = [jax.device_put(a, device) for a in args]
    call = jax.jit(lambda *a: fn(*a, **kwargs)) if jit else (lambda *a: fn(*a, **kwargs))
    with jax.default_device(device):
        outs = call(*placed)
    return tuple(np.asarray(o) for o in outs)


def _key_of(value):
    """A hashable stand-in for an argument: arrays by dtype, shape and bytes."""
    if isinstance(value, (np.ndarray, jax.Array, np.generic)):
        array = np.asarray(value)
        return ("array", array.dtype.str, array.shape, hashlib.sha1(array.tobytes()).digest())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_key_of, value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, _key_of(v)) for k, v in value.items()))
    return ("value", type(value).__name__, repr(value))


# Reference outputs by function, arguments and keywords: every kernel test runs on four
# platforms against the same reference outputs, which are computed once.
_reference_outputs: dict = {}


# The twins' exact sums (the sum of squares, the backward's sums) are most of what
# compiling a twin costs, and the tests call many twins on few shapes. reference_on_cpu
# runs a twin as two kinds of program: each sum on its own (compiled once per shape,
# whatever the twin and its keywords), and the whole twin with the sums as arguments,
# which also returns the sums' operands. It runs the twin's program twice: with zeros for
# the sums, for their operands (no operand depends on a sum's result), then with the sums
# of those operands. Only where XLA's programs begin and end changes: the twin's
# functions do all the math, and the sums' float32 results pass between the programs
# unchanged. Each sum's result shape from its operand's: the sum of squares keeps the
# summed last axis as 1, exact_sum drops it (taking its operand with that axis last).
_EXACT_SUMS = {
    "sum_of_squares": lambda shape: (*shape[:-1], 1),
    "exact_sum": lambda shape: shape[:-1],
}
_EXACT_SUM_FUNCTIONS = {name: getattr(jax_fp8norm.reference, name) for name in _EXACT_SUMS}
_EXACT_SUM_PROGRAMS = {name: jax.jit(fn) for name, fn in _EXACT_SUM_FUNCTIONS.items()}
_REPLACING = threading.Lock()


@contextlib.contextmanager
def _replacing_exact_sums(stand_in):
    """The twins' exact sums replaced, in this thread while tracing, by ``stand_in(name,
    operand)``, the operand float32 with the summed axis last. Other threads, and any
    other caller of the twin meanwhile, get the sums themselves."""
    owner = threading.get_ident()

    def replacement(name):
        def replaced(operand, **keywords):
            if threading.get_ident() != owner:
                return _EXACT_SUM_FUNCTIONS[name](operand, **keywords)
            axis = keywords.pop("axis", -1)
            assert not keywords, f"{name} given {keywords}"
            return stand_in(name, jnp.moveaxis(jnp.asarray(operand, jnp.float32), axis, -1))

        return replaced

    with _REPLACING:
        try:
            for name in _EXACT_SUMS:
                setattr(jax_fp8norm.reference, name, replacement(name))
            yield
        finally:
            for name, fn in _EXACT_SUM_FUNCTIONS.items():
                setattr(jax_fp8norm.reference, name, fn)


def _twin_programs(fn, kwargs):
    """``fn(*args, **kwargs)`` as (the operands of its exact sums, the twin given their
    results), each jitted: the first only for the operands' shapes (traced, never
    compiled); the second also returns the operands it computed."""

    def operands(*args):
        seen = {name: [] for name in _EXACT_SUMS}

        def record(name, operand):
            seen[name].append(operand)
            return jnp.zeros(_EXACT_SUMS[name](operand.shape), jnp.float32)

        with _replacing_exact_sums(record):
            fn(*args, **kwargs)
        return seen

    def outputs(args, sums):
        given = {name: iter(results) for name, results in sums.items()}
        seen = {name: [] for name in _EXACT_SUMS}

        def take(name, operand):
            seen[name].append(operand)
            result = next(given[name], None)
            assert result is not None, f"a {name} that the first program did not take"
            return result

        with _replacing_exact_sums(take):
            outs = fn(*args, **kwargs)
        assert all(next(rest, None) is None for rest in given.values()), "a sum left over"
        return outs, seen

    return jax.jit(operands), jax.jit(outputs)


# The twins' programs by function and keywords: traced and compiled once, they serve
# every later call with arguments of the same shapes and dtypes.
_twins: dict = {}


def _run_twin(fn, kwargs, args):
    key = (fn, _key_of(kwargs))
    if key not in _twins:
        _twins[key] = _twin_programs(fn, kwargs)
    operands, outputs = _twins[key]
    shapes = operands.eval_shape(*args)
    # Placed as the sums will be, or the second run would compile the program again.
    cpu = jax.devices("cpu")[0]
    zeros = {
        name: [jax.device_put(np.zeros(_EXACT_SUMS[name](s.shape), np.float32), cpu) for s in ops]
        for name, ops in shapes.items()
    }
    _, seen = outputs(args, zeros)
    sums = {name: [_EXACT_SUM_PROGRAMS[name](o) for o in ops] for name, ops in seen.items()}
    outs, seen_again = outputs(args, sums)
    # The same operands whatever the sums: none depends on a sum's result.
    for name, ops in seen.items():
        assert_same_bits(seen_again[name], ops)
    return outs


def reference_on_cpu(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a twin of jax_fp8norm.reference) on the CPU, as NumPy,
    computed once per function, argument values and keywords."""
    key = (fn.__module__, fn.__qualname__, _key_of(args), _key_of(kwargs))
    if key not in _reference_outputs:
        cpu = jax.devices("cpu")[0]
        placed = [jax.device_put(a, cpu) for a in args]
        with jax.default_device(cpu):
            outs = _run_twin(fn, kwargs, placed)
        _reference_outputs[key] = tuple(np.asarray(o) for o in outs)
    return tuple(o.copy() for o in _reference_outputs[key])


def assert_kernel_matches(platform: str, got, want, **kwargs) -> None:
    """The kernels' promise on ``platform``: the reference's bits on cpu and simt, the
    spec's accuracy rule on a GPU (whose fast reciprocal square root may move a value
    across a rounding tie)."""
    if is_gpu(platform):
        power_of_two = apply_recipe(kwargs).get("power_of_two_scales") or None
        assert_matches_reference(got, want, power_of_two=power_of_two)
    else:
        assert_same_bits(got, want)


def kernel_op(op: str):
    """The kernel-backed function ``op`` names: a public op, or a building block beneath
    the public ``*_vjp`` (the training forms, the checked backward)."""
    from jax_fp8norm import _training

    return getattr(jax_fp8norm, op, None) or getattr(_training, op)


def check_against_reference(platform: str, op: str, *args, jit: bool = True, **kwargs):
    """Runs ``jax_fp8norm.<op>`` on ``platform`` and its twin ``jax_fp8norm.reference.<op>``
    on the CPU, asserts what the platform promises (assert_kernel_matches) and returns
    ``(outputs, reference)``."""
    out = run_on(platform, kernel_op(op), *args, jit=jit, **kwargs)
    ref = reference_on_cpu(getattr(jax_fp8norm.reference, op), *args, **kwargs)
    assert_kernel_matches(platform, out, ref, **kwargs)
    return out, ref


COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")


def collectives_in(hlo: str) -> list[str]:
    """The cross-device collectives a compiled module's HLO text contains."""
    return [c for c in COLLECTIVES if re.search(rf"\b{c}(?:-start)?\(", hlo)]


def same_bits(got, want, what: str = "") -> None:
    """``got`` has ``want``'s dtype, shape and bits (NaN payloads and signed zeros
    included); the message names the first elements that differ."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    mismatch = np.flatnonzero(got.view(view) != want.view(view))
    assert mismatch.size == 0, (
        what,
        f"{mismatch.size} of {got.size} differ",
        mismatch[:8],
        got.reshape(-1)[mismatch[:8]],
        want.reshape(-1)[mismatch[:8]],
    )


# The backward's kernels do not depend on the CUDA kernel variant (a plan of their own):
# one emulated variant is enough.
BACKWARD_PLATFORMS = pytest.mark.parametrize(
    "platform", ["cpu", "simt-block_shared", "gpu"], indirect=True
)


def random_rows(seed: int, shape, dtype, *, spread: float = 2.0) -> np.ndarray:
    """Normal values with a per-row magnitude spread over 10^[-spread, spread]."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape)
    if len(shape) >= 1 and shape[-1] > 0:
        magnitude = 10.0 ** rng.uniform(-spread, spread, size=shape[:-1] + (1,))
        values = values * magnitude
    return values.astype(jnp.dtype(dtype))


def random_gamma(seed: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-2.0, 2.0, size=(n,)).astype(jnp.dtype(dtype))


def cancelling_batch(seed: int, rows: int, n: int, x_dtype="bfloat16"):
    """Finite rows whose backward sums cancel, shuffled: ``x`` in pairs of equal rows (equal
    ``r`` and ``u``) of magnitudes 10^-2 .. 10^2, whose squares stay in range; ``dn`` in
    near-opposite pairs (t, -t(1 + k 2^-20)) over 2^-40 .. 2^40 element by element, so
    that dgamma's column sums cancel pairwise down to what the small terms decide, and a
    row's terms of c, of random signs over 80 binades, cancel too. (x, dn float32, gamma
    float32)."""
    assert rows % 2 == 0
    rng = np.random.default_rng(seed)
    half = rows // 2
    x = random_rows(seed, (half, n), x_dtype)
    base = rng.standard_normal((half, n)) * 2.0 ** rng.integers(-40, 41, (half, n))
    wobble = 1 + rng.integers(-3, 4, (half, n)) * 2.0**-20
    dn = np.concatenate([base, -base * wobble]).astype(np.float32)
    order = rng.permutation(rows)
    return np.concatenate([x, x])[order], dn[order], random_gamma(seed + 1, n, "float32")


def outputs_of_script(script: str, path, **env: str) -> dict[str, np.ndarray]:
    """Runs ``python -c script path`` with ``env`` added to the environment (an empty value
    removes the variable) and returns the arrays the script saved to ``path`` with
    ``np.savez``. It runs from tests/, with helpers importable."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    # tests/ ahead of what the caller's path already holds (the mutation checks put their
    # build of the kernels there).
    python_path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    full_env = dict(os.environ, PYTHONPATH=python_path)
    for name, value in env.items():
        if value:
            full_env[name] = value
        else:
            full_env.pop(name, None)
    subprocess.run(
        [sys.executable, "-c", script, str(path)],
        env=full_env,
        cwd=tests_dir,
        check=True,
        timeout=600,
    )
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def rerun_with_virtual_cpu_devices(
    test_file: str, num_devices: int, tier: str = "default", *pytest_args: str
) -> None:
    """Runs the tests of ``tier`` (TIERS) of the module ``test_file`` again (with
    ``pytest_args``) in a subprocess whose jax has ``num_devices`` virtual CPU devices
    (they must be requested before jax starts), and fails with its output unless every
    test there passed. A tier with no test there skips. For sessions with fewer devices:
    the caller's XLA_FLAGS set their count, or jax started before this module."""
    flags = os.environ.get("XLA_FLAGS", "")
    # The subprocess runs in the tests' folder: it imports jax_fp8norm from where this
    # session did (the source tree, from the repository root), not another copy.
    source = os.path.dirname(os.path.dirname(os.path.abspath(jax_fp8norm.__file__)))
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(
        os.environ,
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={num_devices}".strip(),
        PYTHONPATH=path,
    )
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0"]
    result = subprocess.run(
        [*command, "-m", TIER_MARKS[tier], test_file, *pytest_args],
        cwd=os.path.dirname(os.path.abspath(test_file)),
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    summary = result.stdout[-6000:] + result.stderr[-3000:]
    if result.returncode == 5:
        pytest.skip(f"no test of the {tier} tier in {os.path.basename(test_file)}")
    assert result.returncode == 0, summary
    assert re.search(r"\d+ passed", result.stdout), summary
    assert "failed" not in result.stdout.splitlines()[-1], summary
    # The child's own session refuses unexpected skips; the expected ones are reported
    # here, where they would otherwise be invisible.
    skipped = re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", result.stdout, re.M)
    assert not unexpected_skips([reason for _, reason in skipped]), summary
    if skipped:
        lines = "; ".join(f"{count} x {reason}" for count, reason in skipped)
        warnings.warn(f"skipped on {num_devices} virtual devices: {lines}", stacklevel=2)
