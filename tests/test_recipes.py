"""The recipes (jax_fp8norm.recipes, every op's ``recipe=``) and the keyword table.

A recipe is exactly the keywords it sets, on every op, twin and platform; every keyword
it sets, given with another value, is refused naming both; and every keyword of the table
has an example run against the reference and a bad value refused by name (tests/cases.py),
besides the fuzz's draw of it (tests/test_fuzz.py)."""

from __future__ import annotations

import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import KEYWORD_CASES
from helpers import (
    FP8S,
    OUTS,
    RECIPE_NAMES,
    assert_same_bits,
    check_against_reference,
    layout,
    random_gamma,
    random_rows,
    recipe,
    run_on,
)

import jax_fp8norm as fp8norm
from jax_fp8norm._checks import validate
from jax_fp8norm._params import NORM_KEYWORDS
from jax_fp8norm.recipes import NEAREST, NVFP4, POWER_OF_TWO, RECIPES, recipe_of

README = Path(__file__).resolve().parents[1] / "README.md"
F4 = jnp.float4_e2m1fn
E4M3 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu

# Each recipe's layout, stated here apart from the table: (y's dtype, elements per scale
# (None: per row), the scales' dtype, power-of-two scales, a calibrated scale).
LAYOUTS = {
    "fp8_row": (E4M3, None, jnp.float32, False, False),
    "fp8_group128": (E4M3, 128, jnp.float32, False, False),
    "fp8_group128_ue8m0": (E4M3, 128, jnp.float32, True, False),
    "fp8_static": (E4M3, None, jnp.float32, False, True),
    "mxfp8": (E4M3, 32, E8M0, True, False),
    "nvfp4": (F4, 16, E4M3, False, False),
    "mxfp4": (F4, 32, E8M0, True, False),
}
HIDDEN = 256


def _inputs(rows=5, hidden=HIDDEN, dtype=jnp.bfloat16):
    return random_rows(rows, (rows, hidden), dtype), random_gamma(hidden, hidden, jnp.float32)


def test_the_table_is_the_documented_one():
    assert tuple(LAYOUTS) == RECIPE_NAMES
    assert "recipe" in inspect.signature(fp8norm.rms_norm_fp8).parameters
    readme = README.read_text()
    for name in RECIPES:
        assert f"`{name}`" in readme, f"README does not name the recipe {name}"


@pytest.mark.sampled(4)
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_a_recipe_is_the_keywords_it_sets(platform, name):
    x, gamma = _inputs()
    residual = random_rows(7, x.shape, x.dtype)
    out, _ = check_against_reference(platform, "rms_norm_fp8", x, gamma, **recipe(name))
    assert_same_bits(out, run_on(platform, fp8norm.rms_norm_fp8, x, gamma, **layout(name)))
    out_add, _ = check_against_reference(
        platform, "add_rms_norm_fp8", x, residual, gamma, **recipe(name)
    )
    spelled = run_on(platform, fp8norm.add_rms_norm_fp8, x, residual, gamma, **layout(name))
    assert_same_bits(out_add, spelled)
    y_dtype, group, scale_dtype, power_of_two, _ = LAYOUTS[name]
    y, scales = out
    assert y.dtype == np.dtype(y_dtype) and y.shape == x.shape
    assert scales.dtype == np.dtype(scale_dtype)
    assert scales.shape == (x.shape[0], 1 if group is None else HIDDEN // group)
    if power_of_two:
        mantissas, _ = np.frexp(scales.astype(np.float32))
        assert np.all(mantissas == 0.5), scales


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_every_entry_point_takes_a_recipe(name):
    x, gamma = _inputs()
    residual = random_rows(7, x.shape, x.dtype)
    for fn, args in (
        (fp8norm.rms_norm_fp8_dequantized, (x, gamma)),
        (fp8norm.add_rms_norm_fp8_dequantized, (x, residual, gamma)),
    ):
        with_recipe = run_on(
            "cpu", lambda *a, fn=fn: jax.tree.leaves(fn(*a, **recipe(name))), *args
        )
        spelled = run_on("cpu", lambda *a, fn=fn: jax.tree.leaves(fn(*a, **layout(name))), *args)
        assert_same_bits(with_recipe, spelled)
    # The all-reduce op, over a mesh of the one CPU device, and the Flax module.
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices("cpu")[:1])

    def allreduce(keywords):
        return fp8norm.sharded_allreduce_residual_rms_norm_fp8(
            x[None], residual, gamma, mesh=mesh, axis_name="tp", **keywords
        )

    def module(keywords):
        from jax_fp8norm.nnx import RMSNormFP8

        module = RMSNormFP8(HIDDEN, quantized_output=True, **keywords)
        return module(jnp.asarray(x), residual=jnp.asarray(residual))

    for fn in (allreduce, module):
        with_recipe = tuple(map(np.asarray, fn(recipe(name))))
        assert_same_bits(with_recipe, tuple(map(np.asarray, fn(layout(name)))))


