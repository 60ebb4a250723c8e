"""The README's examples, run as a user pastes them: each ```python block of its
"## Example", "## Recipes" and "## Training" sections, in order, in one namespace (a later
block uses what an earlier one made), each block's results held to what its comments say
(shapes and dtypes), so that an example that no longer runs, or no longer gives what the
README says, fails here. The same for docs/recipes.md, whose blocks feed the recipes'
outputs to the FP8 / FP4 matmul. The set-up commands are run by CI from
.ci/readme_commands.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RECIPES_DOC = ROOT / "docs" / "recipes.md"

# What each block of the README makes, as its comments say, section by section, block by
# block: name -> (shape, dtype).
README_RESULTS = {
    "Example": [
        {
            "y": ((8, 4096), "float8_e4m3fn"),
            "scales": ((8, 1), "float32"),
            "approx": ((8, 4096), "float32"),
            "residual_out": ((8, 4096), "bfloat16"),
        },
    ],
    "Recipes": [
        {
            "approx": ((8, 4096), "float32"),
            "y": ((8, 4096), "float8_e4m3fn"),
            "scales": ((8, 1), "float32"),
            "y4": ((8, 4096), "float4_e2m1fn"),
            "scales4": ((8, 256), "float8_e4m3fn"),
            "approx4": ((8, 4096), "float32"),
        },
    ],
    "Training": [
        # The layer's: 4096 x 1024 master weights, its gradient jitted.
        {
            "dx": ((64, 4096), "bfloat16"),
            "dgamma": ((4096,), "float32"),
            "dw": ((4096, 1024), "float32"),
        },
        {
            "y": ((64, 4096), "float8_e4m3fn"),
            "scales": ((64, 128), "float8_e8m0fnu"),
            "y_t": ((4096, 64), "float8_e4m3fn"),
            "scales_t": ((4096, 2), "float8_e8m0fnu"),
            "dx": ((64, 4096), "bfloat16"),
            "dgamma": ((4096,), "float32"),
        },
        # The NVFP4 layer with its key, and the unquantised one.
        {
            "dx": ((64, 4096), "bfloat16"),
            "dgamma": ((4096,), "float32"),
            "dw": ((4096, 1024), "float32"),
            "head": ((64, 1024), "bfloat16"),
        },
    ],
    "In your model": [
        {
            "h": ((64, 4096), "bfloat16"),
            "y": ((64, 4096), "float8_e4m3fn"),
            "scales": ((64, 128), "float8_e8m0fnu"),
        },
        {"q_norm": ((2, 16, 8, 128), "bfloat16")},
    ],
}

# docs/recipes.md's blocks: block-scaled, MXFP8 with its matmul, a static scale, NVFP4
# with its matmul.
RECIPES_DOC_RESULTS = [
    {
        "y": ((8, 7168), "float8_e4m3fn"),
        "scales": ((8, 56), "float32"),
        "approx": ((8, 7168), "float32"),
    },
    {"scales": ((8, 224), "float8_e8m0fnu"), "out": ((8, 2048), "bfloat16")},
    {"y": ((8, 7168), "float8_e4m3fn"), "scales": ((8, 1), "float32")},
    {
        "y": ((8, 4096), "float4_e2m1fn"),
        "scales": ((8, 256), "float8_e4m3fn"),
        "approx": ((8, 4096), "float32"),
        "w_scales": ((256, 1024), "float8_e4m3fn"),
        "w_gs": ((), "float32"),
        "out": ((8, 1024), "bfloat16"),
    },
]


def python_blocks(text: str, section: str | None = None) -> list[str]:
    """The ```python blocks of ``text``'s "## <section>" (its ### subsections included),
    or of the whole text, in order."""
    if section is not None:
        found = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        assert found is not None, f"no '## {section}' section"
        text = found.group(1)
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_blocks_are_found():
    text = "## Training\n\n```python\na = 1\n```\n\n### Sub\n\n```python\nb = a\n```\n\n## Next\n"
    text += "```python\nc = 3\n```\n"
    assert python_blocks(text, "Training") == ["a = 1\n", "b = a\n"]
    assert python_blocks(text) == ["a = 1\n", "b = a\n", "c = 3\n"]


def test_every_readme_example_is_run():
    """No ```python block of the README outside the sections the examples' test runs."""
    readme = README.read_text()
    run = sum(len(python_blocks(readme, section)) for section in README_RESULTS)
    assert run == len(python_blocks(readme)), "a README python block no test runs"


def _run(blocks: list[str], results: list[dict], where: str, namespace: dict) -> None:
    assert len(blocks) == len(results), f"{where}: a block without its results, or gone"
    for i, (block, expected) in enumerate(zip(blocks, results, strict=True)):
        exec(compile(block, f"{where}, python block {i}", "exec"), namespace)
        for name, (shape, dtype) in expected.items():
            value = np.asarray(namespace[name])
            assert (value.shape, str(value.dtype)) == (shape, dtype), (where, i, name)
            assert np.all(np.isfinite(value.astype(np.float32))), (where, i, name)


def test_the_readme_examples_run():
    readme = README.read_text()
    namespace: dict = {}
    for section, results in README_RESULTS.items():
        _run(python_blocks(readme, section), results, f"README.md, '## {section}'", namespace)


@pytest.mark.parametrize("doc", [RECIPES_DOC], ids=["recipes"])
def test_the_docs_examples_run(doc):
    _run(python_blocks(doc.read_text()), RECIPES_DOC_RESULTS, str(doc.relative_to(ROOT)), {})
