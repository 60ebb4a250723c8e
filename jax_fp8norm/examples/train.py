"""A real training run: a small decoder trained on the CPU once per recipe, where every
norm and the linear layer after it is :func:`jax_fp8norm.rms_norm_dense` (the attention's
and the MLP's input projections, the output head), and once in plain bfloat16, with the
same seed, data and steps. Prints the loss curves' summary, checks the margins and writes a
PNG of the curves::

    python -m jax_fp8norm.examples.train [--steps 400] [--recipes mxfp8 nvfp4] [--png F]

The data is a synthetic language the package makes: a second-order Markov chain over 128
tokens whose every context has a few likely successors (entropy well below log 128), so
that the loss has structure to learn and a floor the run prints.

Layer (pre-norm, residual stream in bfloat16)::

    qkv = rms_norm_dense(x, g_attn, w_qkv)                # fused norm + FP8/FP4 GEMM
    attended = causal_attention(qkv) @ w_o                # bfloat16
    up, x = add_rms_norm_dense(attended, x, g_mlp, w_up)  # x + attended, fused as well
    x = x + silu(up) @ w_down                             # bfloat16
    logits = rms_norm_dense(x, g_out, w_head)

The margins (``MARGINS``): the final loss (mean of the last tenth of the steps) of an FP8
recipe within 3% of bfloat16's, NVFP4's within 10%, MXFP4's within 20%. The floors
(``FLOORS``): an FP4 recipe's loss above bfloat16's (the unquantised layer) by at least
0.2% (NVFP4) or 0.5% (MXFP4) on average over the steps, what its round-to-nearest
gradients cost; less is no FP4 run (every FP8 recipe stays within 0.05%).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8norm as fp8norm

BASELINE = "bfloat16"
RECIPE_DATA = {"fp8_static": {"static_scale": 0.02}}
# The final loss's allowed excess over bfloat16's, relative (the runs the report holds:
# the FP8 recipes, and the FP4 recipes with their defaults). Measured over 400 steps with
# jax 0.10.2 on the CPU: every FP8 recipe within +0.05%, NVFP4 +0.29%, MXFP4 +0.43%
# (docs/training.md, "The training run").
MARGINS = {"fp8": 0.03, "fp4": 0.005}
# The least mean relative difference of a held run's losses from bfloat16's: a run that
# did not quantise (bfloat16's bits) would have none.
FLOOR = 0.0002


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    dim: int = 128
    heads: int = 4
    mlp: int = 512
    layers: int = 2
    batch: int = 16
    seq: int = 64
    steps: int = 400
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0


def mean_difference(losses: np.ndarray, baseline: np.ndarray) -> float:
    """The mean over the steps of ``|loss - baseline loss| / baseline loss``: how far a run
    is from bfloat16's on the same seed, data and steps."""
    return float(np.mean(np.abs(losses - baseline) / baseline))


# ---- the synthetic language ------------------------------------------------------------


# The token two back enters the context through its class (token % CLASSES): 4 x 128
# contexts, which a small model learns within a few hundred steps and only with attention.
CLASSES = 4


