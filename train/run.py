"""`python -m train.run --config vicuna7b.py [--stage N] [--target PATH] [--data PATH] [--set key=value ...]`

Trains the selected stage of a config; resumes automatically from the newest checkpoint in
`<output_dir>/stage<N>/checkpoints`. Exit codes: 0 done, 1 stopped on a non-finite loss,
2 a usage error (one line, no traceback), 130 / 143 stopped by Ctrl-C / SIGTERM (a checkpoint was saved).
A second trainer on the same output_dir is refused while the first runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from longspec_jax.errors import UserError
from train.config import TrainConfig, apply_overrides, load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train.run", description="Train a LongSpec draft for a target model."
    )
    parser.add_argument("--config", required=True, help="a name in train/configs (vicuna7b, tiny, ...) or a path")
    parser.add_argument("--stage", type=int, help="which training stage of the config to run (1-based)")
    parser.add_argument("--target", help="target checkpoint: an HF directory or a .gguf file")
    parser.add_argument("--data", action="append", help="training data file or directory (repeatable)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config or stage field, e.g. --set lr=1e-4 --set mesh=1,8,1",
    )
    return parser.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The config file, then --stage, --target, --data, then --set overrides (which win)."""
    cfg = load_config(args.config)
    if args.stage is not None:
        cfg = dataclasses.replace(cfg, stage=args.stage)
    if args.target is not None:
        cfg = dataclasses.replace(cfg, target=args.target)
    cfg.validate()
    if args.data:
        stages = list(cfg.stages)
        stages[cfg.stage - 1] = dataclasses.replace(cfg.current, data=tuple(args.data))
        cfg = dataclasses.replace(cfg, stages=tuple(stages))
    return apply_overrides(cfg, args.overrides).validate()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from train.trainer import TrainingStopped, train

        cfg = resolve_config(args)
        result = train(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 1
    if result.interrupted:
        return 128 + result.stop_signal
    limited = " (time limit reached before max_steps)" if result.out_of_time else ""
    print(f"trained {cfg.name} stage {cfg.stage} to step {result.step}{limited}; draft: {result.draft_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
