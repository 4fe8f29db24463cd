"""Where the GPU time of an AR step and a LongSpec round goes, kernel by kernel, from a profiler trace.

Decodes with SmolLM2's shape and random weights and draft (bfloat16, a 4,500-token prompt, 24 new
tokens: with a random draft a greedy round keeps one token, so both modes run 23 rounds), once to
compile, once under `jax.profiler.trace` (a Perfetto trace per mode under --out). Then it sums the
GPU kernels that ran after the prefill by class (GEMMs, the Pallas attention and its combine, the
vocabulary top-k, other XLA fusions, copies) and prints milliseconds per round, beside the kernels'
busy time and the span per round.

While a profiler is attached XLA runs each kernel as its own launch from the host instead of replaying
the loop's command buffers (CUDA graphs), unless told otherwise: the profile would show gaps between
kernels that an unprofiled loop does not have. The trace is therefore recorded with
`--xla_enable_command_buffers_during_profiling=true` (added to XLA_FLAGS unless set there), as the
loop really runs; `--op-by-op` records it XLA's default way. The profiler still slows the graphs'
launches, so compare the busy time with the loop's own time per round (`benchmarks.decode_kernels`),
not with the span.

    python -m benchmarks.trace_round --out /tmp/trace      # GPU
    python -m benchmarks.trace_round --out /tmp/trace --fused-projections
    python -m benchmarks.trace_round --out /tmp/trace --tree-widths 1 --temperature 1   # one drawn token
    python -m benchmarks.trace_round --out /tmp/trace --tree-widths 4,4,4 --temperature 1 --candidate-tokens 16384
    python -m benchmarks.trace_round --summarise TRACE.json.gz --rounds 23 --top 30
    python -m benchmarks.trace_round --summarise TRACE.json.gz --rounds 16 --list-round 10  # one round, in order

With `--target` (a checkpoint or GGUF), `--draft` and an eval prompt (`--prompts FILE.jsonl
--prompt-index I`) it traces real weights instead, where acceptance decides what runs; then
`--modes` may hold `auto`, whose policy picks the candidate each round: give it a few `--warm-up`
requests first (its first one measures the candidates' costs, and XLA builds a loop's command
buffers over its first calls). Its line counts every kernel after the prefill over its rounds,
the set-up of the policy before the loop included:

    python -m benchmarks.trace_round --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --draft longspec_jax/drafts/smollm2_135m --prompts infer/eval_sets/smollm2/code_completion.jsonl \
        --modes auto,longspec --tree-widths 16,8 --temperature 1 --new-tokens 128 --warm-up 6
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
from pathlib import Path

# Kernel name fragment -> class, first match wins.
CLASSES = (
    ("Run<16", "top-k, k = 16"),
    ("Run<", "top-k, other k"),
    ("hybrid_split_k_attn", "Pallas attention"),
    ("cache_split_k_attn", "Pallas attention"),
    ("mosaic_gpu", "Pallas attention"),  # the verify's cache half on Hopper's units (cache_attention_mgpu)
    ("rotate_and_write", "rotate and write"),
    ("split_k_combine", "split-K combine"),
    ("commit_rows", "commit"),
    ("fused_linear", "fused projection"),
    ("head_top_k", "head top-k"),
    ("gemm", "GEMM"),
    ("nvjet", "GEMM"),
    ("cublas", "GEMM"),
    ("cudnn", "cuDNN attention"),
    ("mem", "copy / memset"),
    ("Mem", "copy / memset"),
)


def kernel_class(name: str) -> str:
    return next((cls for fragment, cls in CLASSES if fragment in name), "other fusions")


def loop_kernels(trace: dict) -> list[dict]:
    """The GPU kernel events after the prefill's last cuDNN attention, in time order (the loop's
    own GEMMs may be cuBLAS kernels too, so they cannot mark the prefill's end)."""
    events = trace["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and "GPU" in process.get(e["pid"], "")), key=lambda e: e["ts"]
    )
    prefill = [e["ts"] for e in gpu if "cudnn" in e["name"]]
    start = max(prefill) if prefill else float("-inf")
    return [e for e in gpu if e["ts"] > start]


