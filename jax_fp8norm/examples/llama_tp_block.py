"""A Llama-style decoder block, tensor-parallel over a mesh axis ``tp``, with an FP8 MLP.

    python -m jax_fp8norm --tp 8          # or: python -m jax_fp8norm.examples.llama_tp_block

Per device, inside ``jax.jit`` + ``jax.shard_map``:

1. attention in bfloat16, heads split over ``tp``: RMSNorm, column-parallel q/k/v, causal
   softmax attention, then the row-parallel output projection, which leaves a partial sum;
2. ``allreduce_residual_rms_norm_fp8``: all-reduce of that partial sum, residual add,
   RMSNorm and FP8 quantisation in one step: the MLP's FP8 input and its per-row scales;
3. the MLP: column-parallel gate / up projections as FP8 matmuls (FP8 weights with
   per-output-channel scales, both scales applied to the float32 accumulator), SiLU gate,
   then the row-parallel down projection (bfloat16), another partial sum;
4. ``allreduce_residual_rms_norm_fp8`` again: the next block's FP8 input, its scales and
   the residual stream.

The same block written in plain jnp (bfloat16 weights and activations, no sharding, no
FP8) is the check: the residual stream and the dequantised next-block input must agree
with it within the stated tolerances (FP8 keeps 3 mantissa bits: about 3% per element).
With no GPUs (or fewer than ``tp``) it runs on ``tp`` virtual CPU devices.

FP4 mode (``--fp4 nvfp4`` or ``--fp4 mxfp4``): both norms emit FP4 (float4_e2m1fn) with
block scales, e4m3 per 1x16 group and a global scale (NVFP4) or e8m0 per 1x32 group
(MXFP4), and the gate / up projections take FP4 operands through ``fp8_matmul``, with
weights from ``quantize_weights_nvfp4`` / ``quantize_weights_mxfp4`` (blocks along K).
NVFP4's activation global scales (decode scales, ``amax(|n|) / (448 * 6)`` of each
norm's output) are calibrated on a batch of other inputs through the bfloat16 block, and
are data of the jitted block. The check is the same, with FP4's tolerances (E2M1 keeps
one mantissa bit).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fp8norm as fp8norm
from jax_fp8norm.matmul import fp8_matmul
from jax_fp8norm.quantize import (
    quantize_per_channel,
    quantize_weights_mxfp4,
    quantize_weights_nvfp4,
)

# Relative errors (Frobenius norm) the FP8 block may have against the bfloat16 one. With
# the default config they measure 0.027 (residual stream: the MLP's FP8 activations and
# weights, each rounded to 3 mantissa bits) and 0.038 (next-block input, quantised once
# more), the same for tp = 1, 2 and 8.
RESIDUAL_TOLERANCE = 0.04
NEXT_INPUT_TOLERANCE = 0.06

# The FP4 modes: the norms' keywords (NVFP4's global scale added per norm).
FP4_KEYWORDS = {
    "nvfp4": {
        "out_dtype": jnp.float4_e2m1fn,
        "group_size": 16,
        "scale_dtype": jnp.float8_e4m3fn,
    },
    "mxfp4": {
        "out_dtype": jnp.float4_e2m1fn,
        "group_size": 32,
        "scale_dtype": jnp.float8_e8m0fnu,
    },
}
FP4_NAMES = {
    "nvfp4": "NVFP4 (e4m3 scales per 1x16 group, global scales)",
    "mxfp4": "MXFP4 (e8m0 scales per 1x32 group)",
}
# (residual stream, next-block input) tolerances of the FP4 modes. With the default config
# they measure 0.095 and 0.135 (NVFP4), 0.115 to 0.117 and 0.164 (MXFP4: power-of-two
# scales waste up to a bit of range), for tp = 1, 2 and 8 and seeds 0 and 1: E2M1's one
# mantissa bit costs about 10% per element, once for the activations, once for the weights.
FP4_TOLERANCES = {"nvfp4": (0.12, 0.17), "mxfp4": (0.14, 0.20)}


ALLREDUCE_METHODS = ("auto", "xla", "one_shot", "two_shot")


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 2
    seq: int = 64
    d_model: int = 1024
    n_heads: int = 16
    head_dim: int = 64
    d_ff: int = 2816
    eps: float = 1e-5
    # None: one activation scale per row; G: one per 1xG group (128: DeepSeek-V3 style).
    group_size: int | None = None
    # None: FP8; "nvfp4" or "mxfp4": the FP4 mode (module docstring).
    fp4: str | None = None
    # The all-reduces' method= (jax_fp8norm.allreduce_residual_rms_norm_fp8).
    allreduce_method: str = "auto"

    def __post_init__(self) -> None:
        if self.allreduce_method not in ALLREDUCE_METHODS:
            method = self.allreduce_method
            raise ValueError(f"allreduce_method must be one of {ALLREDUCE_METHODS}, not {method!r}")
        if self.fp4 is not None and self.fp4 not in FP4_KEYWORDS:
            raise ValueError(f"fp4 must be one of {tuple(FP4_KEYWORDS)}, not {self.fp4!r}")
        if self.fp4 is not None and self.group_size is not None:
            raise ValueError("group_size is fixed by the FP4 format (16 NVFP4, 32 MXFP4)")


def init_params(config: Config, key: jax.Array) -> dict[str, jax.Array]:
    """bfloat16 weights, each scaled by 1/sqrt(fan_in), and norm weights near 1."""
    c = config
    inner = c.n_heads * c.head_dim
    shapes = {
        "wq": (c.d_model, inner),
        "wk": (c.d_model, inner),
        "wv": (c.d_model, inner),
        "wo": (inner, c.d_model),
        "w_gate": (c.d_model, c.d_ff),
        "w_up": (c.d_model, c.d_ff),
        "w_down": (c.d_ff, c.d_model),
    }
    keys = jax.random.split(key, len(shapes) + 3)
    params = {
        name: (jax.random.normal(k, shape) / np.sqrt(shape[0])).astype(jnp.bfloat16)
        for k, (name, shape) in zip(keys, shapes.items(), strict=False)
    }
    for k, name in zip(keys[len(shapes) :], ("attn_norm", "mlp_norm", "next_norm"), strict=True):
        params[name] = 1.0 + 0.1 * jax.random.normal(k, (c.d_model,), jnp.float32)
    return params


def _attention(h: jax.Array, wq, wk, wv, wo, gamma, config: Config) -> jax.Array:
    """Causal attention over the heads whose projections are given; returns the output
    projection of those heads (a partial sum when the heads are a shard)."""
    b, s, _ = h.shape
    a = fp8norm.reference.textbook_rms_norm(h, gamma, config.eps).astype(jnp.bfloat16)
    heads = wq.shape[1] // config.head_dim

    def split(w):
        return (a @ w).reshape(b, s, heads, config.head_dim)

    q, k, v = split(wq), split(wk), split(wv)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    logits = logits / np.sqrt(config.head_dim)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).astype(jnp.bfloat16)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, heads * config.head_dim)
    return out @ wo


def _reference_stages(h0: jax.Array, params: dict, config: Config):
    """The block in plain jnp, bfloat16, one device: (MLP input before its cast to
    bfloat16, next-block input, residual stream)."""
    p = params
    h1 = h0 + _attention(h0, p["wq"], p["wk"], p["wv"], p["wo"], p["attn_norm"], config)
    normed = fp8norm.reference.textbook_rms_norm(h1, p["mlp_norm"], config.eps)
    m = normed.astype(jnp.bfloat16)
    act = jax.nn.silu((m @ p["w_gate"]).astype(jnp.float32)) * (m @ p["w_up"])
    h2 = h1 + act.astype(jnp.bfloat16) @ p["w_down"]
    return normed, fp8norm.reference.textbook_rms_norm(h2, p["next_norm"], config.eps), h2


def reference_block(h0: jax.Array, params: dict, config: Config):
    """The block in plain jnp, bfloat16, one device: (next-block input, residual stream)."""
    _, next_input, h2 = _reference_stages(h0, params, config)
    return next_input, h2


def calibrate_nvfp4(h: jax.Array, params: dict, config: Config) -> dict[str, jax.Array]:
    """NVFP4's activation global scales from a calibration batch ``h``: per norm,
    ``amax(|n|) / (448 * 6)`` of its output in the bfloat16 block (a decode scale that
    puts the largest block scale near 448)."""
    normed, next_input, _ = jax.jit(_reference_stages, static_argnums=2)(h, params, config)
    return {
        name: (jnp.max(jnp.abs(n)) / (448.0 * 6.0)).astype(jnp.float32)
        for name, n in (("mlp_gs", normed), ("next_gs", next_input))
    }


def fp8_params(params: dict) -> dict:
    """The MLP's gate and up weights in FP8 with per-output-channel scales."""
    out = dict(params)
    for name in ("w_gate", "w_up"):
        out[name], out[name + "_scale"] = quantize_per_channel(params[name])
    return out


