"""Plot a benchmark's results: tokens/s per mode per task, and tau against prefill length.

    python -m infer.plot_results results.json --out docs/results.png [--temperature 0]

Reads the JSON written by `python -m infer.benchmark --json-out`; needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from longspec_jax.errors import UserError


def plot_series(report: dict, temperature: float) -> dict:
    """The numbers the figure shows, at one temperature:
    {"speed": {task: {mode: tokens/s}}, "tau": {mode: [(bucket, mean prompt tokens, tau), ...]}}
    (tau points sorted by prompt length)."""
    summary = report["summary"]
    speed: dict[str, dict[str, float]] = {}
    for g in summary["by_task"]:
        if g["temperature"] == temperature:
            speed.setdefault(g["task"], {})[g["mode"]] = g["tokens_per_s"]
    if not speed:
        found = sorted({g["temperature"] for g in summary["by_task"]})
        raise UserError(f"the results hold no runs at temperature {temperature:g} (they have {found}): pass --temperature")
    tau: dict[str, list] = {}
    for g in sorted(summary["by_bucket"], key=lambda g: g["mean_prompt_len"]):
        if g["temperature"] == temperature:
            tau.setdefault(g["mode"], []).append((g["bucket"], g["mean_prompt_len"], g["mean_tau"]))
    return {"speed": speed, "tau": tau}


def draw(series: dict, out: Path, title: str) -> Path:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UserError("plotting needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    tasks = list(series["speed"])
    modes = sorted({m for per_mode in series["speed"].values() for m in per_mode})
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        xs = [t + (i - (len(modes) - 1) / 2) * width for t in range(len(tasks))]
        ax_speed.bar(xs, [series["speed"][task].get(mode, 0.0) for task in tasks], width, label=mode)
    ax_speed.set_xticks(range(len(tasks)), tasks)
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_title("decode speed")
    ax_speed.legend()
    for mode, points in series["tau"].items():
        ax_tau.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=mode)
        for bucket, x, y in points:
            ax_tau.annotate(bucket, (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax_tau.set_xlabel("prefill length (tokens)")
    ax_tau.set_ylabel("tau (tokens per target forward)")
    ax_tau.set_title("acceptance vs context length")
    if series["tau"]:
        ax_tau.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.plot_results", description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="JSON from `python -m infer.benchmark --json-out`")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    try:
        if not args.results.is_file():
            raise UserError(f"{args.results} does not exist: run `python -m infer.benchmark --json-out {args.results}` first")
        report = json.loads(args.results.read_text())
        config = report["config"]
        title = f"{Path(config['target']).name} on {config['device']} ({config['backend']}), T = {args.temperature:g}"
        draw(plot_series(report, args.temperature), args.out, title)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
