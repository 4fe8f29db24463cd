"""The decode step and round under several XLA runtime settings, one process each, one table.

XLA's GPU runtime replays each loop iteration's kernels as a command buffer (a CUDA graph); how it
records, updates and schedules them is set by XLA_FLAGS, which a process reads once at start. This
runs `benchmarks.decode_kernels` (SmolLM2's shape, random weights, the packed inference layout) in a
fresh process per setting and prints each one's AR step and LongSpec round beside the default's:

    python -m benchmarks.xla_flag_sweep --tree-widths 4,4,4 \\
        --setting pdl=--xla_gpu_enable_pdl=true \\
        --setting va=--xla_gpu_enable_command_buffer_va_remapping=true

A setting whose flags XLA rejects (an unknown name or value) is reported as failed, with its error's
last line; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# What decode_kernels' row holds that the table reports.
FIELDS = ("ar_kernels", "ar_step_ms", "ar_tokens_per_s", "round_kernels", "round_ms", "round_vs_ar_step")


def parse_setting(text: str) -> tuple[str, str]:
    name, sep, flags = text.partition("=")
    if not sep or not name or not re.fullmatch(r"\w[\w.-]*", name):
        raise argparse.ArgumentTypeError(f"a setting is NAME=FLAGS, e.g. pdl=--xla_gpu_enable_pdl=true; got {text!r}")
    return name, flags


def run_setting(flags: str, bench_args: list[str], timeout: float) -> dict:
    """decode_kernels' 'after' row under XLA_FLAGS += flags -> {ar_step_ms, round_ms, ...} or {error}."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", ""), flags) if x)
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "benchmarks.decode_kernels", "--variants", "after", "--json", str(rows_path)]
        try:
            done = subprocess.run(command + bench_args, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {timeout:.0f} s"}
        rows = json.loads(rows_path.read_text()) if done.returncode == 0 and rows_path.exists() else []
    if not rows:
        lines = (done.stderr or done.stdout).strip().splitlines()
        # XLA reports a flag it cannot take on its first error log line, then prints every flag's usage
        logged = [line.split("] ", 1)[-1] for line in lines if re.match(r"[EF]\d{4} ", line)]
        if logged:
            return {"error": logged[0]}
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    return {k: float(rows[0][k]) for k in FIELDS if k in rows[0]}


def main(argv=None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", type=parse_setting, action="append", default=[], help="NAME=XLA flags")
    parser.add_argument("--tree-widths", help="LongSpec's tree (default: the default tree)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a setting may take")
    parser.add_argument("--small", action="store_true", help="a tiny random model (CPU smoke run)")
    args = parser.parse_args(argv)
    bench_args = ["--small" if args.small else "--random", "--new-tokens", str(args.new_tokens)]
    bench_args += ["--repeats", str(args.repeats)]
    if args.tree_widths:
        bench_args += ["--tree-widths", args.tree_widths]
    results = {}
    for name, flags in [("default", ""), *args.setting]:
        results[name] = run_setting(flags, bench_args, args.timeout)
        print(f"{name} ({flags or 'no flags'}): {results[name]}", flush=True)
    base = results["default"]
    print(f"\n{'setting':>12}  {'AR ms':>7}  {'vs default':>10}  {'round ms':>8}  {'vs default':>10}  round/AR")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:>12}  failed: {r['error']}")
            continue
        ar_ratio = r["ar_step_ms"] / base["ar_step_ms"] if "ar_step_ms" in base else float("nan")
        round_ms = r.get("round_ms", float("nan"))
        round_ratio = round_ms / base.get("round_ms", float("nan"))
        print(
            f"{name:>12}  {r['ar_step_ms']:7.3f}  {ar_ratio:10.3f}  {round_ms:8.3f}  {round_ratio:10.3f}  "
            f"{r.get('round_vs_ar_step', float('nan')):.2f}"
        )
    return results


if __name__ == "__main__":
    main()
