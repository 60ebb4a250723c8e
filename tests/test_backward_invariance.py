"""The backward's promise at scale (docs/spec.md, "Training: the backward pass"): dx of a row
and dgamma over the rows are the spec's exact sums, so they do not depend on the batch, the
row order, the CPU kernel's split into tasks, the thread count, the variant or the
platform. On finite data only, where a float32 sum in another order changes the bits:
each test checks that on its own data, so that none can pass by comparing NaN with NaN.
Non-finite rows have tests of their own (test_backward.py)."""

from __future__ import annotations

import os
import sys
import textwrap

import exact
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BACKWARD_PLATFORMS,
    cancelling_batch,
    outputs_of_script,
    random_rows,
    run_on,
    same_bits,
)

from jax_fp8norm import _training


def dgamma_terms(dn, x, r) -> np.ndarray:
    """dgamma's float32 terms, dn_j * u_j, flushed as the spec says."""
    u = exact.flushed(np.asarray(x, np.float32) * np.asarray(r, np.float32).reshape(-1, 1))
    return exact.flushed(exact.flushed(dn) * u)


def float32_column_sums(terms) -> tuple[np.ndarray, np.ndarray]:
    """Each column's terms summed in float32 one row after the other: in the rows' order
    and in the reverse order."""
    return (
        np.cumsum(terms, axis=0, dtype=np.float32)[-1],
        np.cumsum(terms[::-1], axis=0, dtype=np.float32)[-1],
    )


def assert_order_shows(terms, exact_sums) -> None:
    """The premise of every test here: on these terms a float32 sum in a fixed order misses
    the exact sum in most columns, and two orders disagree, so a test that compares bits
    can see an inexact or reordered sum."""
    forward, backward = float32_column_sums(terms)
    columns = terms.shape[1]
    assert np.all(np.isfinite(terms)) and np.all(np.isfinite(exact_sums))
    assert np.sum(forward != exact_sums) > columns // 2, "a float32 sum would pass"
    assert np.sum(backward != exact_sums) > columns // 2, "a float32 sum would pass"
    assert np.sum(forward != backward) > columns // 2, "the order would not show"


@BACKWARD_PLATFORMS
@pytest.mark.parametrize("add", [False, True], ids=["rms", "add"])
def test_dgamma_is_the_exact_sum_over_many_row_groups(platform, add):
    """4096 rows of 96: on the CPU 25 tasks of 170 rows (cpu_backward.cc's split), each
    with its own exact accumulators merged at the end; on CUDA 8 row groups per column
    block. dx, dresidual and dgamma against the oracle (tests/exact.py) bit for bit, where
    a float32 sum in either order misses dgamma in most columns; with a 16-bit residual
    and d_residual_out that are not zero."""
    rows, n = 4096, 96
    x, dn, gamma = cancelling_batch(1, rows, n)
    if add:
        residual = random_rows(2, (rows, n), "bfloat16", spread=1)
        # Of each row's dn's size, so that it shows in dx's bits beside a * r.
        scale = np.abs(dn).max(axis=1, keepdims=True)
        d_residual_out = (random_rows(3, (rows, n), "float32", spread=0) * scale).astype(x.dtype)
        *_, r = run_on(platform, _training.add_rms_norm_fp8_training, x, residual, gamma)
        dx, dresidual, dgamma = run_on(
            platform, _training.add_rms_norm_backward, dn, d_residual_out, x, residual, gamma, r
        )
        h = exact.flushed(x.astype(np.float32)) + exact.flushed(residual.astype(np.float32))
    else:
        *_, r = run_on(platform, _training.rms_norm_fp8_training, x, gamma)
        dx, dgamma = run_on(platform, _training.rms_norm_backward, dn, x, gamma, r)
        h = x.astype(np.float32)
    assert np.all(np.isfinite(r)) and np.all(np.isfinite(dx)) and np.all(np.isfinite(dgamma))
    want_dx, want_dgamma = exact.backward_rows(dn, h, gamma, r)
    assert_order_shows(dgamma_terms(dn, h, r), want_dgamma)
    same_bits(dgamma, want_dgamma, "dgamma")
    if add:
        dh = exact.flushed(want_dx + exact.flushed(d_residual_out.astype(np.float32)))
        same_bits(dx, dh.astype(jnp.bfloat16), "dx")
        same_bits(dresidual, dh.astype(jnp.bfloat16), "dresidual")
        # d_residual_out shows in the bits: a kernel that left it out would fail.
        assert np.mean(want_dx.astype(jnp.bfloat16) != dh.astype(jnp.bfloat16)) > 0.5
    else:
        same_bits(dx, want_dx.astype(jnp.bfloat16), "dx")


