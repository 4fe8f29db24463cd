"""Where one real request's GPU time goes, in mode auto and with a fixed tree: kernel busy time
against the span, and the largest idle gaps between kernels.

Decodes one prompt of an eval set (infer.build_eval_sets) with a real target and draft a few times
to warm up, then once under `jax.profiler.trace` per mode, with command buffers kept on while
profiling (as benchmarks.trace_round does), and prints per round: the kernels' busy time by class,
the span, and the gaps longer than 20 us with the kernels around them. The profiler adds a wait
after each loop iteration's read of its condition, so compare busy times, not spans.

    python -m benchmarks.profile_request --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft longspec_jax/drafts/smollm2_135m --prompts infer/eval_sets/smollm2/code_completion.jsonl \\
        --temperature 1 --modes auto,longspec:4-4-4
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from pathlib import Path

from benchmarks.trace_round import loop_kernels, print_summary, print_top, summarise, with_graphs_while_profiling

GAP_US = 20.0


def gaps(kernels: list[dict], at_least_us: float = GAP_US) -> list[tuple[float, str, str]]:
    """(idle microseconds, kernel before, kernel after) for each gap between consecutive kernels of
    at least at_least_us, longest first."""
    found = [
        (b["ts"] - (a["ts"] + a["dur"]), a["name"], b["name"])
        for a, b in zip(kernels, kernels[1:])
        if b["ts"] - (a["ts"] + a["dur"]) >= at_least_us
    ]
    return sorted(found, reverse=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="a .gguf or HF directory")
    parser.add_argument("--draft", help="the draft (default: the one shipped for the target)")
    parser.add_argument("--prompts", type=Path, required=True, help="an eval set's .jsonl")
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--modes", default="auto,longspec:4-4-4", help="as infer.benchmark's --modes")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warm-up", type=int, default=3, help="decodes before the profiled one")
    parser.add_argument("--out", type=Path, default=Path("/tmp/profile_request"))
    parser.add_argument("--top", type=int, default=12, help="also list the N kernels that took the most time")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = with_graphs_while_profiling(os.environ.get("XLA_FLAGS", ""))
    import jax

    from benchmarks.decode_kernels import eval_prompt
    from infer.benchmark import parse_mode_spec
    from longspec_jax.draft_io import inference_draft
    from longspec_jax.generation import Generator
    from longspec_jax.target import load_target

    prompt = eval_prompt(args.prompts, args.prompt_index)
    target = load_target(args.target, dtype="bfloat16")
    draft = inference_draft(target, args.draft)
    for spec in args.modes.split(","):
        mode, widths = parse_mode_spec(spec)
        generator = Generator(target, draft if mode in ("longspec", "auto") else None, mode=mode, tree_widths=widths)
        settings = dict(max_new_tokens=args.new_tokens, temperature=args.temperature, eos_token_ids=())
        for seed in range(args.warm_up):
            stats = generator.generate([prompt], seed=seed, **settings).stats
            print(f"{spec} warm-up: {stats.rounds} rounds, {stats.decode_s * 1e3:.1f} ms")
        folder = args.out / spec.replace(":", "_")
        with jax.profiler.trace(str(folder), create_perfetto_trace=True):
            stats = generator.generate([prompt], seed=args.warm_up, **settings).stats
        print(f"{spec} profiled: {stats.line()}")
        trace = json.load(gzip.open(max(folder.glob("**/perfetto_trace.json.gz"))))
        print_summary(spec, summarise(trace, stats.rounds))
        found = gaps(loop_kernels(trace))
        print(f"  gaps of {GAP_US:g} us or more: {len(found)}, {sum(g for g, _, _ in found) / 1e3:.2f} ms in all")
        for gap, before, after in found[:10]:
            print(f"    {gap:8.1f} us after {before[:60]} before {after[:60]}")
        if args.top:
            print_top(trace, stats.rounds, args.top)


if __name__ == "__main__":
    main()
