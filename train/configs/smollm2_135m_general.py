"""SmolLM2-135M-Instruct, a general draft: the broad corpus plus the target's own words, on one H200.

Data (DATA.md, "The broad corpus" and "The target's own words"): `.stage/broad` holds the gzipped
training shards of `python -m train.build_corpus --broad --gzip` and `.stage/target_text` the
jsonl of `python -m train.target_text` (SFT records: only the target's response is trained on).
Both are git-ignored (build or copy them next to the repository); `--data` replaces them for a run.

Stage 1: 8000 steps of 64 x 1024 tokens = 524 M tokens. At the 498 k tokens/s measured for the
Python-only draft's stage 1 (same shapes, BENCHMARKS.md) that is ~17.5 min of steps, so it runs as
two or three runs of at most 10 min each: `time_limit_s` = 540 stops a run cleanly (checkpoint +
draft export) and the same command resumes from the newest orbax checkpoint (every 250 steps and at
the stop). Stage 2: 400 steps of 16 x 8192 = 52 M tokens at the full 8k window, ~2.5 min at the
measured 412 k tokens/s, starting from stage 1's exported draft.

Ablations (short stage-1 runs, each in its own output_dir; compare tau on the eval sets):
- anchor offset off:  --set anchor_offset=false --set max_steps=2000 --set output_dir=runs/smollm2_general_no_anchor
- flash noisy off (gamma 2 draws the lag from 1..1: the lag is 1 every step, as at inference):
  --set gamma=2 --set max_steps=2000 --set output_dir=runs/smollm2_general_no_noise
with the baseline for them: --set max_steps=2000 --set output_dir=runs/smollm2_general_short.
"""

import dataclasses

from train.config import TrainConfig
from train.configs import smollm2_135m

# Relative to the repository root, where train.run is started.
DATA = (".stage/broad", ".stage/target_text")


def config() -> TrainConfig:
    """The shipped draft's recipe (smollm2_135m) on the broad data, longer."""
    base = smollm2_135m.config()
    short, long = base.stages
    return dataclasses.replace(
        base,
        name="smollm2_135m_general",
        stages=(
            dataclasses.replace(short, data=DATA, max_steps=8000),
            dataclasses.replace(long, data=DATA, max_steps=400),
        ),
        checkpoint_every=250,
        time_limit_s=540.0,
        output_dir="runs/smollm2_135m_general",
    )