@BACKWARD_PLATFORMS
def test_backward_is_the_same_in_every_batch(platform):
    """The same rows in calls of 1, 255, 256 and 4096 rows give the same dx bits; dgamma over
    the same rows in another order gives the same bits, where a float32 sum of the same
    terms in the new order gives others (checked here)."""
    rows, n = 4096, 96
    x, dn, gamma = cancelling_batch(30, rows, n)
    *_, r = run_on(platform, _training.rms_norm_fp8_training, x, gamma)
    assert np.all(np.isfinite(r))
    full_dx, full_dgamma = run_on(platform, _training.rms_norm_backward, dn, x, gamma, r)
    assert np.all(np.isfinite(np.asarray(full_dx, np.float32))) and np.all(np.isfinite(full_dgamma))
    for size in (1, 255, 256):
        rows_ = slice(rows - size - 7, rows - 7)
        dx, _ = run_on(platform, _training.rms_norm_backward, dn[rows_], x[rows_], gamma, r[rows_])
        same_bits(dx, full_dx[rows_], f"dx of {size} rows")
    order = np.random.default_rng(33).permutation(rows)
    dx, dgamma = run_on(platform, _training.rms_norm_backward, dn[order], x[order], gamma, r[order])
    same_bits(dx, full_dx[order], "dx, rows permuted")
    same_bits(dgamma, full_dgamma, "dgamma, rows permuted")
    terms = dgamma_terms(dn, x, r)
    in_order = np.cumsum(terms, axis=0, dtype=np.float32)[-1]
    reordered = np.cumsum(terms[order], axis=0, dtype=np.float32)[-1]
    assert np.sum(in_order != reordered) > n // 2
    # And c, each row's sum that dx depends on: its float32 sum in the reverse order of the
    # columns changes many rows' c, so a sum that followed the batch's layout would show.
    u = exact.flushed(x.astype(np.float32) * r)
    c_terms = exact.flushed(exact.flushed(exact.flushed(dn) * gamma) * u)
    forward = np.cumsum(c_terms, axis=1, dtype=np.float32)[:, -1]
    backward = np.cumsum(c_terms[:, ::-1], axis=1, dtype=np.float32)[:, -1]
    assert np.all(np.isfinite(forward)) and np.mean(forward != backward) > 0.25


@pytest.mark.extended
@pytest.mark.parametrize("platform", ["cpu", "simt-block_shared"], indirect=True)
def test_past_a_grid_of_65535_rows(platform):
    """70000 rows: the CUDA rows' kernel strides its grid of 65535 blocks over the rest,
    the CPU splits them into 18 tasks of 4096 rows. dx and dgamma against the oracle, and dgamma the
    same with the rows permuted."""
    rows, n = 70000, 4
    x, dn, gamma = cancelling_batch(40, rows, n, "float32")
    *_, r = run_on(platform, _training.rms_norm_fp8_training, x, gamma)
    assert np.all(np.isfinite(r))
    dx, dgamma = run_on(platform, _training.rms_norm_backward, dn, x, gamma, r)
    want_dx, want_dgamma = exact.backward_rows(dn, x, gamma, r)
    assert_order_shows(dgamma_terms(dn, x, r), want_dgamma)
    same_bits(dgamma, want_dgamma, "dgamma")
    same_bits(dx, want_dx, "dx")
    order = np.random.default_rng(41).permutation(rows)
    _, permuted = run_on(
        platform, _training.rms_norm_backward, dn[order], x[order], gamma, r[order]
    )
    same_bits(permuted, want_dgamma, "dgamma, rows permuted")


SPLIT_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    from jax_fp8norm_kernels import _fp8norm_cpu
    from helpers import cancelling_batch
    import jax_fp8norm as fp8norm
    from jax_fp8norm import _training

    jax.config.update("jax_platforms", "cpu")
    x, dn, gamma = cancelling_batch(50, 4096, 96)
    residual = (x * 0.75).astype(x.dtype)
    *_, r = _training.add_rms_norm_fp8_training(x, residual, gamma)
    dx, dresidual, dgamma = _training.add_rms_norm_backward(
        dn, dn.astype(x.dtype), x, residual, gamma, r)
    np.savez(sys.argv[1], dx=np.asarray(dx).view(np.uint16), dgamma=np.asarray(dgamma),
             dresidual=np.asarray(dresidual).view(np.uint16), r=np.asarray(r),
             rows_per_task=_fp8norm_cpu.cpu_backward_rows_per_task(4096, 96))
    """
)


@pytest.mark.long_running
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FP8NORM_CPU_THREADS (Linux)")
def test_cpu_dgamma_is_the_same_for_every_split_and_thread_count(tmp_path):
    """The CPU backward on 1 and 2 threads and with the rows split into 25, 64 and 586
    tasks: the same bits, dgamma the oracle's, where merging the 64 tasks' exactly summed
    partials in float32 instead would change dgamma (checked here), so an inexact merge
    fails this test whatever the thread count."""
    runs = {
        (threads, split): outputs_of_script(
            SPLIT_SCRIPT,
            tmp_path / f"t{threads}-{split or 'shape'}.npz",
            FP8NORM_CPU_THREADS=threads,
            FP8NORM_CPU_BACKWARD_TASK_ROWS=split,
        )
        for threads, split in {
            ("1", ""),
            ("2", ""),
            (str(os.cpu_count() or 1), ""),
            ("2", "64"),
            ("1", "7"),
        }
    }
    for (_, split), result in runs.items():  # the split each run made
        assert int(result.pop("rows_per_task")) == int(split or 170), split
    first = runs[("1", "")]
    for key, result in runs.items():
        for name in first:
            np.testing.assert_array_equal(result[name], first[name], f"{key} {name}")
    x, dn, _ = cancelling_batch(50, 4096, 96)
    h = exact.flushed(x.astype(np.float32)) + exact.flushed(
        (x * 0.75).astype(x.dtype).astype(np.float32)
    )
    terms = dgamma_terms(dn, h, first["r"])
    want = np.array([exact.backward_sum(c) for c in terms.T], np.float32)
    same_bits(first["dgamma"], want, "dgamma")
    # 64 tasks of 64 rows, each column's partial the float32 nearest to its exact sum, then
    # the partials added in float32, in task order.
    partials = np.array(
        [[exact.backward_sum(c) for c in terms[t : t + 64].T] for t in range(0, 4096, 64)]
    )
    inexact = np.cumsum(partials, axis=0, dtype=np.float32)[-1]
    assert np.all(np.isfinite(inexact)) and np.sum(inexact != want) > 10
