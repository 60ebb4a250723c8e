"""One layer's training step (forward and backward) three ways, calls interleaved:

- ``fused``: :func:`jax_fp8norm.rms_norm_dense` under the recipe (the fused norm with its
  columnwise codes, the weight quantised along each GEMM's contraction axis, the output
  gradient quantised for dgrad and wgrad, the fused norm backward);
- ``by_hand``: the same layer as a JAX user writes it without the package: the RMSNorm
  formula, ``n`` and ``w`` fake-quantised by the textbook formula with the recipe's
  blocks (the straight-through ``v + stop_gradient(deq(q(v)) - v)``), the matmul of the
  dequantised operands, the backward by jax's autodiff (float32 GEMMs, the gradient not
  quantised);
- ``bfloat16``: the unquantised layer in bfloat16, for scale.

Each round calls every entry once; the report gives each entry's minimum and median wall
time per step (``jax.value_and_grad`` of ``sum(out * g)``, jitted, dispatch included).

    python -m jax_fp8norm.bench.layer [--rows 1024] [--hidden 1024] [--features 2048]
                                       [--rounds 10] [--recipes mxfp8,nvfp4]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jax_fp8norm as fp8norm
from jax_fp8norm._params import NORM_KEYWORDS
from jax_fp8norm.bench.implementations import formula_quantize
from jax_fp8norm.bench.timing import blocking, interleaved_seconds
from jax_fp8norm.recipes import recipe_keywords

DEFAULT_RECIPES = ("mxfp8", "nvfp4")
# The recipes with dynamic scales: the textbook formula has no calibrated one.
RECIPES = tuple(name for name, recipe in fp8norm.RECIPES.items() if not recipe.static)


def _fake_quantized(v, layout):
    """``v`` through the recipe's codes along its last axis, gradient straight through."""
    group = layout["group_size"]
    y, scales = formula_quantize(
        v, group, layout["out_dtype"], layout["scale_dtype"], layout["power_of_two_scales"]
    )
    scales = scales.astype(jnp.float32)[..., None]
    grouped = y.astype(jnp.float32).reshape(*v.shape[:-1], -1, group or v.shape[-1])
    deq = (grouped * scales).reshape(v.shape)
    return v + jax.lax.stop_gradient(deq - v)


def by_hand_layer(recipe: str):
    """The layer a user writes by hand under ``recipe``: ``(x, gamma, w) -> out``."""
    defaults = {name: default for name, (default, _) in NORM_KEYWORDS.items()}
    layout = {**defaults, **recipe_keywords(recipe)}

    def layer(x, gamma, w):
        n = _fake_quantized(fp8norm.reference.textbook_rms_norm(x, gamma), layout)
        wq = _fake_quantized(w.T, layout).T  # blocks along K, the contraction axis
        out = jnp.dot(n, wq, preferred_element_type=jnp.float32)
        return out.astype(x.dtype)

    return layer


def fused_layer(recipe: str):
    # An FP4 layer's gradient is rounded stochastically with the caller's key: a fixed one
    # here, which costs what a fresh one each step does.
    key = {"key": jax.random.key(0)} if fp8norm.RECIPES[recipe].fp4 else {}
    return lambda x, gamma, w: fp8norm.rms_norm_dense(x, gamma, w, recipe=recipe, **key)


def bfloat16_layer(x, gamma, w):
    return fp8norm.reference.unquantized_rms_norm_dense(x.astype(jnp.bfloat16), gamma, w)


def training_step(layer):
    """The jitted value and gradients of ``sum(layer(x, gamma, w) * g)``."""

    def loss(x, gamma, w, g):
        return jnp.sum(layer(x, gamma, w).astype(jnp.float32) * g)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES))
    args = parser.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; known (dynamic scales): {', '.join(RECIPES)}")
    key = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(key[0], (args.rows, args.hidden), jnp.bfloat16)
    gamma = 1 + 0.1 * jax.random.normal(key[1], (args.hidden,))
    w = jax.random.normal(key[2], (args.hidden, args.features)) / args.hidden**0.5
    g = jax.random.normal(key[3], (args.rows, args.features))
    calls = {"bfloat16": blocking(training_step(bfloat16_layer), x, gamma, w, g)}
    for recipe in recipes:
        calls[f"{recipe} fused"] = blocking(training_step(fused_layer(recipe)), x, gamma, w, g)
        calls[f"{recipe} by_hand"] = blocking(training_step(by_hand_layer(recipe)), x, gamma, w, g)
    _, times = interleaved_seconds(calls, args.rounds)
    device = jax.devices()[0]
    print(
        f"one layer's training step, x bfloat16 {args.rows} x {args.hidden}, w float32 "
        f"{args.hidden} x {args.features}, on {device.platform} ({device.device_kind}); "
        f"{args.rounds} interleaved rounds"
    )
    print(f"{'entry':<24} {'min ms':>9} {'median ms':>10}")
    for name, seconds in times.items():
        print(f"{name:<24} {min(seconds) * 1e3:9.2f} {statistics.median(seconds) * 1e3:10.2f}")
    for recipe in recipes:
        fused, hand = min(times[f"{recipe} fused"]), min(times[f"{recipe} by_hand"])
        print(f"{recipe}: by_hand / fused = {hand / fused:.2f}x (minima)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
