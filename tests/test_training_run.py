"""The training example (python -m jax_fp8norm.examples.train): a small decoder trained
per recipe and in bfloat16, each recipe's final loss within its margin of bfloat16's.
The default tier runs a few steps of NVFP4; the extended tier every recipe."""

from __future__ import annotations

import io

import numpy as np
import pytest

from jax_fp8norm.examples import train


def _check(results, recipes, config):
    for name in [train.BASELINE, *recipes]:
        losses = results[name]["losses"]
        assert losses.shape == (config.steps,) and np.all(np.isfinite(losses)), name
        # It learns: the loss falls well below its start.
        assert results[name]["final"] < losses[0] - 0.5, (name, losses[0], losses[-1])
    assert 0 < results["entropy"] < np.log(config.vocab)
    table, ok = train.report(results, recipes, config)
    assert ok, table
    assert table.count("| yes |") == len(recipes)


@pytest.mark.long_running
def test_the_run_learns_and_meets_its_margins(tmp_path):
    config = train.Config(steps=30, batch=8, seq=32, warmup=10)
    recipes = ["nvfp4"]
    results = train.run(config, recipes, out=io.StringIO())
    _check(results, recipes, config)
    # The same seed, data and steps: the baseline is not a recipe in disguise.
    assert not np.array_equal(results["nvfp4"]["losses"], results[train.BASELINE]["losses"])
    pytest.importorskip("matplotlib")
    png = tmp_path / "losses.png"
    train.figure(results, recipes, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.extended
@pytest.mark.long_running
def test_every_recipe_trains_within_its_margin():
    config = train.Config(steps=120, batch=8)
    recipes = list(train.fp8norm.RECIPES)
    results = train.run(config, recipes, out=io.StringIO())
    _check(results, recipes, config)


def test_main_refuses_an_unknown_recipe(capsys):
    with pytest.raises(SystemExit):
        train.main(["--recipes", "fp7"])
    assert "unknown recipes" in capsys.readouterr().err


def test_the_margins_fail_a_worse_run():
    """report() says NO when a recipe's final loss is past its margin."""
    config = train.Config(steps=10)
    base = np.linspace(5, 3, 10)
    results = {
        train.BASELINE: {"losses": base, "final": 3.0},
        "mxfp8": {"losses": base, "final": 3.0 * 1.04},
        "entropy": 2.0,
    }
    table, ok = train.report(results, ["mxfp8"], config)
    assert not ok and "| NO |" in table