def language(config: Config) -> np.ndarray:
    """The chain's transition table ``[V, V, V]``: p(next | previous two), a function of
    the class of the token two back and of the previous token."""
    rng = np.random.default_rng(1000 + config.seed)
    v = config.vocab
    logits = rng.standard_normal((CLASSES, v, v)) * 0.5
    likely = rng.integers(0, v, size=(CLASSES, v, 4))
    np.put_along_axis(logits, likely, 5.0 + rng.standard_normal((CLASSES, v, 4)), axis=-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return p[np.arange(v) % CLASSES]


def entropy(table: np.ndarray) -> float:
    """The chain's entropy rate (nats per token) under uniform contexts: the loss floor."""
    return float(-(table * np.log(table)).sum(-1).mean())


def batches(config: Config, table: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``count`` batches of token sequences ``[count, batch, seq + 1]``."""
    rng = np.random.default_rng(seed)
    n = count * config.batch
    tokens = np.zeros((n, config.seq + 1), np.int32)
    tokens[:, :2] = rng.integers(0, config.vocab, size=(n, 2))
    cumulative = np.cumsum(table, -1)
    for t in range(2, config.seq + 1):
        c = cumulative[tokens[:, t - 2], tokens[:, t - 1]]
        draw = rng.random((n, 1))
        tokens[:, t] = np.minimum((draw > c).sum(-1), config.vocab - 1)
    return tokens.reshape(count, config.batch, config.seq + 1)


# ---- the model ---------------------------------------------------------------------------


def init(config: Config) -> dict:
    """float32 master parameters."""
    key = jax.random.key(config.seed)
    keys = iter(jax.random.split(key, 4 + 4 * config.layers))

    def dense(k, fan_in, fan_out):
        return jax.random.normal(k, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)

    d = config.dim
    layers = [
        {
            "attn_norm": jnp.ones(d),
            "qkv": dense(next(keys), d, 3 * d),
            "o": dense(next(keys), d, d) / np.sqrt(2 * config.layers),
            "mlp_norm": jnp.ones(d),
            "up": dense(next(keys), d, config.mlp),
            "down": dense(next(keys), config.mlp, d) / np.sqrt(2 * config.layers),
        }
        for _ in range(config.layers)
    ]
    return {
        "embed": jax.random.normal(next(keys), (config.vocab, d)) * 0.5,
        "layers": layers,
        "out_norm": jnp.ones(d),
        "head": dense(next(keys), d, config.vocab),
    }


@dataclass(frozen=True)
class Run:
    """One training run: the recipe of the layers, which of FP4 training's parts they use
    (None: the recipe's defaults), whether the output head (the final norm and the
    vocabulary projection) goes through the recipe too or stays in bfloat16, and how many
    of the last blocks stay in bfloat16 (the per-layer precision NVIDIA's recipe uses)."""

    recipe: str
    stochastic_rounding: bool | None = None
    hadamard: bool | int | None = None  # an int: the transform's sign mask
    weight_tiles: bool | None = None
    head_quantized: bool = False
    bfloat16_blocks: int = 0

    @property
    def name(self) -> str:
        if self.recipe == BASELINE:
            return BASELINE
        parts = [
            f"{label}={value if type(value) is int else ('on' if value else 'off')}"
            for label, value in (
                ("sr", self.stochastic_rounding),
                ("hadamard", self.hadamard),
                ("tiles", self.weight_tiles),
            )
            if value is not None
        ]
        head = ", head fp" if self.head_quantized else ""
        last = f", last {self.bfloat16_blocks} blocks bf16" if self.bfloat16_blocks else ""
        return self.recipe + (f" ({', '.join(parts)})" if parts else "") + head + last

    def keywords(self, site: int, key) -> dict:
        """The layer's keywords at norm site ``site`` (a fresh key per step and site)."""
        keywords = {"recipe": self.recipe, **RECIPE_DATA.get(self.recipe, {})}
        if not fp8norm.RECIPES[self.recipe].fp4:
            return keywords
        parts = {
            "stochastic_rounding": self.stochastic_rounding,
            "hadamard": self.hadamard,
            "weight_tiles": self.weight_tiles,
        }
        keywords.update({k: v for k, v in parts.items() if v is not None})
        return {**keywords, "key": jax.random.fold_in(key, site)}


# The ablation of FP4 training's parts, per FP4 recipe: round-to-nearest everywhere (the
# recipe before the parts), then stochastic rounding of the gradient, the Hadamard
# transform of the wgrad GEMM's operands, the weight's 2-D tiles (the defaults: all on).
ABLATION = (
    {"stochastic_rounding": False, "hadamard": False, "weight_tiles": False},
    {"stochastic_rounding": True, "hadamard": False, "weight_tiles": False},
    {"stochastic_rounding": True, "hadamard": True, "weight_tiles": False},
    {"stochastic_rounding": True, "hadamard": True, "weight_tiles": True},
)


def ablation(recipes) -> list[Run]:
    """The ablation's runs for each FP4 recipe, with the head in bfloat16 and through
    the recipe."""
    return [
        Run(recipe, **parts, head_quantized=head)
        for recipe in recipes
        for head in (False, True)
        for parts in ABLATION
    ]


def _norm_dense(
    run: Run, site: int, key, x, gamma, w, residual=None, head=False, taps=None, unquantized=False
):
    """The fused layer of ``run`` at norm site ``site``; bfloat16's for BASELINE, for the
    head unless the run quantises it, and for a site the run keeps ``unquantized``.
    ``taps`` (a dict), if given, records the site's operands and adds its zero
    ``taps["zero"][site]`` to the output, whose gradient is then the output's cotangent
    (:func:`site_tensors`)."""
    if run.recipe == BASELINE or (head and not run.head_quantized) or unquantized:
        keywords = {"recipe": BASELINE}
    else:
        keywords = run.keywords(site, key)
    if residual is None:
        out = fp8norm.rms_norm_dense(x, gamma, w, **keywords)
    else:
        out, residual_out = fp8norm.add_rms_norm_dense(x, residual, gamma, w, **keywords)
    if taps is not None:
        taps[site] = {"x": x, "residual": residual, "gamma": gamma, "w": w}
        out = out + taps["zero"][site].astype(out.dtype)
    return out if residual is None else (out, residual_out)


def _attention(config: Config, qkv):
    b, t, _ = qkv.shape
    q, k, v = jnp.split(qkv.reshape(b, t, 3, config.heads, -1), 3, axis=2)
    q, k, v = (a[:, :, 0] for a in (q, k, v))  # [b, t, heads, head_dim]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, -1)


def forward(config: Config, run: Run, params: dict, tokens, key, taps=None):
    """Logits ``[batch, seq, vocab]`` (float32) of ``tokens [batch, seq]``; ``key``: the
    step's, folded with each norm site's index for its layer."""
    bf16 = jnp.bfloat16
    x = params["embed"][tokens].astype(bf16)
    for i, layer in enumerate(params["layers"]):
        kept = i >= len(params["layers"]) - run.bfloat16_blocks
        qkv = _norm_dense(
            run, 2 * i, key, x, layer["attn_norm"], layer["qkv"], taps=taps, unquantized=kept
        )
        attended = _attention(config, qkv) @ layer["o"].astype(bf16)
        up, x = _norm_dense(
            run,
            2 * i + 1,
            key,
            attended,
            layer["mlp_norm"],
            layer["up"],
            residual=x,
            taps=taps,
            unquantized=kept,
        )
        x = x + jax.nn.silu(up) @ layer["down"].astype(bf16)
    site = 2 * len(params["layers"])
    logits = _norm_dense(
        run, site, key, x, params["out_norm"], params["head"], head=True, taps=taps
    )
    return logits.astype(jnp.float32)


def loss_fn(config: Config, run: Run, params: dict, batch, key, taps=None):
    logits = forward(config, run, params, batch[:, :-1], key, taps)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], -1))


