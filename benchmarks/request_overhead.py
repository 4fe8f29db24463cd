"""What a request costs besides its rounds, and what calling a compiled program costs.

Part 1, per mode and batch size: `decode_s` at two max_new_tokens values in one output bucket
(130 and 256 by default). The slope is what a round costs at the margin, the intercept what a
request costs besides its rounds (start, loop calls, reads); mode auto also prints the costs its
calibration measured, to compare with the slopes. Random weights (a model's shape, a random draft)
and a random prompt: costs, not acceptance.

Part 2: one compiled call with many argument leaves (weights, a donated cache, a while loop of a
few tiny rounds), to see what the number of buffers a call passes costs.

    python -m benchmarks.request_overhead [--shape smollm2_135m] [--prompt-tokens 2500]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax import generation
from longspec_jax.draft_io import init_draft
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.target import random_target


def length_points(gen, prompts, new_tokens, repeats: int, **request) -> tuple[list[dict], Any]:
    """The request timed `repeats` times at each length of `new_tokens` -> ([{"rounds", "decode_s",
    "wall_s", "before_loop_s"} per length: the last run's rounds, median seconds], the last result).
    wall_s: host time outside decode and prefill; before_loop_s: the part of decode_s before the
    loop's first call (the start program's dispatch; it is not waited for, so its device time shows
    in the loop call)."""
    points = []
    for n in new_tokens:
        decode, wall, before_loop = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            result = gen.generate(prompts, max_new_tokens=n, **request)
            wall.append(time.perf_counter() - start - result.stats.decode_s - result.stats.prefill_s)
            decode.append(result.stats.decode_s)
            in_loop = sum(r["ms"] for r in result.stats.runs if r["what"] == "loop") / 1e3
            before_loop.append(result.stats.decode_s - in_loop)
        points.append(
            {
                "rounds": result.stats.rounds,
                "decode_s": statistics.median(decode),
                "wall_s": statistics.median(wall),
                "before_loop_s": statistics.median(before_loop),
            }
        )
    return points, result


def marginal_round_s(points: list[dict]) -> float:
    """Seconds a round adds between the first and the last of `length_points`' lengths."""
    first, last = points[0], points[-1]
    return (last["decode_s"] - first["decode_s"]) / max(last["rounds"] - first["rounds"], 1)


def per_request(target, draft, prompt_tokens: int, batch: int, mode: str, new_tokens=(130, 256), repeats=3) -> dict:
    """{"round_ms", "fixed_ms", "before_loop_ms", "wall_extra_ms", "calibrated_ms"} of one mode at one
    batch size (`length_points` at the shortest length, the slope between the two)."""
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    prompts = [rng.integers(10, vocab - 1, prompt_tokens).tolist() for _ in range(batch)]
    gen = generation.Generator(target, draft, mode=mode)
    gen.generate(prompts, max_new_tokens=max(new_tokens), eos_token_ids=())  # compile (and calibrate)
    points, result = length_points(gen, prompts, new_tokens, repeats, eos_token_ids=())
    slope, shortest = marginal_round_s(points), points[0]
    policy = result.stats.policy.get("candidates", {}) if result.stats.policy else {}
    return {
        "round_ms": 1e3 * slope,
        "fixed_ms": 1e3 * (shortest["decode_s"] - shortest["rounds"] * slope),
        "before_loop_ms": 1e3 * shortest["before_loop_s"],
        "wall_extra_ms": 1e3 * shortest["wall_s"],
        "calibrated_ms": {name: c["ms_per_round"] for name, c in policy.items()},
    }


def per_call(weight_leaves: int, cache_leaves: int, rounds: int, repeats: int = 50) -> float:
    """Median ms of one call of a while loop of `rounds` tiny rounds that takes `weight_leaves`
    small weight arrays and donates `cache_leaves` cache-shaped arrays."""
    weights = [jnp.full((576, 576), 0.001, jnp.bfloat16) for _ in range(weight_leaves)]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(weights, cache, n):
        def body(s):
            i, cache = s
            return i + 1, [c.at[0, i, 0, 0].set(weights[0].reshape(-1)[0]) for c in cache]

        return jax.lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(0), cache))[1]

    cache = [jnp.zeros((1, 4096, 3, 64), jnp.bfloat16) for _ in range(cache_leaves)]
    n = jnp.int32(rounds)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        cache = jax.block_until_ready(loop(weights, cache, n))
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds[repeats // 10 :])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--modes", default="ar,auto,longspec,pld", help="longspec and pld run at batch 1 only")
    parser.add_argument("--new-tokens", default="130,256", help="two values in one output bucket")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a tiny model and few arguments (tests)")
    args = parser.parse_args(argv)
    if args.small:
        from benchmarks.decode_kernels import SMALL_CONFIG

        args.prompt_tokens, calls = 100, ((4, 4, 0), (4, 4, 1))
    else:
        calls = ((270, 60, 0), (270, 60, 1), (1, 60, 1), (270, 2, 1))
    config = SMALL_CONFIG if args.small else MODEL_SHAPES[args.shape]
    target = random_target(config, seed=0, dtype="bfloat16")
    draft = init_draft(target, seed=1).cast(jnp.bfloat16)
    new_tokens = tuple(int(n) for n in args.new_tokens.split(","))
    shape = "small" if args.small else args.shape
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}; {shape}, random weights, {args.prompt_tokens}-token prompt")
    report = {"requests": [], "calls": []}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for mode in args.modes.split(","):
            if batch > 1 and mode in ("longspec", "pld"):
                continue
            r = per_request(target, draft, args.prompt_tokens, batch, mode, new_tokens, args.repeats)
            report["requests"].append({"batch": batch, "mode": mode, **r})
            calibrated = ", ".join(f"{k} {v:.3f}" for k, v in r["calibrated_ms"].items())
            print(
                f"batch {batch} {mode}: {r['round_ms']:.3f} ms a round, {r['fixed_ms']:.2f} ms a request besides "
                f"(decode_s; {r['before_loop_ms']:.2f} before the loop's call), "
                f"{r['wall_extra_ms']:.2f} ms of host time outside it"
                + (f"; calibrated ms a round: {calibrated}" if calibrated else ""),
                flush=True,
            )
    for weights, cache, rounds in calls:
        ms = per_call(weights, cache, rounds)
        report["calls"].append({"weights": weights, "cache": cache, "rounds": rounds, "ms": ms})
        print(f"one call, {weights} weight and {cache} cache arguments, {rounds} rounds: {ms:.3f} ms", flush=True)
    return report


if __name__ == "__main__":
    main()