def summarise(trace: dict, rounds: int) -> dict[str, tuple[float, float]]:
    """{class: (kernels per round, ms per round)}, plus "busy" and "span" (ms per round)."""
    kernels = loop_kernels(trace)
    if not kernels:
        raise SystemExit("no GPU kernels in this trace (was it recorded on a GPU?)")
    table = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        row = table[kernel_class(e["name"])]
        row[0] += 1
        row[1] += e["dur"]
    out = {cls: (n / rounds, us / 1e3 / rounds) for cls, (n, us) in table.items()}
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    out["busy"] = (len(kernels) / rounds, sum(e["dur"] for e in kernels) / 1e3 / rounds)
    out["span"] = (0.0, span / 1e3 / rounds)
    return out


def top_kernels(trace: dict, rounds: int, n: int) -> list[tuple[str, float, float]]:
    """The n kernel names that took the most time: (name, kernels per round, ms per round)."""
    table = collections.defaultdict(lambda: [0, 0.0])
    for e in loop_kernels(trace):
        row = table[e["name"]]
        row[0] += 1
        row[1] += e["dur"]
    ranked = sorted(table.items(), key=lambda kv: -kv[1][1])[:n]
    return [(name, count / rounds, us / 1e3 / rounds) for name, (count, us) in ranked]


def _round_span(kernels: list[dict], index: int) -> tuple[int, int]:
    """[start, end) of round `index` (0 first) in a LongSpec loop's kernels: a round ends with its
    commit of the accepted rows (`commit_rows`), so round i runs from the kernel after the i-th
    commit to the (i + 1)-th. Only whole rounds: those before the first commit count from the prefill."""
    ends = [i for i, e in enumerate(kernels) if kernel_class(e["name"]) == "commit"]
    if not 0 <= index < len(ends):
        raise SystemExit(f"--list-round {index}: the trace holds {len(ends)} rounds (ended by a commit kernel)")
    return (ends[index - 1] + 1 if index else 0), ends[index] + 1


def round_kernels(trace: dict, index: int) -> list[dict]:
    """Round `index` of a LongSpec loop's kernels in launch order (`_round_span`)."""
    kernels = loop_kernels(trace)
    start, end = _round_span(kernels, index)
    return kernels[start:end]


def print_round(trace: dict, index: int) -> None:
    """Each kernel of round `index` in launch order: its time, the gap before it (us; the first one's
    from the end of the kernel before the round) and its name."""
    loop = loop_kernels(trace)
    start, end = _round_span(loop, index)
    previous_end = loop[start - 1]["ts"] + loop[start - 1]["dur"] if start else None
    for e in loop[start:end]:
        gap = 0.0 if previous_end is None else e["ts"] - previous_end
        previous_end = e["ts"] + e["dur"]
        print(f"    {e['dur']:8.1f} us {gap:7.1f} us gap  {e['name'][:100]}")
    busy_ms = sum(e["dur"] for e in loop[start:end]) / 1e3
    print(f"  round {index}: {end - start} kernels, {busy_ms:.3f} ms busy")


def print_top(trace: dict, rounds: int, n: int) -> None:
    for name, count, ms in top_kernels(trace, rounds, n):
        print(f"    {ms:7.3f} ms {count:6.1f} x  {name[:110]}")


def print_summary(label: str, summary: dict) -> None:
    print(
        f"{label}: {summary['busy'][0]:.0f} kernels, {summary['busy'][1]:.3f} ms busy, "
        f"{summary['span'][1]:.3f} ms span per round"
    )
    for cls, (n, ms) in sorted(summary.items(), key=lambda kv: -kv[1][1]):
        if cls not in ("busy", "span"):
            print(f"  {cls:18s} {n:6.1f} kernels {ms:7.3f} ms")


GRAPHS_WHILE_PROFILING = "xla_enable_command_buffers_during_profiling"


def with_graphs_while_profiling(xla_flags: str) -> str:
    """XLA_FLAGS with command buffers kept on under the profiler, unless the flags already say."""
    if GRAPHS_WHILE_PROFILING in xla_flags:
        return xla_flags
    return f"{xla_flags} --{GRAPHS_WHILE_PROFILING}=true".strip()


def load(args):
    """(target, draft, prompt token ids): random weights of SmolLM2's shape, or --target's."""
    from benchmarks.decode_kernels import eval_prompt, setup, with_vocabulary
    from longspec_jax.draft_io import inference_draft
    from longspec_jax.target import load_target

    if args.target is None:
        target, draft, prompt = setup(small=False, prompt_tokens=args.prompt_tokens, random_weights="smollm2_135m")
        return target, with_vocabulary(draft, args.candidate_tokens or "all"), prompt
    if args.prompts is None:
        raise SystemExit("--target needs --prompts FILE.jsonl (an eval set's prompts, infer.build_eval_sets)")
    target = load_target(args.target, dtype="bfloat16")
    draft = inference_draft(target, args.draft)
    if draft is not None:
        draft = with_vocabulary(draft, args.candidate_tokens or "saved")
    return target, draft, eval_prompt(args.prompts, args.prompt_index)


