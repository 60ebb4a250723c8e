"""allreduce_residual_rms_norm_fp8's method= selection (jax_fp8norm._allreduce): where each
method runs and auto's choice, as plain logic. tests/test_allreduce_xla.py and
tests/test_allreduce_one_kernel.py run the methods."""

from __future__ import annotations

import pytest

from jax_fp8norm import _allreduce

HERE = dict(platform="cpu", emulating=True, cuda_built=False, processes=1, num_devices=4)


def select(method, payload_bytes=1024, **changes):
    return _allreduce.select(method, payload_bytes=payload_bytes, **{**HERE, **changes})


def test_explicit_methods_run_where_they_can():
    for method in ("xla", "one_shot", "two_shot"):
        assert select(method) == method
    assert select("one_shot", platform="cuda", emulating=False, cuda_built=True) == "one_shot"
    assert select("xla", platform="cpu", emulating=False) == "xla"


@pytest.mark.parametrize(
    "changes,why",
    [
        (dict(emulating=False), "only under the SIMT emulation"),
        (dict(processes=2), "several processes"),
        (dict(num_devices=16), "at most 8"),
        (dict(platform="cuda", emulating=False, cuda_built=False), "no CUDA kernels"),
        (dict(platform="rocm"), "'rocm' backend"),
    ],
)
def test_explicit_one_kernel_methods_say_why_they_cannot_run(changes, why):
    for method in ("one_shot", "two_shot"):
        with pytest.raises(ValueError, match=why):
            select(method, **changes)
        assert select("auto", **changes) == "xla"


def test_auto_follows_the_table_on_emulated_devices_and_stays_xla_on_gpus():
    for n, one_shot_max in _allreduce.AUTO_ONE_SHOT_MAX.items():
        if one_shot_max is None:
            assert select("auto", 1 << 40, num_devices=n) == "one_shot"
            continue
        assert select("auto", one_shot_max, num_devices=n) == "one_shot"
        assert select("auto", one_shot_max + 1, num_devices=n) == "two_shot"
    assert select("auto", num_devices=3) == select("auto", num_devices=4)
    assert select("auto", num_devices=1) == "xla"
    on_gpus = dict(platform="cuda", emulating=False, cuda_built=True)
    assert not _allreduce.AUTO_ON_GPUS
    assert select("auto", **on_gpus) == "xla"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_auto_never_turns_to_xla_by_size(n):
    # XLA's all-reduce gives other bits than the one-kernel methods (a 16-bit sum), so
    # where those can run auto keeps to them at every size; where they cannot, auto is
    # "xla" at every size (docs/spec.md, "Invariance").
    sizes = [0, 1, 64 * 1024, 1 << 20, 8 << 20, 64 << 20, 1 << 40]
    assert "xla" not in {select("auto", size, num_devices=n) for size in sizes}
    elsewhere = dict(platform="cpu", emulating=False)
    assert {select("auto", size, num_devices=n, **elsewhere) for size in sizes} == {"xla"}


def test_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        select("nccl")
    with pytest.raises(ValueError, match="method must be one of"):
        select(None)
