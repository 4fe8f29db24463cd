"""How one-token matrix-vector products compile: kernels and time of a chain of SmolLM2-sized layers.

    python -m benchmarks.matvec_layouts [--layers 30] [--repeats 200]

At batch 1 a decode step multiplies one row by every weight matrix. XLA may rewrite such a small
dot into an elementwise product plus a reduction, and whether the product is fused into the
reduction decides whether the step reads each weight once or writes and reads a weight-sized
temporary. Each variant runs `--layers` layers of (RMSNorm, x @ W_qkv, x @ W_o, RMSNorm,
x @ W_gate_up, silu * up, x @ W_down) inside one `lax.fori_loop` of steps and prints the kernels
of the loop body and the time per step against the weights' floor at the rates measured in the
same run (`floors.measure_rates`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import floors
from benchmarks.decode_kernels import loop_body_kernels

HIDDEN, QKV, FFN = 576, 960, 1536


def rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype)


def layer_kn(x, w):
    """Weights [K, N], x [M, K]: x @ W."""
    h = rms(x) @ w["qkv"]
    x = x + h[:, :HIDDEN] @ w["o"]
    gu = rms(x) @ w["gate_up"]
    return x + (jax.nn.silu(gu[:, :FFN]) * gu[:, FFN:]) @ w["down"]


def layer_nk(x, w):
    """Weights stored transposed [N, K]: contract the minor dimension of both."""
    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())))
    h = dot(rms(x), w["qkv"])
    x = x + dot(h[:, :HIDDEN], w["o"])
    gu = dot(rms(x), w["gate_up"])
    return x + dot(jax.nn.silu(gu[:, :FFN]) * gu[:, FFN:], w["down"])


def layer_nk_multiply_reduce(x, w):
    """[N, K] weights, each product written as an elementwise product and a float32 sum over K, so
    XLA emits a reduction (fusable with its neighbours) instead of a GEMM for every row count."""
    dot = lambda a, b: jnp.sum(a[:, None, :].astype(jnp.float32) * b[None].astype(jnp.float32), -1).astype(a.dtype)
    h = dot(rms(x), w["qkv"])
    x = x + dot(h[:, :HIDDEN], w["o"])
    gu = dot(rms(x), w["gate_up"])
    return x + dot(jax.nn.silu(gu[:, :FFN]) * gu[:, FFN:], w["down"])


def layer_f32_accumulate(x, w):
    """[K, N] weights, products accumulated in float32 (preferred_element_type)."""
    dot = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    h = dot(rms(x), w["qkv"])
    x = x + dot(h[:, :HIDDEN], w["o"])
    gu = dot(rms(x), w["gate_up"])
    return x + dot(jax.nn.silu(gu[:, :FFN]) * gu[:, FFN:], w["down"])


VARIANTS = {
    "kn": ("W [K, N]", layer_kn, False),
    "nk": ("W [N, K]", layer_nk, True),
    "kn_f32": ("W [K, N], f32 accumulate", layer_f32_accumulate, False),
    "nk_reduce": ("W [N, K], multiply-reduce", layer_nk_multiply_reduce, True),
}


def weights(key, layers, transposed):
    shapes = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}
    out = []
    for i in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, i), len(shapes))
        out.append(
            {
                name: 0.02 * jax.random.normal(k, shape[::-1] if transposed else shape, jnp.bfloat16)
                for k, (name, shape) in zip(ks, shapes.items())
            }
        )
    return out


def run(name, layer, transposed, rows, layers, repeats, rates):
    params = weights(jax.random.key(0), layers, transposed)

    @jax.jit
    def steps(params, x, n):
        def body(_, x):
            for w in params:
                x = layer(x, w)
            return x

        return jax.lax.fori_loop(0, n, body, x)

    x = jax.random.normal(jax.random.key(1), (rows, HIDDEN), jnp.bfloat16)
    n = jnp.asarray(repeats, jnp.int32)
    compiled = steps.lower(params, x, n).compile()
    kernels = loop_body_kernels(compiled.as_text())
    jax.block_until_ready(compiled(params, x, n))
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, x, n))
        seconds.append((time.perf_counter() - start) / repeats)
    step = statistics.median(seconds)
    weights_read = [v for w in params for v in w.values()]
    nbytes = sum(v.nbytes for v in weights_read)
    floor = rates.seconds(nbytes, 2 * rows * sum(v.size for v in weights_read))
    print(f"{name:>24} rows {rows}: {kernels:4d} kernels/step, {1e3 * step:.3f} ms/step, {step / floor:5.1f}x floor")
    return {"variant": name, "rows": rows, "kernels": kernels, "ms": 1e3 * step, "x_floor": step / floor}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rows", default="1,2", help="comma-separated row counts (tokens x batch)")
    parser.add_argument("--variants", default="kn,nk,kn_f32", help="comma-separated: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    rates = floors.measure_rates()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; memory {rates.bandwidth / 1e9:.0f} GB/s")
    variants = [VARIANTS[v] for v in args.variants.split(",")]
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, layer, transposed in variants:
            rows.append(run(name, layer, transposed, m, args.layers, args.repeats, rates))
    return rows


if __name__ == "__main__":
    main()
