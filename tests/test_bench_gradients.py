"""The gradient-fidelity report (python -m jax_fp8norm.bench.gradients) on a short run:
its rows, table and JSON, and its substance both ways: stochastic rounding's mean over
keys approaches the gradient of the unrounded output gradient (its bias ratio falls
toward 1 / sqrt(keys), and below round-to-nearest's bias), which a round-to-nearest
"stochastic" rounding would fail."""

from __future__ import annotations

import json
import math

import pytest

from jax_fp8norm.bench import gradients
from jax_fp8norm.examples import train

SMALL = train.Config(batch=2, seq=32, steps=1)


@pytest.fixture
def trained_once(monkeypatch):
    """The short run's training, once for the module's tests."""
    if not _TRAINED:
        _TRAINED.update(gradients.captured_steps(SMALL, [0]))
    monkeypatch.setattr(gradients, "captured_steps", lambda config, steps: _TRAINED)


_TRAINED: dict = {}


def _rows(result, **match):
    return [r for r in result["rows"] if all(r[k] == v for k, v in match.items())]


def _check_structure(result, config, sites, recipes, parts, keys):
    steps = sorted({0, config.steps - 1})
    measured = {(r["recipe"], r["parts"], r["site"], r["step"]) for r in result["rows"]}
    skipped = {(s["recipe"], s["parts"], s["site"], s["step"]) for s in result["skipped"]}
    every = {(r, p, s, t) for r in recipes for p in parts for s in sites for t in steps}
    assert measured | skipped == every and not measured & skipped
    assert all(gradients.PARTS[s[1]][1] for s in skipped)  # only the transform waits
    if gradients.hadamard_ready():
        assert not skipped
    for combination in measured:
        rows = _rows(
            result, **dict(zip(("recipe", "parts", "site", "step"), combination, strict=True))
        )
        assert [r["tensor"] for r in rows] == list(gradients.TENSORS)
        random = gradients.PARTS[combination[1]][0]
        for row in rows:
            assert math.isfinite(row["rel_error"]) and row["rel_error"] > 0, row
            assert math.isfinite(row["bias_rel"]) and row["bias_rel"] > 0, row
            assert row["keys"] == (keys if random else 1)
            assert (row["bias_ratio"] is None) == (not random)
    lines = gradients.table(result).splitlines()
    assert len(lines) == 2 + len(result["rows"])
    assert "1 (no randomness)" in gradients.table(result)
    assert json.loads(json.dumps(result))["rows"] == result["rows"]


def _check_substance(result, keys):
    """SR's mean over keys (with or without the other parts): within a few times 1 /
    sqrt(keys) of one draw's error from the unrounded gradient, and nearer to it than
    round-to-nearest's gradient."""
    random = [r for r in result["rows"] if gradients.PARTS[r["parts"]][0]]
    assert random
    for sr in random:
        rtn = _rows(result, **{k: sr[k] for k in ("recipe", "site", "step", "tensor")}, parts="rtn")
        assert len(rtn) == 1
        if sr["tensor"] in ("dx", "dw"):
            assert sr["bias_ratio"] < 0.6, sr
            assert sr["bias_ratio"] < 2.4 / math.sqrt(keys), sr
            assert sr["bias_rel"] < 0.7 * rtn[0]["bias_rel"], (sr, rtn)


def test_report_small_run(trained_once):
    keys = 16
    sites, recipes, parts = ("head",), ("nvfp4",), ("rtn", "sr", "sr+hadamard")
    result = gradients.report(SMALL, keys, sites, recipes, parts, log=lambda *_: None)
    _check_structure(result, SMALL, sites, recipes, parts, keys)
    _check_substance(result, keys)


def test_report_fails_for_round_to_nearest_sr(monkeypatch, trained_once):
    """The substance check catches an SR that rounds to nearest: every draw the same."""
    call = gradients._call
    monkeypatch.setattr(
        gradients, "_call", lambda recipe, parts, *a: call(recipe, (False, *parts[1:]), *a)
    )
    gradients._measure.clear_cache()
    try:
        result = gradients.report(
            SMALL, 4, ("head",), ("nvfp4",), ("rtn", "sr"), log=lambda *_: None
        )
    finally:
        gradients._measure.clear_cache()
    with pytest.raises(AssertionError):
        _check_substance(result, 4)


def test_cli_rejects_unknown_names():
    for argv in (["--sites", "up9"], ["--recipes", "mxfp8"], ["--keys", "1"]):
        with pytest.raises(SystemExit):
            gradients.main(argv)


@pytest.mark.extended
def test_report_every_part(tmp_path):
    config = train.Config(batch=2, seq=32, steps=3)
    keys, sites = 16, ("up0", "head")
    recipes, parts = gradients.FP4_RECIPES, tuple(gradients.PARTS)
    result = gradients.report(config, keys, sites, recipes, parts, log=lambda *_: None)
    _check_structure(result, config, sites, recipes, parts, keys)
    _check_substance(result, keys)
