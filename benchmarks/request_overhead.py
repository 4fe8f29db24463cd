"""What a request costs besides its rounds, and what calling a compiled program costs.

Part 1, per mode and batch size: `decode_s` at two max_new_tokens values in one output bucket
(130 and 256 by default). The slope is what a round costs at the margin, the intercept what a
request costs besides its rounds (start, loop calls, reads); mode auto also prints the costs its
calibration measured, to compare with the slopes. By default random weights (a model's shape, a
random draft) and a random prompt: costs, not acceptance. With --target (and --draft, --prompts)
a real model decodes a prompt of an eval set, at --temperature with a fixed seed, so that two modes
that keep the same tokens a round (mode auto running one tree, and that tree as a fixed mode) can be
told apart by what they cost a round and a request. A mode is any of infer.benchmark's --modes
entries (ar, auto, pld, longspec, longspec:4-4-4, ...).

Per mode it also times the host driver's steps of a request (`driver_steps`: the prefill call,
mode auto's calibration lookup and policy set-up, each read of the progress back), since what a
request costs besides its rounds is mostly such host work.

Part 2: the host time a call spends flattening the target's parameters (Generator passes them as
plain nested dicts: an nnx.State's Variable nodes flatten through Python, ~1-2 us an array); and,
random weights only, one compiled call with many argument leaves (weights, a donated cache, a while
loop of a few tiny rounds), to see what the number of buffers a call passes costs, and the same
cache read but not donated, as the loop's start program now takes it.

    python -m benchmarks.request_overhead [--shape smollm2_135m] [--prompt-tokens 2500]
    python -m benchmarks.request_overhead --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft longspec_jax/drafts/smollm2_135m --prompts infer/eval_sets/smollm2/code_completion.jsonl \\
        --temperature 1 --modes auto,longspec:4-4-4,ar --batch-sizes 1 --repeats 5 --warm-up 6
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax import generation
from longspec_jax.draft_io import init_draft
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.target import random_target

DRIVER_STEPS = ("run_prefill", "kept_costs", "policy_setup", "calibrated", "with_remembered", "read")


@contextlib.contextmanager
def driver_steps():
    """Within it every call of the generation driver's steps (DRIVER_STEPS) is timed: yields
    {step: [milliseconds of each call]}."""
    times = {name: [] for name in DRIVER_STEPS}

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name].append(1e3 * (time.perf_counter() - start))

        return call

    owners = {
        "run_prefill": generation.Generator,
        "kept_costs": generation,
        "policy_setup": generation,
        "calibrated": generation,
        "with_remembered": generation,
        "read": generation._Progress,
    }
    originals = {name: vars(owners[name]).get(name) for name in DRIVER_STEPS}
    originals = {name: fn for name, fn in originals.items() if fn is not None}  # a stand-in Generator lacks some
    try:
        for name, fn in originals.items():
            if isinstance(fn, classmethod):
                setattr(owners[name], name, classmethod(timed(name, fn.__func__)))
            else:
                setattr(owners[name], name, timed(name, fn))
        yield times
    finally:
        for name, original in originals.items():
            setattr(owners[name], name, original)


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


def random_prompt(vocab_size: int, prompt_tokens: int) -> list[int]:
    return np.random.default_rng(0).integers(10, vocab_size - 1, prompt_tokens).tolist()


def per_request(
    target,
    draft,
    prompts,
    mode: str,
    new_tokens=(130, 256),
    repeats=3,
    *,
    widths=None,
    lookup: int | None = None,
    warm_up: int = 1,
    **request,
) -> dict:
    """{"round_ms", "fixed_ms", "before_loop_ms", "wall_extra_ms", "calibrated_ms", "driver_steps_ms"} of one mode (and
    tree `widths`, with a prompt-lookup chain of `lookup` tokens beside it: None the mode's default) on
    `prompts` (`length_points` at the shortest length, the slope between the
    two). warm_up: untimed requests first (compiles and calibrates; a GPU builds its graphs over a
    process's first calls). request: generate's sampling settings (temperature, seed)."""
    gen = generation.Generator(target, draft, mode=mode, tree_widths=widths, lookup_tokens=lookup)
    for _ in range(warm_up):
        gen.generate(prompts, max_new_tokens=max(new_tokens), eos_token_ids=(), **request)
    with driver_steps() as steps:
        length_points(gen, prompts, new_tokens[:1], repeats, eos_token_ids=(), **request)
    points, result = length_points(gen, prompts, new_tokens, repeats, eos_token_ids=(), **request)
    slope, shortest = marginal_round_s(points), points[0]
    policy = result.stats.policy.get("candidates", {}) if result.stats.policy else {}
    return {
        "round_ms": 1e3 * slope,
        "fixed_ms": 1e3 * (shortest["decode_s"] - shortest["rounds"] * slope),
        "before_loop_ms": 1e3 * shortest["before_loop_s"],
        "wall_extra_ms": 1e3 * shortest["wall_s"],
        "calibrated_ms": {name: c["ms_per_round"] for name, c in policy.items()},
        "rounds": [p["rounds"] for p in points],
        # per request: each step's calls summed, the mean over the timed requests
        "driver_steps_ms": {name: sum(times) / repeats for name, times in steps.items() if times},
    }


def per_call(
    weight_leaves: int, cache_leaves: int, rounds: int, repeats: int = 50, *, read_only: bool = False
) -> float:
    """Median ms of one call of a while loop of `rounds` tiny rounds that takes `weight_leaves`
    small weight arrays and donates `cache_leaves` cache-shaped arrays, writing a row of each and
    returning them (read_only: reads a row of each, returns one scalar, donates nothing, as the
    loop's start program treats the target's cache)."""
    weights = [jnp.full((576, 576), 0.001, jnp.bfloat16) for _ in range(weight_leaves)]

    @functools.partial(jax.jit, donate_argnums=() if read_only else (1,))
    def loop(weights, cache, n):
        def body(s):
            i, cache, total = s
            if read_only:
                return i + 1, cache, total + sum(c[0, i, 0, 0].astype(jnp.float32) for c in cache)
            return i + 1, [c.at[0, i, 0, 0].set(weights[0].reshape(-1)[0]) for c in cache], total

        _, cache, total = jax.lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(0), cache, jnp.float32(0)))
        return total if read_only else cache

    cache = [jnp.zeros((1, 4096, 3, 64), jnp.bfloat16) for _ in range(cache_leaves)]
    n = jnp.int32(rounds)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(loop(weights, cache, n))
        cache = cache if read_only else out
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds[repeats // 10 :])


def flatten_ms(tree, repeats: int = 200) -> float:
    """Median host milliseconds to flatten `tree`, which every call of a compiled program does to
    its arguments."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.tree.flatten(tree)
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--prompt-tokens", type=int, default=2500, help="the random prompt's length")
    parser.add_argument("--target", help="a real target (.gguf or HF directory) instead of random weights")
    parser.add_argument("--draft", help="its draft (default: the one shipped for it)")
    parser.add_argument("--prompts", type=Path, help="with --target: an eval set's .jsonl (default: a random prompt)")
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="every timed request's seed")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument(
        "--modes",
        default="ar,auto,longspec,pld",
        help="infer.benchmark's --modes entries; pld and longspec at batch 1 only",
    )
    parser.add_argument("--new-tokens", default="130,256", help="two values in one output bucket")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-up", type=int, default=1, help="untimed requests per mode and batch size first")
    parser.add_argument("--small", action="store_true", help="a tiny model and few arguments (tests)")
    args = parser.parse_args(argv)
    from infer.benchmark import lookup_tokens, parse_mode_spec

    modes = [(spec, *parse_mode_spec(spec), lookup_tokens(spec)) for spec in args.modes.split(",")]
    if args.target:
        from longspec_jax.draft_io import inference_draft
        from longspec_jax.target import load_target

        target = load_target(args.target, dtype="bfloat16")
        draft = inference_draft(target, args.draft)
        shape, calls = args.target, ()
    else:
        if args.small:
            from benchmarks.decode_kernels import SMALL_CONFIG

            args.prompt_tokens, calls = 100, ((4, 4, 0, False), (4, 4, 1, False), (4, 4, 1, True))
        else:
            calls = (
                (270, 60, 0, False),
                (270, 60, 1, False),
                (1, 60, 1, False),
                (270, 2, 1, False),
                (270, 60, 1, True),
            )
        target = random_target(SMALL_CONFIG if args.small else MODEL_SHAPES[args.shape], seed=0, dtype="bfloat16")
        draft = init_draft(target, seed=1).cast(jnp.bfloat16)
        shape = f"{'small' if args.small else args.shape}, random weights"
    if args.prompts:
        from benchmarks.decode_kernels import eval_prompt

        prompt = eval_prompt(args.prompts, args.prompt_index)
        what = f"{args.prompts.stem}[{args.prompt_index}], {len(prompt)} tokens"
    else:
        prompt = random_prompt(target.config.vocab_size, args.prompt_tokens)
        what = f"a random {args.prompt_tokens}-token prompt"
    new_tokens = tuple(int(n) for n in args.new_tokens.split(","))
    request = {"temperature": args.temperature, "seed": args.seed}
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}; {shape}; {what}; T = {args.temperature:g}")
    report = {"requests": [], "calls": []}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for spec, mode, widths, lookup in modes:
            if batch > 1 and mode in ("longspec", "pld"):
                continue
            r = per_request(
                target,
                draft if mode in ("longspec", "auto") else None,
                [prompt] * batch,
                mode,
                new_tokens,
                args.repeats,
                widths=widths,
                lookup=lookup,
                warm_up=args.warm_up,
                **request,
            )
            report["requests"].append({"batch": batch, "mode": spec, **r})
            calibrated = ", ".join(f"{k} {v:.3f}" for k, v in r["calibrated_ms"].items())
            print(
                f"batch {batch} {spec}: {r['round_ms']:.3f} ms a round, {r['fixed_ms']:.2f} ms a request besides "
                f"(decode_s; {r['before_loop_ms']:.2f} before the loop's call), "
                f"{r['wall_extra_ms']:.2f} ms of host time outside it; rounds {r['rounds']}"
                + (f"; calibrated ms a round: {calibrated}" if calibrated else "")
                + "; driver steps, ms a request: "
                + ", ".join(f"{k} {v:.3f}" for k, v in r["driver_steps_ms"].items()),
                flush=True,
            )
    state = nnx.state(target.decode_model())
    report["flatten_ms"] = {"nnx.State": flatten_ms(state), "plain dicts": flatten_ms(nnx.to_pure_dict(state))}
    print(
        f"flattening the target's {len(jax.tree.leaves(state))} parameter arrays, as a call does: "
        + ", ".join(f"{kind} {ms:.3f} ms" for kind, ms in report["flatten_ms"].items()),
        flush=True,
    )
    for weights, cache, rounds, read_only in calls:
        ms = per_call(weights, cache, rounds, read_only=read_only)
        report["calls"].append({"weights": weights, "cache": cache, "rounds": rounds, "read_only": read_only, "ms": ms})
        how = "read, not donated" if read_only else "donated and returned"
        print(
            f"one call, {weights} weight and {cache} cache arguments ({how}), {rounds} rounds: {ms:.3f} ms", flush=True
        )
    return report


if __name__ == "__main__":
    main()