def _contradicting(keyword: str, accepted: tuple):
    """A value of ``keyword`` that none of the recipe's ``accepted`` values is."""
    if keyword == "out_dtype":
        return next(t for t in OUTS if np.dtype(t) not in accepted)
    if keyword == "scale_dtype":
        return jnp.float32 if np.dtype(jnp.float32) not in accepted else E8M0
    if keyword == "group_size":
        return 64 if 64 not in accepted else 32
    if keyword == "power_of_two_scales":
        return not accepted[0]
    assert keyword == "static_scale", keyword
    return 0.5


CONTRADICTIONS = [
    (name, keyword)
    for name, entry in RECIPES.items()
    for keyword in entry.keywords
    if not (name == "fp8_static" and keyword == "static_scale")  # needed, not set
]


@pytest.mark.parametrize("name,keyword", CONTRADICTIONS)
def test_every_contradiction_is_refused_naming_both(name, keyword):
    x, gamma = _inputs()
    value = _contradicting(keyword, RECIPES[name].keywords[keyword])
    for impl in (fp8norm, fp8norm.reference):
        with pytest.raises(ValueError, match=rf"recipe='{name}' .*{keyword}"):
            impl.rms_norm_fp8(x, gamma, **recipe(name), **{keyword: value})


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_repeating_a_keyword_the_recipe_sets_is_accepted(name):
    x, gamma = _inputs()
    assert_same_bits(
        run_on("cpu", fp8norm.rms_norm_fp8, x, gamma, **{**recipe(name), **layout(name)}),
        run_on("cpu", fp8norm.rms_norm_fp8, x, gamma, **layout(name)),
    )


def test_the_fp8_recipes_take_either_e4m3_type():
    x, gamma = _inputs()
    for name in ("fp8_row", "fp8_group128", "fp8_group128_ue8m0", "fp8_static"):
        for fp8 in FP8S:
            y, _ = fp8norm.rms_norm_fp8(x, gamma, **recipe(name, out_dtype=fp8))
            assert y.dtype == np.dtype(fp8)


def test_a_missing_calibrated_scale_and_an_unknown_recipe_are_refused():
    x, gamma = _inputs()
    with pytest.raises(ValueError, match="recipe='fp8_static' needs static_scale"):
        fp8norm.rms_norm_fp8(x, gamma, recipe="fp8_static")
    for bad in ("MXFP8", "fp8", 8, jnp.float8_e4m3fn):
        with pytest.raises(ValueError, match="recipe must be None or one of"):
            fp8norm.rms_norm_fp8(x, gamma, recipe=bad)


def test_every_keyword_of_the_table_has_an_example_and_a_bad_value():
    # A keyword added to NORM_KEYWORDS fails this until tests/cases.py has both.
    assert set(KEYWORD_CASES) == set(NORM_KEYWORDS)


@pytest.mark.sampled(2)
@pytest.mark.parametrize("keyword", list(KEYWORD_CASES))
def test_each_keywords_example_and_bad_value(platform, keyword):
    example, bad, error, match = KEYWORD_CASES[keyword]
    assert keyword in example and keyword in bad
    x, gamma = _inputs()
    check_against_reference(platform, "rms_norm_fp8", x, gamma, **example)
    for impl in (fp8norm, fp8norm.reference):
        with pytest.raises(error, match=match):
            impl.rms_norm_fp8(x, gamma, **bad)


