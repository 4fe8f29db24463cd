"""The optimiser of docs/ALGORITHM.md 4: AdamW (0.9, 0.95, eps 1e-6, wd 0.1), linear warmup over the first
10% of steps then cosine to zero, global-norm clipping at 1.0. Float32 state."""

from __future__ import annotations

import jax
import optax

from train.config import TrainConfig


def lr_schedule(peak_lr: float, total_steps: int, warmup_fraction: float) -> optax.Schedule:
    total_steps = max(int(total_steps), 1)
    warmup = max(int(round(total_steps * warmup_fraction)), 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak_lr, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1), end_value=0.0
    )


def _decay_mask(params):
    # Weight decay on matrices only: norm weights and biases are not decayed (the reference's
    # HF Trainer default).
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimiser for the selected stage and its learning-rate schedule (for logging)."""
    schedule = lr_schedule(cfg.current.lr, total_steps, cfg.warmup_fraction)
    optimizer = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask),
    )
    return optimizer, schedule
