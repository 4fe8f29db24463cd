"""What one host call of the decode loop costs besides its rounds, and how mode auto spends its calls.

The host driver runs the device loop in calls of several rounds and reads the progress back in
between (streaming, Ctrl-C). Each call costs something on top of its rounds (argument handling,
launch, the read). This script decodes 128 tokens of a 2,500-token random prompt with SmolLM2's
shape and random weights (bfloat16), AR with streaming every 1, 4, 16 and 64 tokens (so the loop
runs in calls of that many rounds), and prints the median milliseconds per call; the fixed part
of a call is what a 1-round call costs beyond a round. Then mode auto, greedy and sampled, with
every call it made (`stats.runs`: what, rounds, ms).

    python -m benchmarks.loop_call_cost            # on the GPU
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m benchmarks.loop_call_cost   # without command buffers
"""

from __future__ import annotations

import argparse
import statistics

import jax.numpy as jnp
import numpy as np

from longspec_jax.draft_io import init_draft
from longspec_jax.generation import Generator
from longspec_jax.model_shapes import MODEL_SHAPES
from longspec_jax.target import random_target


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(MODEL_SHAPES))
    args = parser.parse_args(argv)
    target = random_target(MODEL_SHAPES[args.shape], seed=0, dtype="bfloat16")
    draft = init_draft(target, seed=1).cast(jnp.bfloat16)
    prompt = np.random.default_rng(0).integers(100, 1000, size=args.prompt_tokens).tolist()

    ar = Generator(target, mode="ar")
    for every in (1, 4, 16, 64):
        for _ in range(2):  # the first compiles
            result = ar.generate(
                [prompt], max_new_tokens=args.new_tokens, profile=True, stream=lambda _: None, stream_every=every
            )
        calls = [r for r in result.stats.runs if r["what"] != "start"]
        inner = calls[1:-1] or calls  # the last call is usually short
        ms = statistics.median(c["ms"] for c in inner)
        print(
            f"ar, a call every {every} tokens: {len(calls)} calls, median {ms:.3f} ms for {inner[0]['rounds']} "
            f"rounds; {result.stats.tokens_per_s:.0f} tokens/s"
        )
    auto = Generator(target, draft, mode="auto")
    for temperature in (0.0, 1.0):
        for seed in range(2):
            result = auto.generate(
                [prompt], max_new_tokens=args.new_tokens, temperature=temperature, profile=True, seed=seed
            )
        calls = " ".join(f"{r['what']}:{r['rounds']}:{r['ms']:.2f}" for r in result.stats.runs)
        print(f"auto T={temperature:g}: {result.stats.tokens_per_s:.0f} tokens/s, calls (what:rounds:ms) {calls}")


if __name__ == "__main__":
    main()
