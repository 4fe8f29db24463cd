"""Tunes the decode loop's attention kernel (rotate, attend the cache and the block, write the
block's K/V; then the split-K combine) per shape, on the GPU, by coordinate descent over its
launch parameters: block rows, key tile, cache splits, warps, pipeline stages.

The AR step (T = 1) and the verify of a tree (T = nodes) call `hybrid_attention_and_write` once per
layer. Timed here as the model calls it: inside one `fori_loop` iteration, one call per layer, each
layer with its own cache (so the caches do not sit in L2 between calls, as in the model), the caches
carried by the loop and so updated in place. The time is per layer: loop seconds / iterations /
layers. Each knob is varied alone from the best configuration so far, twice round.

    python -m benchmarks.tune_decode_attention --shape smollm2_135m --batches 1,8 --tree-sizes 1,25,69
    python -m benchmarks.tune_decode_attention --shape vicuna7b --tree-sizes 64,69 --context 32768 \
        --layers 8 --defaults-only
    python -m benchmarks.tune_decode_attention --batches 1 --tree-sizes 64,1 --capacity 8192 --splits 16,21,32
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.rope import inverse_frequencies, rope_tables
from pallas_kernels import hybrid_attention as pallas_hybrid
from pallas_kernels.reference import random_tree_mask

KNOBS = {
    "block_rows": (16, 32, 64, 128),
    "block_keys": (32, 64, 128),
    "num_splits": (None, 2, 4, 8, 16, 32, 64),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3),
}
# None: the kernel chooses for the shape (what the model runs).
DEFAULT = dict(block_rows=None, block_keys=64, num_splits=None, num_warps=None, num_stages=None)
ITERATIONS = 50


def make_inputs(config, batch: int, t: int, context: int, capacity: int, layers: int, seed: int = 0):
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    keys = jax.random.split(jax.random.key(seed), 2 * layers + 1)
    qkv = jax.random.normal(keys[0], (batch, t, hq + 2 * hkv, d), jnp.bfloat16)
    caches = tuple(jax.random.normal(k, (batch, capacity, hkv, d), jnp.bfloat16) for k in keys[1:])
    positions = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    cos, sin = rope_tables(positions, jnp.asarray(inverse_frequencies(config)))
    mask = jnp.asarray(random_tree_mask(np.random.default_rng(seed), batch, t))
    lengths = jnp.full((batch,), context, jnp.int32)
    return qkv, cos.reshape(batch, t, d // 2), sin.reshape(batch, t, d // 2), caches, lengths, mask


def layer_seconds(config, inputs, layers: int, knobs: dict) -> float:
    """Seconds per layer call of hybrid_attention_and_write with `knobs`, timed in a device loop."""
    qkv, cos, sin, caches, lengths, mask = inputs
    hq = config.num_heads

    def body(_, carry):
        caches, total = carry
        new = []
        outs = []
        for i in range(layers):
            o, k, v = pallas_hybrid.hybrid_attention_and_write(
                qkv, cos, sin, caches[2 * i], caches[2 * i + 1], lengths, mask, num_heads=hq, **knobs
            )
            new += [k, v]
            outs.append(o[:, :1, :1, :1].astype(jnp.float32))
        return tuple(new), total + sum(outs)

    @jax.jit
    def run(caches):
        return jax.lax.fori_loop(0, ITERATIONS, body, (caches, jnp.zeros((qkv.shape[0], 1, 1, 1), jnp.float32)))

    caches, _ = jax.block_until_ready(run(caches))  # compile and warm up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        caches, total = run(caches)
        jax.block_until_ready(total)
        best = min(best, time.perf_counter() - start)
    return best / ITERATIONS / layers


def tune(
    config,
    batch: int,
    t: int,
    context: int,
    layers: int,
    log=print,
    search: bool = True,
    verbose: bool = False,
    capacity: int | None = None,
) -> tuple[dict, float, float]:
    """(best knobs, its us per layer, the default's us per layer) at one shape; search=False times
    the default alone, verbose logs every trial (not only the improvements)."""
    capacity = capacity or context + 512
    inputs = make_inputs(config, batch, t, context, capacity, layers)
    seen: dict[tuple, float] = {}

    def measure(knobs):
        key = tuple(sorted(knobs.items(), key=lambda kv: kv[0]))
        if key not in seen:
            try:
                seen[key] = layer_seconds(config, inputs, layers, knobs) * 1e6
            except Exception as err:  # a configuration the compiler refuses (shared memory, registers)
                log(f"    {knobs}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
                seen[key] = float("inf")
        return seen[key]

    best = dict(DEFAULT)
    default_us = best_us = measure(best)
    log(f"  B={batch} T={t}: default {default_us:.2f} us/layer")
    for _, (name, values) in itertools.product(range(2 if search else 0), KNOBS.items()):
        for value in values:
            trial = {**best, name: value}
            us = measure(trial)
            if verbose:
                log(f"    {name}={value}: {us:.2f} us/layer")
            if us < best_us:
                best, best_us = trial, us
                log(f"    {name}={value}: {us:.2f} us/layer (best so far)")
    return best, best_us, default_us


def sweep_splits(config, args, layers: int, capacity: int, log=print) -> None:
    """Times the default launch with each of args.splits cache splits (and the kernel's own
    choice), at every batch and tree size, one process, the same inputs for each count."""
    counts = [None, *(int(s) for s in args.splits.split(","))]
    log("\n| B | T | splits | us/layer |\n| ---: | ---: | --- | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        for t in (int(x) for x in args.tree_sizes.split(",")):
            inputs = make_inputs(config, batch, t, args.context, capacity, layers)
            for count in counts:
                us = layer_seconds(config, inputs, layers, {**DEFAULT, "num_splits": count}) * 1e6
                log(f"| {batch} | {t} | {'default' if count is None else count} | {us:.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tree-sizes", default="1,25,69", help="T: 1 is the AR step, more a verified tree")
    parser.add_argument("--context", type=int, default=4500, help="cache rows already held")
    parser.add_argument(
        "--capacity", type=int, default=None, help="cache rows (context + 512; the decode loop's is a power of two)"
    )
    parser.add_argument("--layers", type=int, default=None, help="layer calls per iteration (the model's)")
    parser.add_argument("--defaults-only", action="store_true", help="time the launch the model uses, no search")
    parser.add_argument("--verbose", action="store_true", help="print every trial, not only the improvements")
    parser.add_argument(
        "--splits",
        help="instead of the search, time the default launch with each of these cache split counts, e.g. 16,21,32",
    )
    args = parser.parse_args(argv)
    config = MODEL_SHAPES[args.shape]
    layers = args.layers or config.num_layers
    capacity = args.capacity or args.context + 512
    device = f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
    print(f"{device}; {args.shape}, context {args.context} of {capacity} rows")
    if args.splits:
        sweep_splits(config, args, layers, capacity)
        return
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for t in (int(x) for x in args.tree_sizes.split(",")):
            best, best_us, default_us = tune(
                config,
                batch,
                t,
                args.context,
                layers,
                search=not args.defaults_only,
                verbose=args.verbose,
                capacity=capacity,
            )
            rows.append((batch, t, default_us, best_us, best))
    print(
        "\n| B | T | default us/layer | best us/layer | gain | best knobs |\n| ---: | ---: | ---: | ---: | ---: | --- |"
    )
    for batch, t, default_us, best_us, best in rows:
        knobs = ", ".join(f"{k}={v}" for k, v in best.items())
        print(f"| {batch} | {t} | {default_us:.2f} | {best_us:.2f} | {default_us / best_us:.2f}x | {knobs} |")


if __name__ == "__main__":
    main()