def site_tensors(config: Config, run: Run, params: dict, batch, key) -> list[dict]:
    """Each norm site's operands in a step of ``run`` (``x``, ``residual`` or None,
    ``gamma``, ``w``) and ``g``, the cotangent of its output: what its layer's backward
    takes, for the gradient report (jax_fp8norm.bench.gradients)."""
    sites = 2 * config.layers + 1
    b, t = batch.shape[0], batch.shape[1] - 1
    widths = [3 * config.dim, config.mlp] * config.layers + [config.vocab]
    zero = [jnp.zeros((b, t, f), jnp.float32) for f in widths[:sites]]

    def loss(zero):
        taps = {"zero": zero}
        value = loss_fn(config, run, params, batch, key, taps)
        return value, [taps[k] for k in range(sites)]

    cotangents, operands = jax.grad(loss, has_aux=True)(zero)
    return [dict(operands[k], g=cotangents[k]) for k in range(sites)]


# ---- training ----------------------------------------------------------------------------


def _adam(config: Config, params, grads, state, step):
    """Adam with linear warm-up, betas (0.9, 0.95), weight decay 0.01 on matrices."""
    m, v = state
    lr = config.lr * jnp.minimum(1.0, (step + 1) / config.warmup)
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
    v = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, v, grads)
    c1, c2 = 1 - 0.9 ** (step + 1), 1 - 0.95 ** (step + 1)

    def update(p, m, v):
        decay = 0.01 * p if p.ndim == 2 else 0.0
        return p - lr * ((m / c1) / (jnp.sqrt(v / c2) + 1e-8) + decay)

    return jax.tree.map(update, params, m, v), (m, v)


def train(config: Config, run: Run, data: np.ndarray, keep=None) -> np.ndarray:
    """The training loss of every step, ``[steps]``. The stochastic rounding's key: the
    run's seed folded with the step. ``keep(step, params, batch, key)``, if given, sees
    each step's inputs (the gradient report takes its tensors from it)."""
    params = init(config)
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = (zeros, zeros)
    base_key = jax.random.key(10_000 + config.seed)
    gradient = jax.value_and_grad(functools.partial(loss_fn, config, run))

    @jax.jit
    def step(params, state, batch, i):
        loss, grads = gradient(params, batch, jax.random.fold_in(base_key, i))
        params, state = _adam(config, params, grads, state, i)
        return params, state, loss

    losses = []
    for i in range(config.steps):
        batch = data[i % len(data)]
        if keep is not None:
            keep(i, params, batch, jax.random.fold_in(base_key, i))
        params, state, loss = step(params, state, batch, jnp.int32(i))
        losses.append(loss)
    return np.asarray(jax.device_get(losses), np.float64)