def fp4_params(params: dict, fmt: str, global_scales: dict | None = None) -> dict:
    """The MLP's gate and up weights in FP4 (``fmt``: "nvfp4" or "mxfp4"), blocks along K;
    NVFP4 adds each weight's global scale and the activations' (``global_scales``, from
    :func:`calibrate_nvfp4`)."""
    out = dict(params)
    for name in ("w_gate", "w_up"):
        if fmt == "nvfp4":
            out[name], out[name + "_scale"], out[name + "_gs"] = quantize_weights_nvfp4(
                params[name]
            )
        else:
            out[name], out[name + "_scale"] = quantize_weights_mxfp4(params[name])
    if fmt == "nvfp4":
        out.update(global_scales)
    return out


# Sharding of each weight over "tp": column-parallel splits outputs, row-parallel inputs.
PARAM_SPECS = {
    "wq": P(None, "tp"),
    "wk": P(None, "tp"),
    "wv": P(None, "tp"),
    "wo": P("tp", None),
    "w_gate": P(None, "tp"),
    "w_gate_scale": P("tp"),
    "w_up": P(None, "tp"),
    "w_up_scale": P("tp"),
    "w_down": P("tp", None),
    "attn_norm": P(),
    "mlp_norm": P(),
    "next_norm": P(),
}
# FP4: the weights' block scales are [K // block, N], split over N like the weights;
# NVFP4's global scales (the weights' and the activations') are replicated.
FP4_PARAM_SPECS = {
    "mxfp4": {**PARAM_SPECS, "w_gate_scale": P(None, "tp"), "w_up_scale": P(None, "tp")},
}
FP4_PARAM_SPECS["nvfp4"] = {
    **FP4_PARAM_SPECS["mxfp4"],
    **{name: P() for name in ("w_gate_gs", "w_up_gs", "mlp_gs", "next_gs")},
}


