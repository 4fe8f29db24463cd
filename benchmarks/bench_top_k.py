"""The draft tree's top-k over the vocabulary: one `jax.lax.top_k` against `tree.vocab_top_k`.

Each level of a draft tree takes the top-k tokens of every node's distribution over the whole
vocabulary. This times, for SmolLM2's 49,152-token vocabulary, rows (batch x nodes) of 1 to 64
and k = 4 and 16: jax.lax.top_k, jax.lax.approx_max_k, the project's vocab_top_k (two stages at
few rows), and an argmax as the floor of one pass over the scores. Each figure is the mean of
--repeats calls of one jitted function issued back to back (dispatch included, so a kernel's own
time is roughly the figure less the argmax's).

    python -m benchmarks.bench_top_k [--vocab 128256]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from longspec_jax.tree import vocab_top_k


def mean_us(fn, x, repeats: int) -> float:
    jax.block_until_ready(fn(x))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}; vocabulary {args.vocab}; us per call")
    print("rows  k  lax.top_k  approx_max_k  vocab_top_k  argmax")
    for rows in (1, 4, 16, 64):
        x = jax.random.normal(jax.random.key(0), (rows, args.vocab), jnp.float32)
        for k in (4, 16):
            times = [
                mean_us(jax.jit(lambda x, k=k: jax.lax.top_k(x, k)), x, args.repeats),
                mean_us(jax.jit(lambda x, k=k: jax.lax.approx_max_k(x, k)), x, args.repeats),
                mean_us(jax.jit(lambda x, k=k: vocab_top_k(x, k)), x, args.repeats),
                mean_us(jax.jit(lambda x: jnp.argmax(x, -1)), x, args.repeats),
            ]
            print(f"{rows:4d} {k:2d} " + " ".join(f"{t:10.1f}" for t in times))


if __name__ == "__main__":
    main()
