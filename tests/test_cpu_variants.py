"""The CPU kernel's instruction-set variants (AVX2 + FMA + F16C, and the baseline) give
the same bits: every dtype combination, hidden sizes that leave a partial lane block,
rows of zeros, NaN, Inf, huge, tiny and subnormal values, and every scale layout; and so
does the standalone timing driver (benchmarks/cpu_kernel.cc) on rows split over threads."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TIERS, outputs_of_script, reference_on_cpu

import jax_fp8norm as fp8norm

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_fp8norm as fp8norm
    from jax_fp8norm import _training
    from jax_fp8norm._primitives import add_rms_norm_fp8_p
    from jax_fp8norm._checks import make_params
    jax.config.update("jax_platforms", "cpu")

    def inputs(hidden, dtype, seed):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((12, hidden)) * 10.0 ** rng.uniform(-3, 3, (12, 1))
        x[1] = 0.0
        x[2, hidden // 2] = np.nan
        x[3, 0] = np.inf
        x[4] *= 1e-38
        x[5] *= 3e37
        x[6, -1] = 1e4 * np.abs(x[6]).max()
        residual = rng.standard_normal((12, hidden))
        gamma = rng.uniform(-2, 2, hidden)
        return x.astype(dtype), residual.astype(dtype), gamma

    # The default tier: the widths of each lane tail and gamma in the input's dtype; the
    # extended tier: every width and every gamma dtype.
    full = os.environ["VARIANT_CASES"] == "extended"
    outs = {}
    dtypes = ("float32", "float16", "bfloat16")
    for hidden in (1, 15, 16, 17, 100, 4099) if full else (1, 17, 4099):
        for i, dtype in enumerate(dtypes):
            x, residual, gamma = inputs(hidden, dtype, hidden + i)
            for gamma_dtype in dtypes if full else (dtype,):
                for out_dtype in (jnp.float8_e4m3fn, jnp.float8_e4m3fnuz):
                    g = gamma.astype(gamma_dtype)
                    key = f"{hidden}-{dtype}-{gamma_dtype}-{jnp.dtype(out_dtype).name}"
                    y, s = fp8norm.rms_norm_fp8(x, g, out_dtype=out_dtype, weight_offset=0.5)
                    y2, s2, r2 = fp8norm.add_rms_norm_fp8(
                        x, residual, g, out_dtype=out_dtype, scale_dtype=jnp.bfloat16)
                    for name, v in (("y", y), ("s", s), ("y2", y2), ("s2", s2), ("r2", r2)):
                        outs[f"{key}-{name}"] = np.asarray(v).view(np.uint8)
            if dtype != "float32":
                # A float32 all-reduce's sum meeting a 16-bit residual stream.
                p = make_params(dtype, eps=1e-6, weight_offset=0.0, scale_ub=None,
                                out_dtype=jnp.float8_e4m3fn, scale_dtype=jnp.float32)
                h32 = x.astype(np.float32)
                y, s, r = add_rms_norm_fp8_p.bind(
                    h32, residual, gamma.astype(dtype), **p.as_dict())
                for name, v in (("y", y), ("s", s), ("r", r)):
                    outs[f"{hidden}-f32-with-{dtype}-{name}"] = np.asarray(v).view(np.uint8)
    # Scales per group (the compile-time sizes 32 and 128, and a run-time one), power-of-
    # two and e8m0, and a calibrated scale.
    for hidden, group in ((384, 32), (384, 128), (384, 3), (4096, 128)):
        x, residual, gamma = inputs(hidden, "bfloat16", hidden * 7 + group)
        for kw in (
            dict(group_size=group),
            dict(group_size=group, scale_dtype=jnp.float8_e8m0fnu),
            dict(group_size=group, power_of_two_scales=True, scale_dtype=jnp.bfloat16),
            dict(static_scale=0.03, scale_dtype=jnp.float16, return_amax=True),
        ):
            key = f"{hidden}-{group}-" + "-".join(f"{k}={v}" for k, v in kw.items())
            y, s, r, *amax = fp8norm.add_rms_norm_fp8(x, residual, gamma.astype(np.float32), **kw)
            for name, v in (("y", y), ("s", s), ("r", r), *(("amax", a) for a in amax)):
                outs[f"{key}-{name}"] = np.asarray(v).view(np.uint8)
    # FP4: NVFP4 (its AVX2 quotient against the baseline's two divisions) and MXFP4, at
    # the compile-time group sizes 16 and 32 and a run-time one, packed.
    for hidden, group in ((384, 16), (384, 32), (4096, 16), (96, 6)):
        x, residual, gamma = inputs(hidden, "bfloat16", hidden * 5 + group)
        for kw in (
            dict(scale_dtype=jnp.float8_e4m3fn, global_scale=0.0037),
            dict(scale_dtype=jnp.float8_e4m3fn),
            dict(scale_dtype=jnp.float8_e8m0fnu, scale_ub=2.0),
        ):
            key = f"fp4-{hidden}-{group}-" + "-".join(f"{k}={v}" for k, v in kw.items())
            y, s, r = fp8norm.add_rms_norm_fp8(
                x, residual, gamma.astype(np.float32), out_dtype=jnp.float4_e2m1fn,
                group_size=group, **kw)
            for name, v in (("y", y), ("s", s), ("r", r)):
                outs[f"{key}-{name}"] = np.asarray(v).view(np.uint8)
    # The backward: the exact sums' AVX2 float64 lanes against the baseline's int64 levels,
    # on rows with zeros, NaN, Inf, huge and tiny values, and columns that cancel.
    for hidden in (1, 17, 100, 4099) if full else (17, 4099):
        for i, dtype in enumerate(dtypes):
            x, residual, gamma = inputs(hidden, dtype, hidden * 3 + i)
            gamma = gamma.astype(np.float32)
            rng = np.random.default_rng(hidden + i)
            dn = (rng.standard_normal((12, hidden)) * 10.0 ** rng.uniform(-30, 30, (12, 1)))
            dn[7] = -dn[8]
            dn = dn.astype(np.float32)
            *_, r = _training.add_rms_norm_fp8_training(x, residual, gamma)
            outs_bwd = _training.add_rms_norm_backward(dn, dn.astype(dtype), x, residual, gamma, r)
            outs_bwd += _training.rms_norm_backward(
                dn.astype(dtype), x, gamma, r, weight_offset=1.0
            )
            # dgamma again over the finite rows alone (the NaN, Inf and overflowing rows
            # make every column NaN above).
            finite = np.isfinite(np.asarray(r)[:, 0]) & np.isfinite(x.astype("float32")).all(-1)
            assert finite.sum() >= 8
            outs_bwd += _training.rms_norm_backward(dn[finite], x[finite], gamma, r[finite])
            assert np.all(np.isfinite(outs_bwd[-1])), "dgamma of the finite rows"
            for k, v in enumerate(outs_bwd):
                outs[f"backward-{hidden}-{dtype}-{k}"] = np.asarray(v).view(np.uint8)
    # The backward over many tasks (25 of 170 rows), on finite rows whose sums cancel
    # (helpers.cancelling_batch): dgamma's accumulators merged across tasks.
    from helpers import cancelling_batch
    x, dn, gamma = cancelling_batch(60, 4096, 96)
    *_, r = _training.rms_norm_fp8_training(x, gamma)
    outs_bwd = _training.rms_norm_backward(dn, x, gamma, r, weight_offset=0.5)
    assert all(np.all(np.isfinite(np.asarray(v, np.float32))) for v in outs_bwd)
    for k, v in enumerate(outs_bwd):
        outs[f"backward-4096-{k}"] = np.asarray(v).view(np.uint8)
    # The columnwise outputs: codes with a multiplier per column on the AVX2 lanes, a first
    # block of rows that are not finite and blocks that are.
    for hidden in (384, 4096):
        x, residual, gamma = inputs(hidden, "bfloat16", hidden * 11)
        rest = np.random.default_rng(hidden).standard_normal((244, hidden)).astype(x.dtype)
        x = np.concatenate([x, rest])
        for kw in (
            dict(recipe="mxfp8"),
            dict(recipe="nvfp4", global_scale=0.0037),
            dict(recipe="mxfp4"),
            dict(recipe="fp8_group128", out_dtype=jnp.float8_e4m3fnuz),
            dict(recipe="fp8_static", static_scale=0.03, return_amax=True),
        ):
            key = f"columnwise-{hidden}-" + "-".join(f"{k}={v}" for k, v in kw.items())
            outs_cw = fp8norm.rms_norm_fp8(x, gamma.astype(np.float32), columnwise=True, **kw)
            for k, v in enumerate(outs_cw):
                outs[f"{key}-{k}"] = np.asarray(v).view(np.uint8)
    # Widths that end in the scalar tails (codes past the last 32, the transpose past the
    # last 16 columns).
    for hidden, kw in ((200, dict(group_size=8)), (200, dict(static_scale=0.03)),
                       (48, dict(recipe="nvfp4"))):
        x, residual, gamma = inputs(hidden, "bfloat16", hidden * 13)
        rest = np.random.default_rng(hidden).standard_normal((244, hidden)).astype(x.dtype)
        x = np.concatenate([x, rest])
        key = f"columnwise-{hidden}-" + "-".join(f"{k}={v}" for k, v in kw.items())
        outs_cw = fp8norm.rms_norm_fp8(x, gamma.astype(np.float32), columnwise=True, **kw)
        for k, v in enumerate(outs_cw):
            outs[f"{key}-{k}"] = np.asarray(v).view(np.uint8)
    outs["variant"] = np.frombuffer(fp8norm.cpu_kernel_variant().encode(), np.uint8)
    np.savez(sys.argv[1], **outs)
    """
)


