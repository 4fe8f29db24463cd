"""AR decode speed of a 7B-shaped random-weight target against its memory floor (GPU).

    python -m benchmarks.bench_decode                  # Vicuna-7B shape, bf16, contexts 4k and 32k, xla + cudnn
    python -m benchmarks.bench_decode --small          # tiny config on CPU: a smoke test of this script

For each attention implementation and context S it times `decode_loop.decode` in mode ar (the
on-device while_loop that `generate` uses) over --steps steps with S tokens already in the cache,
and the same step as its own jitted program chained from the host (`round_profile.one_round`):
docs/GPU_NOTES.md says a step inside the device loop must cost about the same as alone (stacked
layers did not; ours are unrolled). The floor of a step is (weight bytes + KV bytes of S tokens) / bandwidth, with the
bandwidth measured in the same run by a large device-to-device elementwise copy (bytes read +
written). The table comes last.

The cache rows hold zeros: dense attention and matmul cost do not depend on the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.config import ModelConfig
from longspec_jax.decode_kit import StopRule, bucket_length, cache_bytes, compiled, timed
from longspec_jax.decode_loop import LoopConfig, decode, start, started
from longspec_jax.model import init_cache
from longspec_jax.model_shapes import timing_shape
from longspec_jax.proposers import NoProposal
from longspec_jax.round_profile import one_round
from longspec_jax.sampling import SamplingParams
from longspec_jax.target import random_target

VICUNA_7B = timing_shape("vicuna7b", 65536)
TINY = ModelConfig(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
LOOP_VS_ALONE_TOLERANCE = 1.15  # loop step / alone step above this is worth a look


@dataclasses.dataclass
class Row:
    impl: str
    context: int
    loop_ms: float = float("nan")
    alone_ms: float = float("nan")
    floor_ms: float = float("nan")
    error: str = ""


def measure_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of an elementwise pass over a float32 buffer, counting bytes read + written."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    bump = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(bump(x))
    seconds = statistics.median(timed(bump, x)[1] for _ in range(repeats))
    return 2 * x.size * 4 / seconds


def bench_one(
    target, graphdef, params, *, impl: str, context: int, batch: int, steps: int, repeats: int
) -> tuple[float, float]:
    """(ms per step inside the device loop, ms per step as its own jitted program)."""
    config = target.config
    cache = init_cache(config, batch, context + bucket_length(2 * steps + 2), target.dtype)
    at_context = lambda: jnp.full((batch,), context, jnp.int32)  # fresh each time: the cache is donated
    sampling = SamplingParams.create(0.0)
    # No EOS and a limit the loop never reaches: every run makes exactly `steps` steps.
    stop = StopRule.create((), 2 * steps + 2)
    new_bucket = bucket_length(2 * steps + 2)
    last_logits = jnp.zeros((batch, config.vocab_size), jnp.float32)
    loop = LoopConfig(graphdef, NoProposal(), new_bucket, impl)
    start_args = lambda cache: (  # noqa: E731
        params,
        (),
        cache.replace(lengths=at_context()),
        jnp.zeros((batch, 1), jnp.int32),
        jnp.ones((batch,), jnp.int32),
        last_logits,
        sampling,
        jax.random.key(0),
        stop,
    )
    run_start, _ = compiled(start, *start_args(cache), config=loop)
    state = started(run_start, *start_args(cache))
    stop_at = jnp.asarray(steps, jnp.int32)
    run_decode, _ = compiled(decode, params, (), state, stop_at, sampling, config=loop)
    single, _ = compiled(one_round, params, (), state, sampling, config=loop)

    loop_s = []
    for _ in range(repeats + 1):  # the first run warms up
        state, s = timed(run_decode, params, (), state, stop_at, sampling)
        loop_s.append(s / steps)
        state = started(run_start, *start_args(state.cache))
    alone_s = []
    for _ in range(steps + 1):
        state, s = timed(single, params, (), state, sampling)
        alone_s.append(s)
    return 1e3 * statistics.median(loop_s[1:]), 1e3 * statistics.median(alone_s[1:])


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny config on CPU (smoke test)")
    p.add_argument("--contexts", help="comma-separated context lengths (default 4096,32768; --small 32,64)")
    p.add_argument("--impls", help="attention implementations (default xla,cudnn; --small xla)")
    p.add_argument("--steps", type=int, help="decode steps per timing (default 64; --small 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up")
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    config, dtype = (TINY, "float32") if args.small else (VICUNA_7B, "bfloat16")
    contexts = [int(c) for c in (args.contexts or ("32,64" if args.small else "4096,32768")).split(",")]
    impls = (args.impls or ("xla" if args.small else "xla,cudnn")).split(",")
    steps = args.steps or (3 if args.small else 64)
    copy_bytes = 2**24 if args.small else 2**32

    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | {jax.devices()[0].device_kind} "
        f"| jax {jax.__version__}"
    )
    bandwidth = measure_bandwidth(copy_bytes, max(args.repeats, 3))
    print(f"bandwidth (elementwise pass over {copy_bytes / 2**30:.2f} GiB, read + write): {bandwidth / 1e9:.0f} GB/s")
    t0 = time.perf_counter()
    target = random_target(config, dtype=dtype)
    graphdef, params = nnx.split(target.model)
    jax.block_until_ready(params)
    weight_bytes = cache_bytes(params)
    print(
        f"target {config.num_layers} layers, hidden {config.hidden_size}, {dtype}: "
        f"{weight_bytes / 1e9:.2f} GB of weights "
        f"(random, built in {time.perf_counter() - t0:.0f} s)"
    )

    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
    rows = []
    for impl in impls:
        for context in contexts:
            row = Row(
                impl, context, floor_ms=1e3 * (weight_bytes + args.batch * context * kv_bytes_per_token) / bandwidth
            )
            try:
                row.loop_ms, row.alone_ms = bench_one(
                    target,
                    graphdef,
                    params,
                    impl=impl,
                    context=context,
                    batch=args.batch,
                    steps=steps,
                    repeats=args.repeats,
                )
            except Exception as e:  # an implementation missing on this backend is a row, not a crash
                row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            rows.append(row)

    print(
        f"\nAR decode, batch {args.batch}, {steps} steps per timing, median of {args.repeats}; "
        "floor = (weights + KV) / bandwidth"
    )
    print(
        f"{'impl':<7}{'context':>8}{'ms/step':>10}{'tok/s':>9}{'floor ms':>10}{'floor/step':>11}"
        f"{'alone ms':>10}{'loop/alone':>11}"
    )
    for r in rows:
        if r.error:
            print(f"{r.impl:<7}{r.context:>8}  unavailable: {r.error}")
            continue
        ratio = r.loop_ms / r.alone_ms
        flag = "  <- loop slower than a step alone" if ratio > LOOP_VS_ALONE_TOLERANCE else ""
        print(
            f"{r.impl:<7}{r.context:>8}{r.loop_ms:>10.3f}{1e3 * args.batch / r.loop_ms:>9.1f}{r.floor_ms:>10.3f}"
            f"{r.floor_ms / r.loop_ms:>11.2f}{r.alone_ms:>10.3f}{ratio:>11.2f}{flag}"
        )
    return rows


if __name__ == "__main__":
    main()
