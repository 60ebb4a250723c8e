"""The README's Training examples, run as a user pastes them: each ```python block of its
"## Training" section (the layer's subsection included), in order, in one namespace (a
later block uses what an earlier one made), each block's results held to what its
comments say (shapes and dtypes), so that an example that no longer runs, or no longer
gives what the README says, fails here. The set-up commands are run by CI from
.ci/readme_commands.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import TIERS

README = Path(__file__).resolve().parents[1] / "README.md"

# What each block of the section makes, as its comments say: name -> (shape, dtype).
TRAINING_RESULTS = [
    {
        "y": ((8, 4096), "float8_e4m3fn"),
        "scales": ((8, 128), "float8_e8m0fnu"),
        "inverse_rms": ((8, 1), "float32"),
        "dx": ((8, 4096), "bfloat16"),
        "dgamma": ((4096,), "float32"),
    },
    {"y_t": ((4096, 64), "float8_e4m3fn"), "scales_t": ((4096, 2), "float8_e8m0fnu")},
    # The layer's: 4096 x 1024 master weights, its gradient eagerly (seconds on 2 cores).
    {
        "dx": ((64, 4096), "bfloat16"),
        "dgamma": ((4096,), "float32"),
        "dw": ((4096, 1024), "float32"),
    },
]
DEFAULT_BLOCKS = 2  # the default tier's: the training forms, the backward, columnwise


def python_blocks(readme: str, section: str) -> list[str]:
    """The ```python blocks of the README's "## <section>" (its ### subsections
    included), in order."""
    found = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert found is not None, f"the README has no '## {section}' section"
    return re.findall(r"^```python\n(.*?)^```$", found.group(1), re.S | re.M)


def test_the_blocks_are_found():
    text = "## Training\n\n```python\na = 1\n```\n\n### Sub\n\n```python\nb = a\n```\n\n## Next\n"
    text += "```python\nc = 3\n```\n"
    assert python_blocks(text, "Training") == ["a = 1\n", "b = a\n"]


@pytest.mark.parametrize("tier", TIERS)
def test_the_readme_training_examples_run(tier):
    blocks = python_blocks(README.read_text(), "Training")
    assert len(blocks) == len(TRAINING_RESULTS), "a block without its results in TRAINING_RESULTS"
    count = DEFAULT_BLOCKS if tier == "default" else len(blocks)
    namespace: dict = {}
    for i, (block, results) in enumerate(zip(blocks[:count], TRAINING_RESULTS, strict=False)):
        exec(compile(block, f"README.md, '## Training', python block {i}", "exec"), namespace)
        for name, (shape, dtype) in results.items():
            value = np.asarray(namespace[name])
            assert (value.shape, str(value.dtype)) == (shape, dtype), (i, name)
            assert np.all(np.isfinite(value.astype(np.float32))), (i, name)
