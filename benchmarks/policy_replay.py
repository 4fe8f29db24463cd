"""Mode auto's greedy policy replayed on measured rounds, at another device's round costs.

What a greedy round of a fixed tree keeps depends on the text, the target and the draft, not on the
device; what a round costs depends on the device, not on the text. So the tokens each round of a
fixed candidate keeps can be recorded on any machine (the CPU) and mode auto's policy
(`policy.choose` / `policy.record`, the acceptance memory carried from prompt to prompt as the engine
does) replayed on them with the round costs mode auto calibrated on a GPU (its records' `policy`):

    python -m benchmarks.policy_replay record --draft longspec_jax/drafts/smollm2_135m \\
        --eval-dir infer/eval_sets/smollm2_diverse --tasks summarisation --limit 8 \\
        --mode longspec:4-16-11+pld32 --out keeps.jsonl
    python -m benchmarks.policy_replay replay keeps.jsonl --ms 0.697,1.379

The replay knows what the fixed candidate kept from the positions its own rounds started at. A round
that starts inside one of them (after AR rounds moved the text on by single tokens) is taken to keep
the rest of that round's tokens, at least one: a lower bound, since a draft may well go on past it.
So the replayed policy is judged a little harshly against the fixed candidate, whose replay is exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.acceptance_memory import folded, memory_arrays
from longspec_jax.errors import UserError
from longspec_jax.policy import AR, choose, init_policy, record, with_costs_and_memory

CANDIDATES = ("ar", "fixed")


def record_keeps(args) -> int:
    """Decode each prompt with the fixed mode one round per call; write the tokens each round kept."""
    from infer.benchmark import load_eval_sets, load_models, lookup_tokens, parse_mode_spec
    from longspec_jax.generation import Generator

    mode, widths = parse_mode_spec(args.mode)
    most_kept(args.mode)  # a tree or chain must be given
    if mode not in ("longspec", "pld"):
        raise UserError(f"--mode {args.mode!r}: record a fixed mode (longspec[:W] or pld[:N]), not {mode!r}")
    _, items = load_eval_sets(args.eval_dir, args.tasks.split(","), args.limit)
    target, draft, _ = load_models(args.target, args.draft, None, args.dtype, mode == "longspec")
    generator = Generator(
        target, draft, mode=mode, tree_widths=widths, lookup_tokens=lookup_tokens(args.mode) if draft else None
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as out:
        for item in items:
            lengths = []
            generator.generate(
                item["prompt_ids"],
                max_new_tokens=args.max_new_tokens,
                eos_token_ids=(),
                stream=lambda tokens, lengths=lengths: lengths.append(len(tokens[0])),
                stream_every=1,
            )
            keeps = np.diff([1, *lengths]).tolist()  # the first token comes from the prefill
            row = {"id": item["id"], "mode": args.mode, "new_tokens": lengths[-1], "keeps": keeps}
            out.write(json.dumps(row) + "\n")
            print(f"{item['id']}: {len(keeps)} rounds, tau {sum(keeps) / len(keeps):.2f}", file=sys.stderr)
    return 0


def keeps_from(keeps: list[int]) -> np.ndarray:
    """int[tokens]: what a round of the fixed candidate starting at each position keeps: recorded at
    its rounds' starts, the rest of the round (at least one) inside one."""
    total = int(sum(keeps))
    at = np.ones(total + 1, np.int64)
    start = 0
    for kept in keeps:
        at[start : start + kept] = np.maximum(kept - np.arange(kept), 1)
        start += kept
    return at


def most_kept(mode_spec: str) -> int:
    """The most tokens a round of the fixed mode can keep: its tree's depth or chain, plus one."""
    from infer.benchmark import lookup_tokens, parse_mode_spec

    _, widths = parse_mode_spec(mode_spec)
    if widths is None:
        raise UserError(f"mode {mode_spec!r}: record a mode with its tree or chain given, as in longspec:4-16-11+pld32")
    return max(len(widths), lookup_tokens(mode_spec) or 0) + 1


def replay_prompt(keeps: list[int], seconds, memory: dict, most: int):
    """keeps: what each round of the fixed candidate kept; seconds: AR's round and its; memory: the
    acceptance memory's entries before the prompt; most: the most a round can keep. -> (seconds mode
    auto takes, rounds of each candidate, the memory after it). The policy's module constants are
    read when this runs (each call traces its own loop)."""
    at = jnp.asarray(keeps_from(keeps), jnp.int32)
    tokens = int(sum(keeps))
    cost = jnp.asarray(seconds, jnp.float32)
    _, remembered, wait, rounds = memory_arrays(memory, CANDIDATES)
    start = init_policy(cost, max_tokens=[1.0, float(most)])
    start = with_costs_and_memory(start, cost, remembered, wait, rounds)

    def one_round(carry):
        policy, position, spent = carry
        chosen = choose(policy)
        kept = jnp.minimum(jnp.where(chosen == AR, 1, at[position]), tokens - position)
        return record(policy, chosen, kept, jnp.int32(1)), position + kept, spent + cost[chosen]

    policy, _, spent = jax.lax.while_loop(
        lambda carry: carry[1] < tokens, one_round, (start, jnp.int32(0), jnp.float32(0.0))
    )
    policy = jax.device_get(policy)
    return float(spent), [int(n) for n in policy.rounds], folded(memory, CANDIDATES, policy)


def replay(args) -> int:
    seconds = [float(x) / 1e3 for x in args.ms.split(",")]
    if len(seconds) != 2:
        raise UserError(f"--ms takes two costs, AR's round and the fixed candidate's, in ms: got {args.ms!r}")
    if not args.keeps.is_file():
        raise UserError(f"{args.keeps} does not exist: write it with `python -m benchmarks.policy_replay record`")
    rows = [json.loads(line) for line in args.keeps.read_text(encoding="utf-8").splitlines() if line.strip()]
    memory: dict = {}
    totals = {"ar": 0.0, "fixed": 0.0, "auto": 0.0}
    print("| prompt | tokens | fixed rounds | tau | auto AR / fixed rounds | fixed vs AR | auto vs AR |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        keeps = row["keeps"]
        tokens = sum(keeps)
        ar_s, fixed_s = tokens * seconds[0], len(keeps) * seconds[1]
        auto_s, counts, memory = replay_prompt(keeps, seconds, memory, most_kept(row["mode"]))
        totals["ar"] += ar_s
        totals["fixed"] += fixed_s
        totals["auto"] += auto_s
        print(
            f"| {row['id']} | {tokens} | {len(keeps)} | {tokens / len(keeps):.2f} | {counts[0]} / {counts[1]} | "
            f"{ar_s / fixed_s:.2f}x | {ar_s / auto_s:.2f}x |"
        )
    print(f"| all | | | | | {totals['ar'] / totals['fixed']:.2f}x | {totals['ar'] / totals['auto']:.2f}x |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.policy_replay", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record what each round of a fixed mode keeps")
    rec.add_argument("--target", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    rec.add_argument("--draft", default=None)
    rec.add_argument("--eval-dir", required=True)
    rec.add_argument("--tasks", default="code_completion,summarisation")
    rec.add_argument("--limit", type=int, default=None)
    rec.add_argument("--mode", default="longspec:4-16-11+pld32")
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    rec.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("replay", help="replay mode auto's greedy policy on recorded rounds")
    rep.add_argument("keeps", type=Path)
    rep.add_argument("--ms", required=True, help="AR's round and the fixed candidate's, in ms (e.g. 0.697,1.379)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return record_keeps(args) if args.command == "record" else replay(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
