"""What XLA's GPU runtime does with the decode loop's command buffers (CUDA graphs), call by call.

Each loop iteration replays its kernels as a command buffer. A buffer is recorded once (graphs
created, kernel nodes added), and before a replay its kernels' arguments are checked against the
last replay's: when a buffer address changed, the kernel node is updated in the graph executable,
which costs host time per node. This decodes a few times (SmolLM2's shape, random weights) with
XLA's command-buffer logging on and counts, per decode call, the graphs created, the replays, the
node updates and the nodes found unchanged:

    python -m benchmarks.command_buffer_log --mode longspec --tree-widths 4,4,4
    python -m benchmarks.command_buffer_log --mode auto --temperature 1 --new-tokens 128 \
        --target SmolLM2-135M-Instruct.Q4_1.gguf --draft longspec_jax/drafts/smollm2_135m \
        --prompts infer/eval_sets/smollm2/code_completion.jsonl --prompt-index 2
    python -m benchmarks.command_buffer_log --mode auto --calls 8 --target ... \
        --prompts infer/eval_sets/smollm2/code_completion.jsonl --prompt-index 0,1,2,3

A steady loop replays about one command buffer per round and updates nothing after its first calls
on one prompt. With several prompt indices the calls take them in turn, as a server's requests do.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from infer.generate import parse_tree_widths

# XLA's source files that log command buffer work (TF_CPP_VMODULE takes their base names).
LOGGING_MODULES = ("command_buffer_thunk", "command_executor", "cuda_command_buffer", "gpu_command_buffer")
MARK = "=== decode call"
EVENTS = {
    "graphs created": "Create new CUDA graph",
    "replays": "Launch command buffer executable graph",
    "nodes updated": "Set kernel node params",
    "nodes unchanged": "Skip updating command",
}


UPDATE_TIME = re.compile(r"Updated \d+ commands in (\d+)")


def summarise(log: str) -> list[dict]:
    """Per decode call (between the child's marks): {"call", "rounds", event: count, "update ms":
    the host time XLA reports for updating its command buffers}."""
    calls, current = [], None
    for line in log.splitlines():
        if line.startswith(MARK):
            fields = line[len(MARK) :].split()
            if fields[-6:-5] == ["rounds"]:  # the call's end: "<label> rounds N runs R ms X"
                current |= {"rounds": int(fields[-5]), "runs": int(fields[-3]), "decode ms": float(fields[-1])}
                calls.append(current)
                current = None
            else:
                current = {"call": " ".join(fields)} | dict.fromkeys(EVENTS, 0) | {"update ms": 0.0}
            continue
        if current is not None:
            for event, text in EVENTS.items():
                if text in line:
                    current[event] += 1
            if m := UPDATE_TIME.search(line):
                current["update ms"] += int(m.group(1)) / 1e3
    return calls


def child(args) -> None:
    from benchmarks.decode_kernels import eval_prompt, setup
    from longspec_jax.draft_io import inference_draft
    from longspec_jax.generation import Generator

    if args.target is None:
        target, draft, prompt = setup(small=False, prompt_tokens=args.prompt_tokens, random_weights="smollm2_135m")
    else:  # real weights: the target's own draft unless --draft, the prompt from --prompts or examples/doc.txt
        target, _, prompt = setup(small=False, prompt_tokens=args.prompt_tokens, target_path=args.target)
        draft = inference_draft(target, args.draft)
    prompts = [prompt] if args.prompts is None else [eval_prompt(args.prompts, i) for i in args.prompt_index]
    draft = None if args.mode == "ar" else draft
    generator = Generator(target, draft, mode=args.mode, tree_widths=parse_tree_widths(args.tree_widths))
    for call in range(args.calls):
        which = call % len(prompts)
        label = f"{args.mode} {call}" + (f" p{args.prompt_index[which]}" if args.prompts is not None else "")
        print(f"{MARK} {label}", file=sys.stderr, flush=True)
        stats = generator.generate(
            prompts[which], max_new_tokens=args.new_tokens, eos_token_ids=(), temperature=args.temperature
        ).stats
        runs = stats.policy.get("candidate_runs", 1)
        print(
            f"{MARK} {label} rounds {stats.rounds} runs {runs} ms {stats.decode_s * 1e3:.2f}",
            file=sys.stderr,
            flush=True,
        )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="longspec", choices=("ar", "longspec", "auto"))
    parser.add_argument("--tree-widths", help="e.g. 4,4,4 (default: the mode's)")
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--target", help="a .gguf or HF directory (default: SmolLM2's shape, random weights)")
    parser.add_argument("--draft", help="the draft for --target (default: the one shipped for it)")
    parser.add_argument(
        "--prompts", type=Path, help="an eval set's .jsonl (infer.build_eval_sets): decode one of its prompts"
    )
    parser.add_argument(
        "--prompt-index",
        type=lambda text: [int(i) for i in text.split(",")],
        default=[0],
        help="which prompt of --prompts; several (e.g. 0,1,2) are decoded in turn, one a call",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=",".join(f"{m}=3" for m in LOGGING_MODULES))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.command_buffer_log", "--child", *(sys.argv[1:] if argv is None else argv)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"the decode failed:\n{tail}")
    calls = summarise(done.stderr)
    print(
        f"{'call':>14} {'rounds':>6} {'runs':>5} "
        + " ".join(f"{e:>15}" for e in EVENTS)
        + f" {'update ms':>9} {'decode ms':>9} {'ms/round':>8}"
    )
    for c in calls:
        counts = " ".join(f"{c[e]:>15}" for e in EVENTS)
        print(
            f"{c['call']:>14} {c['rounds']:>6} {c['runs']:>5} {counts} {c['update ms']:9.2f} "
            f"{c['decode ms']:9.2f} {c['decode ms'] / max(c['rounds'], 1):8.3f}"
        )
    return calls


if __name__ == "__main__":
    main()