def _run(tmp_path, name: str, isa: str, tier: str) -> dict:
    return outputs_of_script(
        SCRIPT, tmp_path / f"{name}.npz", FP8NORM_CPU_ISA=isa, VARIANT_CASES=tier
    )


@pytest.mark.long_running
@pytest.mark.parametrize("tier", TIERS)
def test_variants_give_the_same_bits(tmp_path, tier):
    default = _run(tmp_path, "default", "", tier)
    baseline = _run(tmp_path, "baseline", "baseline", tier)
    assert bytes(baseline.pop("variant")).decode() == "baseline"
    variant = bytes(default.pop("variant")).decode()
    assert variant in ("avx2", "baseline")
    assert default.keys() == baseline.keys()
    differ = [k for k in default if not np.array_equal(default[k], baseline[k])]
    assert not differ, f"{variant} and baseline differ in {differ[:5]}"


def test_variant_name():
    assert fp8norm.cpu_kernel_variant() in ("avx2", "baseline")


@pytest.mark.skipif(fp8norm.cpu_kernel_variant() != "avx2", reason="no AVX2 variant here")
def test_avx2_variant_matches_reference_on_ties():
    # Values on FP8 rounding ties after normalisation by an exact power of two.
    codes = np.arange(0, 0x7F, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    x = np.concatenate([codes, -codes, [448.0]]).astype(np.float32)[None, :]
    gamma = np.ones(x.shape[-1], np.float32)
    y, s = fp8norm.rms_norm_fp8(x, gamma)
    y_ref, s_ref = reference_on_cpu(fp8norm.reference.rms_norm_fp8, x, gamma)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), np.asarray(y_ref).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long_running
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_timing_driver_variants_agree(tmp_path):
    # The driver links the kernel's own source: it must build, and its output hash must
    # not depend on the variant, on tasks split over 2 threads with rows and hidden sizes
    # that leave partial blocks, groups and residuals. Built at -O1, the quickest to build
    # here; under these float flags every level gives the same bits.
    exe = tmp_path / "cpu_kernel"
    subprocess.run(
        ["c++", "-std=c++17", "-O1", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off", f"-I{ROOT / 'src' / 'common'}",
         str(ROOT / "benchmarks" / "cpu_kernel.cc"), str(ROOT / "src" / "cpu" / "cpu_kernels.cc"),
         "-o", str(exe), "-lpthread"],
        check=True,
    )  # fmt: skip
    cases = [
        ["100", "4099", "bf16", "2", "1", "0", "1"],
        ["37", "384", "f16", "2", "0", "128", "1"],
        ["70", "4096", "f32", "2", "1", "32", "1"],
        ["33", "4096", "bf16", "2", "1", "16", "1", "nvfp4"],
        ["33", "2880", "f16", "2", "0", "32", "1", "mxfp4"],
    ]
    for case in cases:
        lines = {}
        for isa in ("", "baseline"):
            env = dict(os.environ, FP8NORM_CPU_ISA=isa)
            run = subprocess.run([str(exe), *case], env=env, capture_output=True, text=True)
            assert run.returncode == 0, run.stderr
            lines[isa] = run.stdout.split()
        assert lines["baseline"][0] == "baseline"
        # Built by the same compiler as the package, so with the same variants.
        assert lines[""][0] == fp8norm.cpu_kernel_variant()
        assert lines[""][-1] == lines["baseline"][-1], (case, lines)


