"""Runs every bad input of docs/spec.md, the calls that bypass the Python checks, and the
shapes at the kernels' path boundaries, one case at a time, in the process that runs this
file (tests/test_robustness.py starts it in a subprocess, so that a crash names its case).

Prints `START <case>` before a case and `PASS <case>` or `FAIL <case>: <why>` after it,
then `DONE <count>`. A bad input must raise the expected exception, an awkward shape must
match the reference; a signal or an abort leaves a START without its PASS.
"""

from __future__ import annotations

import os
import sys

# The tests' helpers are in the directory above.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from cases import (
    BAD_ARRAYS,
    BAD_KEYWORDS,
    GAMMA,
    HANDLER_CASES,
    X,
    ffi_call,
    handler_target,
)
from helpers import (
    SIMT_PLATFORMS,
    check_against_reference,
    device_of,
    kernels_of,
    random_gamma,
    random_rows,
)

import jax_fp8norm as fp8norm

# Hidden sizes each kernel path treats apart: below one CPU lane block or GPU vector,
# not a multiple of the vector width, one block of threads and a little more, beyond the
# GPU's shared-memory row cache, and beyond 65535.
AWKWARD_HIDDEN = [1, 2, 3, 7, 9, 15, 17, 1023, 1025, 8193, 56321, 65537, 70001]


def _expect_error(fn, error, match):
    try:
        jax.block_until_ready(fn())
    except error as caught:
        if not re.search(match, str(caught)):
            raise AssertionError(f"{type(caught).__name__} without {match!r}: {caught}") from None
        return
    raise AssertionError(f"no {error.__name__} raised")


def _expecting(fn, error, match):
    return lambda: _expect_error(fn, error, match)


def bad_input_cases():
    bad_residuals = [
        (jnp.ones((4, 17), jnp.bfloat16), ValueError, "residual must have the shape"),
        (jnp.ones((4, 16), jnp.float32), TypeError, "residual must have the dtype"),
        ("residual", TypeError, "residual must be an array"),
    ]
    for impl_name, impl in (("ops", fp8norm), ("reference", fp8norm.reference)):
        for i, (kw, error, match) in enumerate(BAD_ARRAYS + BAD_KEYWORDS):
            arrays = dict(x=kw.get("x", X), gamma=kw.get("gamma", GAMMA))
            keywords = {k: v for k, v in kw.items() if k not in ("x", "gamma")}

            def rms(impl=impl, arrays=arrays, keywords=keywords):
                return impl.rms_norm_fp8(arrays["x"], arrays["gamma"], **keywords)

            def add(impl=impl, arrays=arrays, keywords=keywords):
                x = arrays["x"]
                return impl.add_rms_norm_fp8(x, x, arrays["gamma"], **keywords)

            yield f"{impl_name}-rms-bad{i}", _expecting(rms, error, match)
            yield f"{impl_name}-add-bad{i}", _expecting(add, error, match)
            if impl is fp8norm:

                def jitted(f=rms):
                    return jax.jit(lambda: f())()

                yield f"{impl_name}-jit-rms-bad{i}", _expecting(jitted, error, match)
        for i, (residual, error, match) in enumerate(bad_residuals):

            def call(impl=impl, residual=residual):
                return impl.add_rms_norm_fp8(X, residual, GAMMA)

            yield f"{impl_name}-residual{i}", _expecting(call, error, match)
    yield (
        "allreduce-unbound-axis",
        _expecting(
            lambda: fp8norm.allreduce_residual_rms_norm_fp8(X, X, GAMMA, axis_name="tp"),
            ValueError,
            "axis_name 'tp' is not bound",
        ),
    )


def handler_cases(platform):
    device = device_of(platform)
    target = handler_target(platform, "rms_norm_fp8")
    for i, (outs, args, kw, match) in enumerate(HANDLER_CASES):

        def call(outs=outs, args=args, kw=kw):
            with jax.default_device(device):
                placed = [jax.device_put(a, device) for a in args]
                return ffi_call(target, outs, *placed, **kw)

        yield f"{platform}-handler{i}", _expecting(call, Exception, match)


def shape_cases(platform):
    dtypes = (jnp.bfloat16, jnp.float16, jnp.float32)
    for i, hidden in enumerate(AWKWARD_HIDDEN):
        dtype = dtypes[i % len(dtypes)]
        for rows in (0, 1, 3):

            def check(hidden=hidden, rows=rows, dtype=dtype):
                x = random_rows(hidden + rows, (rows, hidden), dtype)
                residual = random_rows(hidden + 7, (rows, hidden), dtype)
                gamma = random_gamma(rows, hidden, jnp.float32)
                with kernels_of(platform):
                    check_against_reference(platform, "rms_norm_fp8", x, gamma)
                    check_against_reference(platform, "add_rms_norm_fp8", x, residual, gamma)

            yield f"{platform}-shape-{rows}x{hidden}-{jnp.dtype(dtype).name}", check


def platforms():
    found = ["cpu", *SIMT_PLATFORMS]
    try:
        if jax.devices("gpu"):
            found.append("gpu")
    except RuntimeError:
        pass
    return found


def main() -> int:
    cases = list(bad_input_cases())
    for platform in platforms():
        cases += list(handler_cases(platform))
        cases += list(shape_cases(platform))
    failures = 0
    for name, case in cases:
        print(f"START {name}", flush=True)
        try:
            case()
        except Exception:
            failures += 1
            why = traceback.format_exc(limit=3).strip().splitlines()[-1]
            print(f"FAIL {name}: {why}", flush=True)
        else:
            print(f"PASS {name}", flush=True)
    print(f"DONE {len(cases)}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
