"""The MaxText-style decoder block (jax_fp8norm/examples/maxtext_block.py): the fused
norm's codes, fed to qwix's dot_general, against MaxText's own arithmetic under qwix's
QtProvider, for each of MaxText's activation quantisations. Extended tier; needs qwix and
flax (tests/requirements-frameworks.txt)."""

from __future__ import annotations

import pytest
from helpers import EXTENDED

pytestmark = EXTENDED

# The projections' difference less the projection of the codes' difference: the outputs'
# bfloat16 roundings, ours once (the cast of the float32 GEMM) and MaxText's three times
# (its bfloat16 GEMM, then each scale), at most 2^-8 relative each.
OUTPUT_ROUNDINGS = 4 * 2.0**-8


@pytest.mark.parametrize("scheme", ["per_token", "tile_128", "fixed_scale"])
def test_the_codes_agree_but_for_maxtexts_bfloat16_rounding(scheme):
    pytest.importorskip("qwix")
    pytest.importorskip("flax")
    from jax_fp8norm.examples import maxtext_block

    result = maxtext_block.main(scheme)
    assert result["recipe"] == maxtext_block.SCHEMES[scheme][0]
    for part, projections in (
        ("attention_in", ("query", "key", "value")),
        ("mlp_in", ("wi_0", "wi_1")),
    ):
        numbers = {key.split(".", 1)[1]: v for key, v in result.items() if key.startswith(part)}
        # The replay of MaxText's quantisation is what its intercepted dot_general ran.
        assert numbers["replay_is_maxtext"]
        # The scales: MaxText's bfloat16 amax / 448 (four roundings), or its fixed scale.
        assert numbers["scale_relative_difference"] <= 4 * 2.0**-8
        if scheme == "fixed_scale":
            assert numbers["same_scale"]
            # The amax returned beside the static scale is MaxText's but for its roundings
            # of the normalised value, the weight and their product.
            assert numbers["observed_amax_relative_difference"] <= 3 * 2.0**-8
        # Most codes are identical; every one that is not is explained by the rounding to
        # bfloat16 (neighbouring codes, the rounding boundary within it of the exact value).
        assert 0.9 < numbers["identical_codes"] < 1
        assert numbers["differing_explained"] == numbers["differing_codes"] > 0
        # The projections differ by the projection of the codes' difference.
        assert numbers["difference_beyond_the_codes"] <= OUTPUT_ROUNDINGS
        for name in projections:
            assert (
                0
                < numbers[f"{name}_relative_difference"]
                < 2 * numbers["activation_relative_difference"]
            )
    assert 0 < result["output_relative_difference"] < 0.02