def param_specs(config: Config) -> dict:
    return PARAM_SPECS if config.fp4 is None else FP4_PARAM_SPECS[config.fp4]


def _norm_keywords(config: Config, params: dict, global_scale: str) -> dict:
    """The norm's scale keywords: FP8 with per-row or per-group scales, or an FP4 format
    (NVFP4 with the global scale ``params[global_scale]``)."""
    if config.fp4 is None:
        return {"group_size": config.group_size}
    keywords = dict(FP4_KEYWORDS[config.fp4])
    if config.fp4 == "nvfp4":
        keywords["global_scale"] = params[global_scale]
    return keywords


def _matmul(y, scales, params: dict, name: str, config: Config, global_scale: str):
    if config.fp4 == "nvfp4":
        return fp8_matmul(
            y,
            scales,
            params[name],
            params[name + "_scale"],
            a_global_scale=params[global_scale],
            w_global_scale=params[name + "_gs"],
        )
    return fp8_matmul(y, scales, params[name], params[name + "_scale"])


def tp_block(h0: jax.Array, params: dict, config: Config):
    """Per-device body under shard_map: returns the next block's FP8 (or FP4) input, its
    scales and the residual stream, replicated over "tp"."""
    p = params
    eps = config.eps
    attn_partial = _attention(h0, p["wq"], p["wk"], p["wv"], p["wo"], p["attn_norm"], config)
    method = config.allreduce_method
    y, scales, h1 = fp8norm.allreduce_residual_rms_norm_fp8(
        attn_partial, h0, p["mlp_norm"], axis_name="tp", eps=eps, method=method,
        **_norm_keywords(config, p, "mlp_gs"),
    )  # fmt: skip
    gate = _matmul(y, scales, p, "w_gate", config, "mlp_gs")
    up = _matmul(y, scales, p, "w_up", config, "mlp_gs")
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up).astype(jnp.bfloat16)
    mlp_partial = act @ p["w_down"]
    return fp8norm.allreduce_residual_rms_norm_fp8(
        mlp_partial, h1, p["next_norm"], axis_name="tp", eps=eps, method=method,
        **_norm_keywords(config, p, "next_gs"),
    )  # fmt: skip


def make_tp_block(mesh: jax.sharding.Mesh, config: Config):
    """The jitted tensor-parallel block: (h0, fp8 or fp4 params) -> (y, scales, residual)."""
    fn = jax.shard_map(
        lambda h, p: tp_block(h, p, config),
        mesh=mesh,
        in_specs=(P(), param_specs(config)),
        out_specs=(P(), P(), P()),
    )
    return jax.jit(fn)


