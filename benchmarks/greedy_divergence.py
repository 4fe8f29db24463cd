"""Where and why greedy speculative output departs from greedy AR output in low precision.

    python -m benchmarks.greedy_divergence --eval-dir infer/eval_sets/smollm2 [--mode longspec|pld]
        [--dtype bfloat16] [--limit 3] [--max-new-tokens 64] [--target PATH] [--draft PATH]

Lossless decoding is exact in float32 (tests/test_speculative.py). In bfloat16 the target's
logits depend on how a token is computed (alone in an AR step, or among the T tokens of a verify
forward: different matrix shapes, different rounding), so at a near-tie the two paths can pick
different tokens and the texts part from there. For each prompt this runs AR and the chosen mode in
--dtype, finds the first differing token, and scores that position with the float32 target: the gap
between its two best logits there, and which of the two tokens float32 prefers. Gaps far below the
bfloat16 rounding of the logits (about 2**-8 of their size) mean the split is rounding, not a bug.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from longspec_jax.errors import UserError


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, len of the shorter if one is a prefix of the other, or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def last_logits(generator, tokens: list[int]) -> np.ndarray:
    """The target's logits after `tokens` (one prefill)."""
    from longspec_jax.decode_kit import plan_lengths, prompt_batch

    prompt_bucket, _, cache_len = plan_lengths(len(tokens), 1)
    logits, *_ = generator.run_prefill(prompt_batch([tokens], prompt_bucket), cache_len)
    return np.asarray(logits[0], np.float64)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.greedy_divergence", description=__doc__.splitlines()[0])
    p.add_argument("--eval-dir", required=True)
    p.add_argument("--tasks", default="code_completion,summarisation")
    p.add_argument("--mode", choices=("longspec", "pld"), default="longspec")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--target")
    p.add_argument("--draft")
    args = p.parse_args(argv)
    try:
        from infer.benchmark import load_eval_sets, load_models
        from longspec_jax.generation import Generator

        _, items = load_eval_sets(args.eval_dir, args.tasks.split(","), args.limit)
        target, draft, _ = load_models(args.target, args.draft, None, args.dtype, args.mode == "longspec")
        exact_target = target if args.dtype == "float32" else load_models(args.target, None, None, "float32", False)[0]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ar = Generator(target, None, mode="ar")
    spec = Generator(target, draft, mode=args.mode)
    exact = Generator(exact_target, None, mode="ar")
    rows, equal = [], 0
    for item in items:
        prompt = item["prompt_ids"]
        a = ar.generate(prompt, max_new_tokens=args.max_new_tokens).tokens[0]
        s = spec.generate(prompt, max_new_tokens=args.max_new_tokens).tokens[0]
        i = first_difference(a, s)
        if i is None:
            equal += 1
            rows.append(f"| {item['id']} | equal | - | - | - |")
            continue
        if i >= min(len(a), len(s)):
            rows.append(f"| {item['id']} | {i} | one output ends early (EOS) | - | - |")
            continue
        logits = last_logits(exact, prompt + a[:i])
        top2 = np.sort(logits)[-2:]
        prefers = "AR" if logits[a[i]] > logits[s[i]] else args.mode if logits[s[i]] > logits[a[i]] else "tie"
        rows.append(f"| {item['id']} | {i} | {top2[1] - top2[0]:.4f} | {abs(top2[1]):.1f} | {prefers} |")
    print(f"{args.mode} vs AR, {args.dtype}, {args.max_new_tokens} new tokens: {equal} of {len(items)} equal\n")
    print("| prompt | first differing token | float32 top-2 logit gap there | top logit | float32 prefers |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