E5M2, E4M3 = np.dtype(jnp.float8_e5m2), np.dtype(jnp.float8_e4m3fn)
FP4 = np.dtype(jnp.float4_e2m1fn)


# docs/spec.md, "The layer": the weight's and the output gradient's formats per recipe
# (codes, block along the contraction axis, scale rule).
LAYER_FORMATS = {
    "fp8_row": ((E4M3, None, NEAREST), (E5M2, None, NEAREST)),
    "fp8_static": ((E4M3, None, NEAREST), (E5M2, None, NEAREST)),
    "fp8_group128": ((E4M3, 128, POWER_OF_TWO), (E5M2, 128, POWER_OF_TWO)),
    "fp8_group128_ue8m0": ((E4M3, 128, POWER_OF_TWO), (E5M2, 128, POWER_OF_TWO)),
    "mxfp8": ((E4M3, 32, POWER_OF_TWO), (E4M3, 32, POWER_OF_TWO)),
    "nvfp4": ((FP4, 16, NVFP4), (FP4, 16, NVFP4)),
    "mxfp4": ((FP4, 32, POWER_OF_TWO), (FP4, 32, POWER_OF_TWO)),
}


@pytest.mark.parametrize("name", RECIPES)
def test_a_calls_recipe_is_the_named_one(name):
    """A call's parameters read back as the recipe they came from, with every fact of it."""
    keywords = RECIPES[name].example()
    given = {"global_scale": 1.0} if name == "nvfp4" else {}
    if RECIPES[name].static:
        given["static_scale"] = keywords["static_scale"]
    params = validate(jnp.zeros((2, 256), jnp.float32), jnp.ones(256), recipe=name, **given).params
    recipe = recipe_of(params)
    assert recipe.name == name and recipe.base is RECIPES[name]
    assert recipe.block == (None if RECIPES[name].static else keywords["group_size"])
    assert recipe.columnwise == (name != "fp8_row")
    weight, gradient = LAYER_FORMATS[name]
    assert (recipe.weight.element, recipe.weight.block, recipe.weight.rule) == weight
    assert (recipe.gradient.element, recipe.gradient.block, recipe.gradient.rule) == gradient


@pytest.mark.parametrize(
    ("keywords", "family", "block"),
    [
        (dict(group_size=64), "fp8_group128", 64),
        (dict(group_size=64, power_of_two_scales=True), "fp8_group128_ue8m0", 64),
        (dict(group_size=64, scale_dtype=jnp.float8_e8m0fnu), "fp8_group128_ue8m0", 64),
        (dict(group_size=32, scale_dtype=jnp.float8_e8m0fnu), "mxfp8", 32),
        (dict(group_size=32, power_of_two_scales=True), "fp8_group128_ue8m0", 32),
        (dict(out_dtype=jnp.float4_e2m1fn, group_size=64, scale_dtype=jnp.float8_e8m0fnu),
         "mxfp4", 64),
        (dict(out_dtype=jnp.float8_e4m3fnuz, group_size=32, scale_dtype=jnp.float8_e8m0fnu),
         "mxfp8", 32),
    ],
)  # fmt: skip
def test_a_layout_without_a_name_joins_its_family(keywords, family, block):
    params = validate(jnp.zeros((2, 256), jnp.float32), jnp.ones(256), **keywords).params
    recipe = recipe_of(params)
    assert recipe.base is RECIPES[family] and recipe.block == block
    assert recipe.name == (
        family if block == RECIPES[family].block else f"{family} with group_size={block}"
    )
    assert recipe.weight.block == recipe.gradient.block == block
    assert recipe.weight.element == np.dtype(keywords.get("out_dtype", jnp.float8_e4m3fn))
    # The family's gradient codes (MXFP8's E4M3 beside e4m3fnuz codes too).
    assert recipe.gradient.element == LAYER_FORMATS[family][1][0]
    # The recipe's keywords are the call's layout again.
    again = validate(jnp.zeros((2, 256), jnp.float32), jnp.ones(256), **recipe.example()).params
    assert again == params