def relative_error(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def run(
    tp: int, config: Config = Config(), seed: int = 0, platform: str | None = None
) -> dict[str, float]:
    """Runs the block on ``tp`` devices of ``platform`` (default: GPUs when there are
    enough, else CPU devices) and checks it; returns the measured errors."""
    if platform is None:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        platform = "gpu" if len(gpus) >= tp else "cpu"
    devices = jax.devices(platform)[:tp]
    if len(devices) < tp:
        raise RuntimeError(f"--tp {tp} needs {tp} devices; jax sees {len(devices)}")
    if config.n_heads % tp or config.d_ff % tp:
        raise ValueError(f"tp={tp} must divide n_heads={config.n_heads} and d_ff={config.d_ff}")
    mesh = jax.make_mesh((tp,), ("tp",), devices=devices)
    k_params, k_x = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(config, k_params)
    h0 = jax.random.normal(k_x, (config.batch, config.seq, config.d_model), jnp.bfloat16)

    global_scales = {}
    if config.fp4 is None:
        q_params = fp8_params(params)
    else:
        if config.fp4 == "nvfp4":
            # A calibration batch other than the one checked.
            k_calib = jax.random.fold_in(k_x, 1)
            h_calib = jax.random.normal(k_calib, h0.shape, jnp.bfloat16)
            global_scales = calibrate_nvfp4(h_calib, params, config)
        q_params = fp4_params(params, config.fp4, global_scales)
    specs = param_specs(config)
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in q_params.items()}
    # On the CPU a one-kernel all-reduce runs the CUDA kernel under the SIMT emulation.
    emulate = (
        devices[0].platform == "cpu"
        and config.allreduce_method in ("one_shot", "two_shot")
        and not fp8norm.simt.active()
    )
    with fp8norm.simt.kernels() if emulate else contextlib.nullcontext():
        y, scales, residual = make_tp_block(mesh, config)(
            jax.device_put(h0, NamedSharding(mesh, P())), placed
        )
    expected_next, expected_residual = jax.jit(reference_block, static_argnums=2)(
        h0, params, config
    )
    dequantised = np.asarray(fp8norm.reference.dequantize(y, scales, global_scales.get("next_gs")))
    errors = {
        "residual": relative_error(residual, expected_residual),
        "next_input": relative_error(dequantised, expected_next),
    }
    shards = [np.asarray(s.data).view(np.uint8) for s in y.addressable_shards]
    errors["devices_identical"] = float(all(np.array_equal(s, shards[0]) for s in shards))
    errors["platform"] = devices[0].platform
    errors["emulated"] = float(emulate or fp8norm.simt.active())
    return errors


def tolerances(config: Config) -> tuple[float, float]:
    """(residual stream, next-block input) tolerances of the config's mode."""
    if config.fp4 is None:
        return RESIDUAL_TOLERANCE, NEXT_INPUT_TOLERANCE
    return FP4_TOLERANCES[config.fp4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tensor-parallel Llama block with FP8 MLP")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel degree")
    parser.add_argument(
        "--group-size", type=int, default=None, help="activation scales per 1xG group"
    )
    parser.add_argument(
        "--fp4", choices=sorted(FP4_KEYWORDS), help="FP4 mode: FP4 norm outputs and matmuls"
    )
    parser.add_argument(
        "--allreduce-method",
        choices=ALLREDUCE_METHODS,
        default="auto",
        help="the all-reduces' method (one_shot, two_shot: emulated on the CPU)",
    )
    args = parser.parse_args(argv)
    if args.fp4 is not None and args.group_size is not None:
        parser.error("--group-size: the FP4 format fixes the group (16 NVFP4, 32 MXFP4)")
    # Virtual CPU devices must be requested before jax's backends start.
    jax.config.update("jax_num_cpu_devices", max(args.tp, 1))
    return report(args.tp, args.group_size, args.fp4, args.allreduce_method)


def report(
    tp: int, group_size: int | None = None, fp4: str | None = None, allreduce_method: str = "auto"
) -> int:
    config = Config(group_size=group_size, fp4=fp4, allreduce_method=allreduce_method)
    errors = run(tp, config)
    residual_tolerance, next_tolerance = tolerances(config)
    ok = (
        errors["residual"] <= residual_tolerance
        and errors["next_input"] <= next_tolerance
        and errors["devices_identical"] == 1.0
    )
    if fp4 is not None:
        scales = FP4_NAMES[fp4]
    else:
        scales = "per-row scales" if group_size is None else f"scales per 1x{group_size} group"
    print(
        f"Llama block, tp={tp} on {errors['platform']}, {scales}, all-reduce method "
        f"{allreduce_method}{' (emulated CUDA kernel)' if errors['emulated'] else ''}: "
        f"relative error against the bf16 "
        f"block: residual stream {errors['residual']:.4f} (tolerance {residual_tolerance}), "
        f"dequantised next-block input {errors['next_input']:.4f} "
        f"(tolerance {next_tolerance}); outputs identical on every device: "
        f"{errors['devices_identical'] == 1.0}"
    )
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
