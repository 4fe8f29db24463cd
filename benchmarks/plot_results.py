"""Plot a benchmark's results: tokens/s per mode per task, and tau against prefill length.

    python -m benchmarks.plot_results RESULTS --out docs/results.png [--temperature 0] [--tau-from RESULTS] [--title T]

RESULTS: the JSON of `python -m infer.benchmark --json-out`, or a `--runs-out` jsonl file. Speeds
come from RESULTS; tau against prefill length from --tau-from when given (tau does not depend on
the hardware, so a slower machine can measure it), else from RESULTS. Needs matplotlib.
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
        raise UserError(
            f"the results hold no runs at temperature {temperature:g} (they have {found}): pass --temperature"
        )
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
    ax_tau.set_ylim(bottom=0)  # tau >= 1 always: a zero baseline keeps differences in proportion
    if series["tau"]:
        ax_tau.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def load_results(path: Path) -> dict:
    """A benchmark report from its JSON, or built from a --runs-out jsonl file."""
    if not path.is_file():
        raise UserError(f"{path} does not exist: run `python -m infer.benchmark --json-out {path}` first")
    if path.suffix == ".jsonl":
        from infer.benchmark import summarise_files

        return summarise_files([path])
    return json.loads(path.read_text())


def default_title(report: dict, temperature: float) -> str:
    config = report.get("config", {})
    if "device" not in config:
        return f"T = {temperature:g}"
    return f"{Path(config['target']).name} on {config['device']} ({config['backend']}), T = {temperature:g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_results", description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="JSON of `infer.benchmark --json-out` or a `--runs-out` jsonl file")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tau-from", type=Path, help="results to take tau against prefill length from")
    p.add_argument("--title")
    args = p.parse_args(argv)
    try:
        report = load_results(args.results)
        series = plot_series(report, args.temperature)
        if args.tau_from:
            series["tau"] = plot_series(load_results(args.tau_from), args.temperature)["tau"]
        draw(series, args.out, args.title or default_title(report, args.temperature))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
