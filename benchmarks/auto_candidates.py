"""Mode auto with another candidate set: `infer.benchmark` with the plan of some requests replaced.

Mode auto picks its candidates per request (`adaptive.candidate_plan`: by sampling and batch size).
To measure what a different set would do, this runs the benchmark with that choice replaced for the
requests it names, and the default plan for the rest:

    python -m benchmarks.auto_candidates --candidates "ar;tree 4,4,4" --sampling sampled --batches 1 -- \\
        --eval-dir infer/eval_sets/smollm2 --temperatures 1 --modes ar,auto --limit 4 --repeats 2

Candidate names as mode auto reports them: "ar", "pld N" (a prompt-lookup chain of N tokens),
"tree W" (a draft tree of level widths W, e.g. "tree 4,4,4"); "ar" must come first.
"""

from __future__ import annotations

import argparse
import re
import sys

from infer import benchmark
from longspec_jax import generation

Plan = tuple[tuple[str, tuple[int, ...]], ...]


def parse_candidates(text: str) -> Plan:
    """'ar;pld 2;tree 4,4,4' -> the plan ((name, widths), ...) mode auto takes."""
    plan = []
    for name in (part.strip() for part in text.split(";")):
        if name == "ar":
            plan.append(("ar", ()))
        elif m := re.fullmatch(r"pld ([1-9]\d*)", name):
            plan.append((name, (1,) * int(m.group(1))))
        elif m := re.fullmatch(r"tree ([1-9]\d*(?:,[1-9]\d*)*)", name):
            plan.append((name, tuple(int(w) for w in m.group(1).split(","))))
        else:
            raise argparse.ArgumentTypeError(f"unknown candidate {name!r}: use 'ar', 'pld N' or 'tree W1,W2,...'")
    if not plan or plan[0][0] != "ar":
        raise argparse.ArgumentTypeError(f"the candidates must start with 'ar' (mode auto's fallback), got {text!r}")
    return tuple(plan)


def replaced_plan(plan: Plan, sampling: str, batches: set[int] | None, default=generation.candidate_plan):
    """A candidate_plan that gives `plan` to requests of that sampling ("greedy", "sampled", "all")
    and batch size (None: any) when the target has a draft or the plan needs none; `default` otherwise."""
    needs_draft = any(name.startswith("tree") for name, _ in plan)

    def choose(has_draft: bool, greedy: bool, batch: int, lookup_tokens: int | None = None) -> Plan:
        applies = sampling == "all" or (sampling == "greedy") == greedy
        if applies and (batches is None or batch in batches) and (has_draft or not needs_draft):
            return plan
        return default(has_draft, greedy, batch, lookup_tokens)

    return choose


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=parse_candidates, required=True, help="e.g. 'ar;tree 4,4,4'")
    parser.add_argument("--sampling", choices=("greedy", "sampled", "all"), default="all")
    parser.add_argument("--batches", help="comma-separated batch sizes the set is for (default: all)")
    parser.add_argument("benchmark_args", nargs=argparse.REMAINDER, help="after --: infer.benchmark's arguments")
    args = parser.parse_args(argv)
    batches = None if args.batches is None else {int(b) for b in args.batches.split(",")}
    rest = args.benchmark_args[1:] if args.benchmark_args[:1] == ["--"] else args.benchmark_args
    generation.candidate_plan = replaced_plan(args.candidates, args.sampling, batches)
    return benchmark.main(rest)


if __name__ == "__main__":
    sys.exit(main())
