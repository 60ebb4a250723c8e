"""The examples of a decoder block with the fused residual add in the frameworks users
come from (jax_fp8norm/examples): keras-hub's Llama, penzai's Llama-like transformer and a
Flax NNX block, each against the same model unfused. Extended tier; CI installs the
frameworks (tests/requirements-frameworks.txt)."""

from __future__ import annotations

import importlib

import pytest
from helpers import EXTENDED

pytestmark = EXTENDED

# Within FP8 rounding of the unfused model (e4m3 keeps 3 mantissa bits: about 3% per
# element at worst, less on average), and not equal to it: the fused, quantised path ran.
TOLERANCE = 0.05


@pytest.mark.parametrize(
    ("example", "framework"),
    [("keras_hub_llama", "keras_hub"), ("penzai_llama", "penzai"), ("nnx_decoder_block", "flax")],
)
def test_the_fused_block_stays_within_fp8_rounding_of_the_unfused_model(
    example, framework, monkeypatch
):
    monkeypatch.setenv("KERAS_BACKEND", "jax")  # read when keras is first imported
    pytest.importorskip(framework)
    module = importlib.import_module(f"jax_fp8norm.examples.{example}")
    result = module.main()
    error = result["relative_error"] if isinstance(result, dict) else result
    assert 0 < error < TOLERANCE
    if isinstance(result, dict):  # NNX: trained through the straight-through gradient
        assert result["scale_gradient_norm"] > 0