HUGE_OUTPUTS = textwrap.dedent(
    """
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_fp8norm as fp8norm
    jax.config.update("jax_platforms", "cpu")
    rng = np.random.default_rng(5)
    # y of 6 MiB and residual_out of 12 MiB: outputs the kernel advises onto huge pages.
    x = jnp.asarray(rng.standard_normal((1536, 4096)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((1536, 4096)), jnp.bfloat16)
    gamma = jnp.asarray(rng.uniform(-2, 2, 4096), jnp.float32)
    y, s, r = jax.jit(fp8norm.add_rms_norm_fp8)(x, residual, gamma)
    ref = jax.jit(fp8norm.reference.add_rms_norm_fp8)(x, residual, gamma)
    same = all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        for a, b in zip((y, s, r), ref)
    )
    np.savez(sys.argv[1], y=np.asarray(y).view(np.uint8), s=np.asarray(s),
             r=np.asarray(r).view(np.uint16), same=np.array(same))
    """
)


@pytest.mark.extended
def test_huge_page_advice_keeps_the_bits(tmp_path):
    advised = outputs_of_script(HUGE_OUTPUTS, tmp_path / "advised.npz", FP8NORM_CPU_HUGE_PAGES="")
    plain = outputs_of_script(HUGE_OUTPUTS, tmp_path / "plain.npz", FP8NORM_CPU_HUGE_PAGES="0")
    assert advised.pop("same") and plain.pop("same")
    for name in advised:
        np.testing.assert_array_equal(advised[name], plain[name], err_msg=name)