def final_loss(losses: np.ndarray) -> float:
    """The mean of the last tenth of the steps' losses (at least 5)."""
    return float(losses[-max(5, len(losses) // 10) :].mean())


def middle_loss(losses: np.ndarray) -> float:
    """The mean of the tenth of the steps' losses that ends halfway (at least 5)."""
    half = len(losses) // 2
    return float(losses[max(0, half - max(5, len(losses) // 10)) : half].mean())


def as_run(run) -> Run:
    return run if isinstance(run, Run) else Run(run)


def run(config: Config, runs, out=sys.stdout) -> dict:
    """Trains bfloat16 and each run (a Run, or a recipe name for its defaults); returns
    ``{name: {"losses", "final", "middle", "seconds"}}`` and the chain's ``entropy``."""
    table = language(config)
    data = batches(config, table, min(config.steps, 200), seed=config.seed)
    results = {}
    for each in [Run(BASELINE), *map(as_run, runs)]:
        start = time.perf_counter()
        losses = train(config, each, data)
        seconds = time.perf_counter() - start
        results[each.name] = {
            "losses": losses,
            "final": final_loss(losses),
            "middle": middle_loss(losses),
            "seconds": seconds,
        }
        print(f"  {each.name:<44} final loss {final_loss(losses):.4f}  ({seconds:.0f} s)", file=out)
    results["entropy"] = entropy(table)
    return results


def margin(each) -> float | None:
    """The allowed relative excess of a run's final loss over bfloat16's: MARGINS' for the
    FP8 recipes and the FP4 recipes with their defaults (every part on, the head in
    bfloat16); None for an ablation's run, which the table reports and nothing holds."""
    each = as_run(each)
    if not fp8norm.RECIPES[each.recipe].fp4:
        return MARGINS["fp8"]
    parts = (each.stochastic_rounding, each.hadamard, each.weight_tiles)
    default = all(p is None or p is True for p in parts) and not each.head_quantized
    default = default and not each.bfloat16_blocks
    return MARGINS["fp4"] if default else None


def report(results: dict, runs, config: Config) -> tuple[str, bool]:
    """A markdown table of the final losses against bfloat16's (and the gap at the middle
    of the run beside it), and whether every held run is within its margin and apart from
    bfloat16 by at least FLOOR (the mean over the steps of the relative difference: a run
    that did not quantise would not be)."""
    base = results[BASELINE]
    lines = [
        f"{config.layers} layers, dim {config.dim}, {config.steps} steps of "
        f"{config.batch} x {config.seq} tokens; loss floor (the chain's entropy) "
        f"{results['entropy']:.4f}, first step {base['losses'][0]:.4f}",
        "",
        "| run | final loss | vs bfloat16 | at the middle | margin | apart | within |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {BASELINE} | {base['final']:.4f} | | | | | |",
    ]
    ok = True
    for each in map(as_run, runs):
        r = results[each.name]
        excess = (r["final"] - base["final"]) / base["final"]
        middle = (r["middle"] - base["middle"]) / base["middle"]
        apart = mean_difference(r["losses"], base["losses"])
        held = margin(each)
        verdict = ""
        if held is not None:
            within = bool(np.isfinite(r["final"])) and excess <= held and apart >= FLOOR
            ok &= within
            verdict = "yes" if within else "NO"
        shown = "" if held is None else f"{held:.1%}"
        lines.append(
            f"| {each.name} | {r['final']:.4f} | {excess:+.2%} | {middle:+.2%} | {shown} | "
            f"{apart:.2%} | {verdict} |"
        )
    return "\n".join(lines), ok


def figure(results: dict, runs, path: str) -> None:
    """The loss curves (a moving average over 10 steps) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name in [BASELINE, *(as_run(r).name for r in runs)]:
        losses = results[name]["losses"]
        window = min(10, len(losses))
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        baseline = name == BASELINE
        ax.plot(
            np.arange(window, len(losses) + 1),
            smooth,
            "k--" if baseline else "-",
            label=name,
            lw=1.4 if baseline else 1.0,
            zorder=3 if baseline else 2,
        )
    ax.axhline(results["entropy"], color="grey", ls=":", lw=1, label="entropy (floor)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / token, 10-step mean)")
    ax.set_title("A small decoder trained on the CPU: fused FP8 / FP4 layers vs bfloat16")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--recipes", nargs="+", default=list(fp8norm.RECIPES))
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="also each FP4 recipe's ablation of its parts, the head in bfloat16 and not",
    )
    parser.add_argument("--png", default="training_losses.png", help="'' for none")
    args = parser.parse_args(argv)
    unknown = [r for r in args.recipes if r not in fp8norm.RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; known: {', '.join(fp8norm.RECIPES)}")
    config = Config(steps=args.steps)
    runs = [Run(r) for r in args.recipes]
    if args.ablation:
        runs += ablation([r for r in args.recipes if fp8norm.RECIPES[r].fp4])
    print(f"training on {jax.devices()[0].platform}: {BASELINE}, then {len(runs)} runs")
    results = run(config, runs)
    table, ok = report(results, runs, config)
    print(table)
    if args.png:
        try:
            figure(results, runs, args.png)
            print(f"wrote {args.png}")
        except ImportError:
            print("no PNG: matplotlib is not installed (pip install 'jax_fp8norm[bench]')")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
