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


def record(
    out: Path,
    prompt_tokens: int,
    new_tokens: int,
    fused_projections: bool,
    tree_widths=None,
    temperature: float = 0.0,
    op_by_op: bool = False,
    candidate_tokens: str = "all",
) -> dict[str, Path]:
    if not op_by_op:  # read by XLA when jax starts its backend, which importing jax below does not yet
        os.environ["XLA_FLAGS"] = with_graphs_while_profiling(os.environ.get("XLA_FLAGS", ""))
    import jax

    from benchmarks.decode_kernels import setup, with_vocabulary
    from longspec_jax.generation import Generator

    target, draft, prompt = setup(small=False, prompt_tokens=prompt_tokens, random_weights=True)
    draft = with_vocabulary(draft, candidate_tokens)
    target.model.fused_projections = fused_projections
    traces = {}
    for mode in ("longspec", "ar"):
        widths = tree_widths if mode == "longspec" else None
        generator = Generator(target, draft if mode == "longspec" else None, mode=mode, tree_widths=widths)
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
    parser.add_argument("--fused-projections", action="store_true", help="the projections as fused Pallas kernels")
    parser.add_argument("--tree-widths", type=lambda s: tuple(int(w) for w in s.split(",")), help="e.g. 1 or 4,16,16")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--candidate-tokens", default="all", help="the draft's vocabulary: all, or N (the first N token ids)"
    )
    parser.add_argument(
        "--op-by-op", action="store_true", help="profile as XLA does by default: every kernel launched from the host"
    )
    args = parser.parse_args(argv)
    if args.summarise:
        traces = {args.summarise.name: (args.summarise, args.rounds)}
    else:
        traces = record(
            args.out,
            args.prompt_tokens,
            args.new_tokens,
            args.fused_projections,
            args.tree_widths,
            args.temperature,
            args.op_by_op,
            args.candidate_tokens,
        )
    for label, (path, rounds) in traces.items():
        trace = json.load(gzip.open(path))
        print_summary(f"{label} ({path})", summarise(trace, rounds))
        if args.top:
            print_top(trace, rounds, args.top)


if __name__ == "__main__":
    main()