def record(
    out: Path,
    target,
    draft,
    prompt: list[int],
    modes: tuple[str, ...],
    new_tokens: int,
    tree_widths=None,
    temperature: float = 0.0,
    warm_up: int = 1,
) -> dict[str, Path]:
    """Each mode's request traced after `warm_up` untimed ones -> {mode: (trace path, rounds)}."""
    import jax

    from longspec_jax.generation import Generator

    traces = {}
    for mode in modes:
        if mode != "ar" and draft is None:
            raise SystemExit(f"mode {mode} needs a draft: pass --draft PATH")
        widths = tree_widths if mode == "longspec" else None
        generator = Generator(target, None if mode == "ar" else draft, mode=mode, tree_widths=widths)
        for _ in range(warm_up):
            generator.generate([prompt], max_new_tokens=new_tokens, temperature=temperature)
        with jax.profiler.trace(str(out / mode), create_perfetto_trace=True):
            result = generator.generate([prompt], max_new_tokens=new_tokens, temperature=temperature)
        print(mode, result.stats.line())
        traces[mode] = (max((out / mode).glob("**/perfetto_trace.json.gz")), result.stats.rounds)
    return traces


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/trace_round"))
    parser.add_argument("--prompt-tokens", type=int, default=4500)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--summarise", type=Path, help="only summarise this Perfetto trace (.json.gz)")
    parser.add_argument("--rounds", type=int, default=23, help="rounds in the --summarise trace")
    parser.add_argument("--top", type=int, default=0, help="also list the N kernels that took the most time")
    parser.add_argument(
        "--list-round", type=int, help="also list round N's kernels in launch order (LongSpec traces; 0 first)"
    )
    parser.add_argument("--fused-projections", action="store_true", help="the projections as fused Pallas kernels")
    parser.add_argument("--tree-widths", type=lambda s: tuple(int(w) for w in s.split(",")), help="e.g. 1 or 4,16,16")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--candidate-tokens",
        help="the draft's vocabulary: saved (--draft's default), all (random weights' default), or N (the first N ids)",
    )
    parser.add_argument(
        "--op-by-op", action="store_true", help="profile as XLA does by default: every kernel launched from the host"
    )
    parser.add_argument("--target", help="a checkpoint directory or .gguf (default: random weights of SmolLM2's shape)")
    parser.add_argument("--draft", help="with --target: its LongSpec draft")
    parser.add_argument("--prompts", type=Path, help="with --target: an eval set's .jsonl")
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--modes", default="longspec,ar", help="of: longspec, ar, auto (auto: with --target)")
    parser.add_argument("--warm-up", type=int, default=1, help="untimed requests per mode before the traced one")
    args = parser.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = sorted(set(modes) - {"longspec", "ar", "auto"})
    if unknown or not modes:
        raise SystemExit(f"--modes: {', '.join(unknown) or 'none given'}; choose from longspec, ar, auto")
    if "auto" in modes and args.target is None:
        raise SystemExit("--modes auto needs --target: with a random draft the policy runs AR alone")
    if args.summarise:
        traces = {args.summarise.name: (args.summarise, args.rounds)}
    else:
        if not args.op_by_op:  # read by XLA when jax starts its backend, which nothing has done yet
            os.environ["XLA_FLAGS"] = with_graphs_while_profiling(os.environ.get("XLA_FLAGS", ""))
        target, draft, prompt = load(args)
        target.model.fused_projections = args.fused_projections
        traces = record(
            args.out, target, draft, prompt, modes, args.new_tokens, args.tree_widths, args.temperature, args.warm_up
        )
    for label, (path, rounds) in traces.items():
        trace = json.load(gzip.open(path))
        summary = summarise(trace, rounds)
        print_summary(f"{label} ({path})", summary)
        if args.top:
            print_top(trace, rounds, args.top)
        if args.list_round is not None and "commit" in summary:  # an AR trace has no rounds to list
            print_round(trace, args.list_round)


if __name__ == "__main__":
    main()
