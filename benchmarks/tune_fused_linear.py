"""Tunes the fused projection kernel (`fused_linear`) per shape on the GPU, against XLA's unfused
equivalent, by coordinate descent over its launch parameters: columns per program, K chunk, warps,
pipeline stages.

A layer's four projections (q|k|v with the input norm, o with the residual add, gate|up with the
post-attention norm, down with SwiGLU and the residual add) at M = 1 (the AR step) and M = a tree's
nodes (a verify), each timed as the model runs it: one call per layer inside one `fori_loop`
iteration, each layer with its own weight (so the weights do not sit in L2 between calls). The
XLA row runs the same arithmetic as plain jnp (norm, product, SwiGLU, residual as separate ops,
fused as XLA decides). Times are per call: loop seconds / iterations / layers.

    python -m benchmarks.tune_fused_linear --shape smollm2_135m --rows 1,69
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp

from longspec_jax.model_shapes import MODEL_SHAPES
from pallas_kernels.fused_linear import fused_linear

KNOBS = {
    "block_cols": (16, 32, 64, 128),
    "block_k": (32, 64, 128, 256, 512),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4),
}
DEFAULT = dict(block_cols=None, block_k=None, num_warps=None, num_stages=None)
ITERATIONS = 50
EPS = 1e-6


def projections(config) -> dict[str, tuple[int, int, str]]:
    """name -> (N, K, prologue/epilogue kind)."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    return {
        "qkv": (qkv, h, "norm"),
        "o": (h, config.num_heads * d, "residual"),
        "gate_up": (2 * config.intermediate_size, h, "norm"),
        "down": (h, config.intermediate_size, "swiglu"),
    }


def make_inputs(n: int, k: int, kind: str, rows: int, layers: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), layers + 3)
    k_in = 2 * k if kind == "swiglu" else k
    x = jax.random.normal(keys[0], (rows, k_in), jnp.bfloat16)
    weights = tuple(0.02 * jax.random.normal(w, (n, k), jnp.bfloat16) for w in keys[3:])
    norm_weight = 1.0 + 0.1 * jax.random.normal(keys[1], (k,), jnp.bfloat16)
    residual = jax.random.normal(keys[2], (rows, n), jnp.bfloat16)
    return x, weights, norm_weight, residual


def xla_projection(x, weight, norm_weight, residual, kind: str):
    """The unfused arithmetic, as the model writes it in plain jnp."""
    if kind == "norm":
        x32 = x.astype(jnp.float32)
        x = norm_weight * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS)).astype(x.dtype)
        return x @ weight.T
    if kind == "swiglu":
        gate, up = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        x = (jax.nn.silu(gate) * up).astype(weight.dtype)
    return x @ weight.T + residual


def pallas_projection(x, weight, norm_weight, residual, kind: str, knobs: dict):
    if kind == "norm":
        return fused_linear(x, weight, norm_weight=norm_weight, eps=EPS, **knobs)
    return fused_linear(x, weight, swiglu=kind == "swiglu", residual=residual, **knobs)


def call_seconds(inputs, kind: str, knobs: dict | None) -> float:
    """Seconds per call, timed in a device loop (knobs None: the XLA equivalent)."""
    x, weights, norm_weight, residual = inputs

    def body(_, total):
        # x depends on the carry, so XLA cannot hoist the loop-invariant products out of the loop.
        x_i = x + (total * 0.0).astype(x.dtype)
        outs = []
        for weight in weights:
            if knobs is None:
                y = xla_projection(x_i, weight, norm_weight, residual, kind)
            else:
                y = pallas_projection(x_i, weight, norm_weight, residual, kind, knobs)
            outs.append(y[:1, :1].astype(jnp.float32))
        return total + sum(outs)

    run = jax.jit(lambda: jax.lax.fori_loop(0, ITERATIONS, body, jnp.zeros((1, 1), jnp.float32)))
    jax.block_until_ready(run())  # compile and warm up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    return best / ITERATIONS / len(weights)


def tune(
    n: int, k: int, kind: str, rows: int, layers: int, passes: int = 2, log=print
) -> tuple[float, float, dict, float]:
    """(XLA us, default us, best knobs, best us) per call at one shape."""
    inputs = make_inputs(n, k, kind, rows, layers)
    seen: dict[tuple, float] = {}

    def measure(knobs):
        key = tuple(sorted(knobs.items()))
        if key not in seen:
            try:
                seen[key] = call_seconds(inputs, kind, knobs) * 1e6
            except Exception as err:  # a configuration the compiler refuses (shared memory, registers)
                log(f"    {knobs}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
                seen[key] = float("inf")
        return seen[key]

    xla_us = call_seconds(inputs, kind, None) * 1e6
    best = dict(DEFAULT)
    default_us = best_us = measure(best)
    log(f"  N={n} K={k} {kind} M={rows}: XLA {xla_us:.2f} us, fused default {default_us:.2f} us")
    for _, (name, values) in itertools.product(range(passes), KNOBS.items()):
        for value in values:
            if name == "block_k" and k % value:
                continue
            trial = {**best, name: value}
            us = measure(trial)
            if us < best_us:
                best, best_us = trial, us
                log(f"    {name}={value}: {us:.2f} us (best so far)")
    return xla_us, default_us, best, best_us


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--rows", default="1,69", help="M: 1 is the AR step, more a verified tree")
    parser.add_argument("--projections", default="qkv,o,gate_up,down")
    parser.add_argument("--layers", type=int, default=None, help="calls per iteration (the model's layers)")
    parser.add_argument("--passes", type=int, default=2, help="rounds of the descent over the knobs")
    args = parser.parse_args(argv)
    config = MODEL_SHAPES[args.shape]
    layers = args.layers or config.num_layers
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {args.shape}, {layers} layers")
    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.projections.split(","):
            n, k, kind = projections(config)[name]
            xla_us, default_us, best, best_us = tune(n, k, kind, rows, layers, args.passes)
            table.append((name, rows, xla_us, default_us, best_us, best))
            print(
                f"  -> {name} M={rows}: XLA {xla_us:.2f}, default {default_us:.2f}, best {best_us:.2f} us", flush=True
            )
    print("\n| projection | M | XLA us | fused default us | fused best us | best / XLA | best knobs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, rows, xla_us, default_us, best_us, best in table:
        knobs = ", ".join(f"{k}={v}" for k, v in best.items())
        print(
            f"| {name} | {rows} | {xla_us:.2f} | {default_us:.2f} | {best_us:.2f} | {best_us / xla_us:.2f} | {knobs} |"
        )


if __name__ == "__main__":
    main()
