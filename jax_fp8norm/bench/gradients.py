"""Gradient fidelity of FP4 training's parts, on the training run's own tensors.

The bfloat16 training run (:mod:`jax_fp8norm.examples.train`) is trained once and its
tensors kept at its first and last step; at each chosen norm site (its ``x``, residual,
``gamma``, ``w`` and the cotangent ``g`` of its output) the site's layer,
:func:`jax_fp8norm.rms_norm_dense` or :func:`jax_fp8norm.add_rms_norm_dense`, is
differentiated under each FP4 recipe and each combination of FP4 training's parts
(``PARTS``), and ``dx``, ``dgamma`` and ``dw`` are compared with two gradients:

- ``d_ref``, the unquantised layer's (:func:`jax_fp8norm.reference.
  unquantized_rms_norm_dense` on float32 copies of the operands): ``rel_error = ||d -
  d_ref|| / ||d_ref||`` for one key, what the whole quantisation costs;
- ``d_unrounded``, the same layer's gradient with the output gradient ``G`` not quantised
  (the forward's quantised ``X`` and ``W`` kept: ``dn = G Wq^T`` through the norm's
  backward, ``dW = Xq^T G``, with the transform where the parts have it), built from the
  twins. ``bias ratio = ||mean_K(d) - d_unrounded|| / rms_K ||d - d_unrounded||``: the
  error of the mean over ``K`` keys against one draw's (the root mean square over the
  draws, a steadier estimate of one draw's error than a single draw). An unbiased
  rounding of ``G`` gives about ``1 / sqrt(K)``; a biased one stays near 1. Without
  stochastic rounding nothing is random and the ratio is 1 by construction: the report
  says so instead of drawing ``K`` identical gradients. ``bias/|d| = ||mean_K(d) -
  d_unrounded|| / ||d_unrounded||``: what is left of the rounding's bias, relative to the
  gradient (one draw's error where there is no randomness).

``add_rms_norm_dense``'s second output (the residual sum) takes a zero cotangent: its
gradient passes the layer unquantised, and ``dresidual`` is ``dx``'s twin.

    python -m jax_fp8norm.bench.gradients [--steps 400] [--keys 64] [--sites up0 head]
                                          [--recipes nvfp4,mxfp4] [--json F]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jax_fp8norm as fp8norm
from jax_fp8norm import reference
from jax_fp8norm._fp4_parts import hadamard_rows
from jax_fp8norm.dense import _layer_keywords, training_parts
from jax_fp8norm.examples import train
from jax_fp8norm.quantize import quantize_columns, quantize_weight_tiles, tile_scales
from jax_fp8norm.recipes import RECIPES, dequantize

FP4_RECIPES = tuple(name for name, recipe in RECIPES.items() if recipe.fp4)
# The combinations of FP4 training's parts: (stochastic_rounding, hadamard, weight_tiles);
# "sr+tiles" beside the ablation's four measures the tiles where the transform is off.
PARTS = {
    "rtn": (False, False, False),
    "sr": (True, False, False),
    "sr+hadamard": (True, True, False),
    "sr+hadamard+tiles": (True, True, True),
    "sr+tiles": (True, False, True),
    "hadamard": (False, True, False),
    "tiles": (False, False, True),
}
TENSORS = ("dx", "dgamma", "dw")
DEFAULT_SITES = ("up0", "head")
HIGHEST = jax.lax.Precision.HIGHEST


def site_names(config: train.Config) -> tuple[str, ...]:
    """The run's norm sites in the order of :func:`jax_fp8norm.examples.train.site_tensors`:
    each block's attention projection (``qkv0``) and MLP up projection (``up0``), then
    the output head."""
    blocks = [(f"qkv{i}", f"up{i}") for i in range(config.layers)]
    return (*[name for pair in blocks for name in pair], "head")


def hadamard_ready() -> bool:
    """Whether the norm's columnwise codes take the transform, which the wgrad GEMM's
    other operand (the gradient's copy) needs too: until they do, the layer's ``dw``
    with the transform is not ``X^T G`` and the combinations with it are not measured."""
    return "hadamard" in inspect.signature(reference.rms_norm_fp8_training).parameters


def captured_steps(config: train.Config, steps: Sequence[int]) -> dict:
    """``{step: (params, batch, key)}`` of the bfloat16 run at ``steps``, as its training
    loop (:func:`jax_fp8norm.examples.train.run`'s data) sees them."""
    data = train.batches(config, train.language(config), min(config.steps, 200), config.seed)
    kept = {}

    def keep(step, params, batch, key):
        if step in steps:
            kept[step] = (params, batch, key)

    train.train(config, train.Run(train.BASELINE), data, keep=keep)
    return kept


def _call(recipe: str, parts: tuple, operands: dict, key=None):
    """The site's layer as a function of ``(x, gamma, w)``, and the cotangent of its
    outputs (the residual sum's zero)."""
    sr, hadamard, tiles = parts
    keywords = {
        "recipe": recipe,
        "stochastic_rounding": sr,
        "hadamard": hadamard,
        "weight_tiles": tiles,
        "key": key,
    }
    residual = operands["residual"]
    if residual is None:
        return functools.partial(fp8norm.rms_norm_dense, **keywords), None
    return (
        lambda x, gamma, w: fp8norm.add_rms_norm_dense(x, residual, gamma, w, **keywords),
        jnp.zeros(residual.shape, residual.dtype),
    )


def _vjp(layer, residual_cotangent, x, gamma, w, g):
    out, vjp = jax.vjp(layer, x, gamma, w)
    if residual_cotangent is None:
        cotangent = g.astype(out.dtype)
    else:
        cotangent = (g.astype(out[0].dtype), residual_cotangent)
    return tuple(d.astype(jnp.float32) for d in vjp(cotangent))


def layer_gradients(recipe: str, parts: tuple, operands: dict, key):
    """``(dx, dgamma, dw)`` float32 of the site's layer under ``recipe`` and ``parts``."""
    layer, zero = _call(recipe, parts, operands, key)
    o = operands
    return _vjp(layer, zero, o["x"], o["gamma"], o["w"], o["g"])


def reference_gradients(operands: dict):
    """``(dx, dgamma, dw)`` of the unquantised layer on float32 copies of the operands."""
    f32 = {k: None if v is None else jnp.asarray(v, jnp.float32) for k, v in operands.items()}
    residual = f32["residual"]
    if residual is None:
        layer, zero = reference.unquantized_rms_norm_dense, None
    else:
        zero = jnp.zeros_like(residual)

        def layer(x, gamma, w):
            return reference.unquantized_rms_norm_dense(x, gamma, w, residual)

    return _vjp(layer, zero, f32["x"], f32["gamma"], f32["w"], f32["g"])


def _dequantized_columns(codes, scales, global_scale):
    """float32 of a weight-like operand quantised along its rows (blocks of rows, or one
    scale per column), as :func:`jax_fp8norm.matmul.fp8_matmul` reads its ``w``."""
    scales = scales.astype(jnp.float32)
    scales = scales[None] if scales.ndim == 1 else scales
    out = codes.astype(jnp.float32) * jnp.repeat(scales, codes.shape[0] // scales.shape[0], 0)
    return out if global_scale is None else out * global_scale


def unrounded_gradients(recipe: str, parts: tuple, operands: dict):
    """``(dx, dgamma, dw)`` float32 of the layer with the output gradient ``G`` not
    quantised: the weight as the dgrad GEMM reads it (its 2-D tiles, or quantised along
    the output features), ``dn = G Wq^T`` through the norm's backward twin, and ``dW =
    Xq^T G`` with ``Xq`` the norm's columnwise codes (the transform on both operands
    where the parts have it, the result times ``1 / block``)."""
    spec = RECIPES[recipe]
    resolved = training_parts(spec, *parts)
    x, residual, gamma, w = (operands[k] for k in ("x", "residual", "gamma", "w"))
    k, f = w.shape
    rows = (-1, k)
    g = jnp.asarray(operands["g"], jnp.float32).reshape(-1, f)
    fmt = spec.weight
    if resolved.weight_tiles:
        codes, tiles, gs = quantize_weight_tiles(w, fmt)
        wq_t = _dequantized_columns(codes.T, tile_scales(tiles, fmt.block, f, transposed=True), gs)
    else:
        wq_t = _dequantized_columns(*quantize_columns(w.T, fmt))
    dn = jnp.matmul(g, wq_t, precision=HIGHEST)
    # The norm's keywords as the layer gives them (NVFP4: each row's global scale, and
    # each column's for the columnwise codes, which carry the transform's d).
    keywords = {**_layer_keywords({"recipe": recipe}), "columnwise": True}
    per_column = keywords.get("global_scale") is not None
    x32 = jnp.asarray(x, jnp.float32).reshape(rows)
    if residual is None:
        outs = reference.rms_norm_fp8_training(
            x.reshape(rows), gamma, hadamard=resolved.hadamard, **keywords
        )
        dx, dgamma = reference.backward(dn, x32, gamma, outs[2], 0.0)
    else:
        res = residual.reshape(rows)
        outs = reference.add_rms_norm_fp8_training(
            x.reshape(rows), res, gamma, hadamard=resolved.hadamard, **keywords
        )
        res32 = jnp.asarray(res, jnp.float32)
        zero = jnp.zeros_like(dn)
        dx, _, dgamma = reference.add_backward(dn, zero, x32, res32, gamma, outs[3], 0.0)
    if per_column:
        y_t, scales_t, column_scales = outs[-3:]
        xq_t = dequantize(y_t, scales_t) * column_scales  # [K, rows]
    else:
        xq_t = dequantize(*outs[-2:])
    if resolved.hadamard is None:
        dw = jnp.matmul(xq_t, g, precision=HIGHEST)
    else:
        gh = hadamard_rows(g, spec.block, resolved.hadamard)
        dw = jnp.matmul(xq_t, gh, precision=HIGHEST) * jnp.float32(1.0 / spec.block)
    return dx.reshape(x.shape), dgamma.reshape(jnp.shape(gamma)), dw


def _norm(v):
    return jnp.sqrt(jnp.sum(jnp.square(v)))


@functools.partial(jax.jit, static_argnames=("recipe", "parts"))
def _measure(recipe: str, parts: tuple, operands: dict, keys):
    """Per tensor ``(rel_error, bias ratio, bias/|d|)`` over the draws of ``keys`` (one
    key: no randomness, the ratio 1)."""
    d_ref = reference_gradients(operands)
    d_unr = unrounded_gradients(recipe, parts, operands)

    def draw(carry, key):
        d = layer_gradients(recipe, parts, operands, key)
        sums, squares = carry
        sums = tuple(s + v for s, v in zip(sums, d, strict=True))
        squares = tuple(
            q + jnp.sum(jnp.square(v - u)) for q, v, u in zip(squares, d, d_unr, strict=True)
        )
        return (sums, squares), None

    first = layer_gradients(recipe, parts, operands, keys[0])
    if keys.shape[0] == 1:  # nothing random: the one draw is the mean
        sums = first
        squares = tuple(jnp.sum(jnp.square(v - u)) for v, u in zip(first, d_unr, strict=True))
    else:
        start = (tuple(jnp.zeros_like(v) for v in first), tuple(jnp.float32(0) for _ in first))
        (sums, squares), _ = jax.lax.scan(draw, start, keys)
    results = []
    for d0, s, q, ref, unr in zip(first, sums, squares, d_ref, d_unr, strict=True):
        bias = _norm(s / keys.shape[0] - unr)
        one_draw = jnp.sqrt(q / keys.shape[0])
        results.append((_norm(d0 - ref) / _norm(ref), bias / one_draw, bias / _norm(unr)))
    return results


def measure(recipe: str, label: str, operands: dict, keys) -> list[dict]:
    """The report's rows of one recipe, combination of parts and site tensors."""
    parts = PARTS[label]
    random = parts[0]
    used = keys if random else keys[:1]
    values = jax.device_get(_measure(recipe, parts, operands, used))
    rows = []
    for tensor, (rel, ratio, bias) in zip(TENSORS, values, strict=True):
        rows.append(
            {
                "tensor": tensor,
                "rel_error": float(rel),
                "bias_ratio": float(ratio) if random else None,
                "bias_rel": float(bias),
                "keys": int(used.shape[0]),
            }
        )
    return rows


def report(
    config: train.Config,
    keys: int,
    sites: Sequence[str] = DEFAULT_SITES,
    recipes: Sequence[str] = FP4_RECIPES,
    parts: Sequence[str] = tuple(PARTS),
    seed: int = 0,
    log=print,
) -> dict:
    """The report: ``{"rows": [...], "skipped": [...], ...}`` for the bfloat16 run of
    ``config`` at its first and last step."""
    names = site_names(config)
    unknown = [s for s in sites if s not in names]
    if unknown:
        raise ValueError(f"sites: each one of {names}, got {unknown}")
    steps = sorted({0, config.steps - 1})
    start = time.perf_counter()
    kept = captured_steps(config, steps)
    log(f"trained bfloat16 for {config.steps} steps ({time.perf_counter() - start:.0f} s)")
    draw_keys = jax.random.split(jax.random.key(seed), keys)
    ready = hadamard_ready()
    rows, skipped = [], []
    for step in steps:
        tensors = train.site_tensors(config, train.Run(train.BASELINE), *kept[step])
        for site in sites:
            operands = tensors[names.index(site)]
            for recipe in recipes:
                for label in parts:
                    if PARTS[label][1] and not ready:
                        skipped.append(
                            {"recipe": recipe, "parts": label, "site": site, "step": step}
                        )
                        continue
                    began = time.perf_counter()
                    for row in measure(recipe, label, operands, draw_keys):
                        rows.append(
                            {"recipe": recipe, "parts": label, "site": site, "step": step, **row}
                        )
                    took = time.perf_counter() - began
                    log(f"  {recipe} {label} at {site}, step {step}: {took:.0f} s")
    seconds = time.perf_counter() - start
    return {
        "steps": config.steps,
        "keys": keys,
        "sites": list(sites),
        "recipes": list(recipes),
        "rows": rows,
        "skipped": skipped,
        "seconds": seconds,
        "device": jax.devices()[0].device_kind,
    }


def table(result: dict) -> str:
    """The report as a markdown table."""
    lines = [
        "| recipe | parts | site | step | tensor | rel_error | bias ratio | bias/|d| |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        ratio = "1 (no randomness)" if row["bias_ratio"] is None else f"{row['bias_ratio']:.3f}"
        lines.append(
            f"| {row['recipe']} | {row['parts']} | {row['site']} | {row['step']} | "
            f"{row['tensor']} | {row['rel_error']:.4f} | {ratio} | {row['bias_rel']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_fp8norm.bench.gradients", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=train.Config.steps)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument(
        "--sites", nargs="+", default=list(DEFAULT_SITES), help="of qkv<i>, up<i>, head"
    )
    parser.add_argument("--recipes", default=",".join(FP4_RECIPES), help="comma-separated")
    parser.add_argument("--json", default=None, help="write the report as JSON to this file")
    args = parser.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in FP4_RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; the FP4 recipes: {', '.join(FP4_RECIPES)}")
    if args.steps < 1 or args.keys < 2:
        parser.error("--steps must be at least 1 and --keys at least 2")
    config = train.Config(steps=args.steps)
    names = site_names(config)
    if any(s not in names for s in args.sites):
        parser.error(f"--sites: each one of {', '.join(names)}")
    result = report(config, args.keys, args.sites, recipes)
    print(
        f"gradient fidelity on {jax.devices()[0].platform} ({result['device']}): the bfloat16 "
        f"run's tensors at steps {sorted({0, args.steps - 1})}, {args.keys} keys, "
        f"{result['seconds']:.0f} s"
    )
    print(table(result))
    if result["skipped"]:
        print(
            f"not measured: {len(result['skipped'])} combinations with the Hadamard "
            "transform (the norm's columnwise codes do not take it yet)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
