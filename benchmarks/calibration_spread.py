"""How steady mode auto's calibrated round costs are, against what each round costs in a loop.

Mode auto picks a candidate by its tokens per second, with each candidate's seconds a round taken
from a calibration (calibration.py: measured once, on the first request's own rounds, then kept).
Three measurements in one process, on one prompt:

1. The calibration measured `--times` times (each time forgotten first and nothing kept on disk):
   every candidate's measurements and their spread. The first ones fall in the process's first
   calls, where a GPU's runtime still builds its command buffers, as a product's first request does;
   a drift from the first measurement to the last says how much that weighs.
2. Each candidate's round at the margin, run as a fixed mode: decode time at two request lengths in
   one output bucket, over the rounds between them (the slope holds no fixed cost of a request).
3. AR and the smallest tree after the host idles 0, 50 or 500 ms before the request (a GPU that
   lowers its clocks while idle pays for it at the start of the next request).

    python -m benchmarks.calibration_spread --target SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft longspec_jax/drafts/smollm2_135m --prompts infer/eval_sets/smollm2/code_completion.jsonl
    python -m benchmarks.calibration_spread --small     # a tiny random model (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock

from benchmarks.request_overhead import length_points, marginal_round_s
from longspec_jax import calibration
from longspec_jax.adaptive import candidate_plan, lookup_tokens_of
from longspec_jax.generation import Generator

IDLE_GAPS_S = (0.0, 0.05, 0.5)
WARM_CALLS = 5  # untimed requests before a fixed mode is timed: a GPU builds its graphs over the first calls


def fixed_generator(target, draft, name: str, widths: tuple[int, ...]) -> Generator:
    """The fixed mode that runs only candidate `name` ("ar", "pld N", "tree W", "tree W+pld N")."""
    if name == "ar":
        return Generator(target, mode="ar")
    if name.startswith("pld"):
        return Generator(target, mode="pld", tree_widths=widths)
    return Generator(target, draft, mode="longspec", tree_widths=widths, lookup_tokens=lookup_tokens_of(name))


def calibrations(generator: Generator, prompt, times: int, **request) -> list[dict[str, float]]:
    """ms a round of each candidate, measured `times` times on the same request (nothing kept on
    disk; the in-memory copy forgotten before each)."""
    generator.generate(prompt, **request)  # compiles (and calibrates once, untimed here)
    measured = []
    with mock.patch.object(calibration, "calibration_folder", lambda: None):
        for _ in range(times):
            calibration.forget_calibrations()
            stats = generator.generate(prompt, **request).stats
            costs = {n: c["ms_per_round"] for n, c in stats.policy["candidates"].items()}
            unmeasured = [n for n, ms in costs.items() if ms >= 1e3 * calibration.UNMEASURED_SECONDS]
            if stats.policy.get("calibration") != "measured" or unmeasured:
                raise SystemExit(f"the request ended before it timed {unmeasured}: raise --calibration-tokens")
            measured.append(costs)
    calibration.forget_calibrations()
    return measured


def marginal_round_ms(generator: Generator, prompt, lengths: tuple[int, int], repeats: int, **request) -> dict:
    """{"round_ms": decode time between the two lengths over the rounds between them, "rounds": the
    rounds at each length, "decode_ms": the median decode ms at each}."""
    for _ in range(WARM_CALLS):
        generator.generate(prompt, max_new_tokens=max(lengths), **request)
    points, _ = length_points(generator, prompt, lengths, repeats, **request)
    return {
        "round_ms": 1e3 * marginal_round_s(points),
        "rounds": [p["rounds"] for p in points],
        "decode_ms": [1e3 * p["decode_s"] for p in points],
    }


def after_idle(generator: Generator, prompt, gaps, repeats: int, **request) -> dict[float, float]:
    """Median decode ms of the request after the host idled each gap (seconds) before it."""
    for _ in range(WARM_CALLS):
        generator.generate(prompt, **request)
    out = {}
    for gap in gaps:
        times = []
        for _ in range(repeats):
            time.sleep(gap)
            times.append(1e3 * generator.generate(prompt, **request).stats.decode_s)
        out[gap] = statistics.median(times)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a .gguf or HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--draft", help="the draft for --target (default: the one shipped for it)")
    parser.add_argument("--prompts", type=Path, help="an eval set's .jsonl (default: examples/doc.txt)")
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=4500, help="without --prompts")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--times", type=int, default=5, help="calibrations measured")
    parser.add_argument("--calibration-tokens", type=int, default=512, help="a calibrating request's length")
    parser.add_argument("--lengths", default="130,256", help="two request lengths in one output bucket")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a tiny random model, short requests (tests)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    from benchmarks.decode_kernels import eval_prompt, setup
    from longspec_jax.draft_io import inference_draft

    if args.small:
        target, draft, prompt = setup(small=True, prompt_tokens=60)
        args.calibration_tokens, args.lengths = 800, "20,80"
    else:
        target, _, prompt = setup(small=False, prompt_tokens=args.prompt_tokens, target_path=args.target)
        draft = inference_draft(target, args.draft)
    if args.prompts is not None:
        prompt = eval_prompt(args.prompts, args.prompt_index)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    request = dict(eos_token_ids=(), temperature=args.temperature)
    auto = Generator(target, draft, mode="auto")
    measured = calibrations(auto, prompt, args.times, max_new_tokens=args.calibration_tokens, **request)
    plan = dict(candidate_plan(True, args.temperature == 0.0, 1))
    report = {"prompt_tokens": len(prompt), "temperature": args.temperature, "candidates": {}, "idle": {}}
    print(f"{len(prompt)}-token prompt, T = {args.temperature}; ms a round")
    for name, widths in plan.items():
        values = [m[name] for m in measured]
        margin = marginal_round_ms(
            fixed_generator(target, draft, name, widths), prompt, lengths, args.repeats, **request
        )
        report["candidates"][name] = {"calibrated_ms": values, **margin}
        print(
            f"{name:>20}: calibrated {' '.join(f'{v:.3f}' for v in values)} (spread {max(values) / min(values):.2f}x); "
            f"as a fixed mode {margin['round_ms']:.3f} at the margin, rounds {margin['rounds']}",
            flush=True,
        )
    trees = [n for n in plan if n.startswith("tree")]
    for name in ["ar"] + ([min(trees, key=lambda n: sum(plan[n]))] if trees else []):
        generator = fixed_generator(target, draft, name, plan[name])
        gaps = after_idle(generator, prompt, IDLE_GAPS_S, args.repeats, max_new_tokens=lengths[-1], **request)
        report["idle"][name] = {str(g): ms for g, ms in gaps.items()}
        print(f"{name:>20} after idling " + ", ".join(f"{g * 1e3:.0f} ms: {ms:.2f} ms" for g, ms in gaps.items()))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
