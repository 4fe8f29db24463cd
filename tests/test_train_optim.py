"""The optimiser against a numpy AdamW written from the formulas, and the warmup-cosine schedule."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train.config import load_config
from train.optim import lr_schedule, make_optimizer


def test_schedule_warms_up_over_ten_percent_then_decays_by_cosine():
    s = lr_schedule(1e-3, 100, 0.1)
    assert float(s(0)) == 0.0
    assert float(s(5)) == pytest.approx(5e-4)
    assert float(s(10)) == pytest.approx(1e-3)
    for step in (30, 55, 80):
        expected = 0.5 * 1e-3 * (1 + math.cos(math.pi * (step - 10) / 90))
        assert float(s(step)) == pytest.approx(expected, rel=1e-5)
    assert float(s(100)) == pytest.approx(0.0, abs=1e-12)


def reference_adamw(params, grads_seq, lrs, *, b1, b2, eps, wd, clip):
    """AdamW (decoupled decay on matrices only) after global-norm clipping, in float64."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, (g, lr) in enumerate(zip(grads_seq, lrs), start=1):
        norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        scale = min(1.0, clip / norm)
        for k in p:
            gk = g[k].astype(np.float64) * scale
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk * gk
            update = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            decay = wd * p[k] if p[k].ndim >= 2 else 0.0
            p[k] = p[k] - lr * (update + decay)
    return p


def test_optimizer_matches_the_reference_adamw():
    cfg = load_config("tiny")
    stage = dataclasses.replace(cfg.current, lr=0.05)
    cfg = dataclasses.replace(cfg, stages=(stage,))
    steps = 6
    optimizer, schedule = make_optimizer(cfg, total_steps=steps)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "bias": rng.normal(size=(3,)).astype(np.float32)}
    # Gradients large enough that clipping at 1.0 matters on some steps and not on others.
    grads_seq = [
        {k: (rng.normal(size=x.shape) * (3.0 if t % 2 else 0.1)).astype(np.float32) for k, x in params.items()}
        for t in range(steps)
    ]
    state = optimizer.init({k: jnp.asarray(v) for k, v in params.items()})
    ours = {k: jnp.asarray(v) for k, v in params.items()}
    for g in grads_seq:
        updates, state = optimizer.update({k: jnp.asarray(x) for k, x in g.items()}, state, ours)
        ours = optax.apply_updates(ours, updates)
    lrs = [float(schedule(t)) for t in range(steps)]
    expected = reference_adamw(params, grads_seq, lrs, b1=0.9, b2=0.95, eps=1e-6, wd=0.1, clip=1.0)
    for k in params:
        np.testing.assert_allclose(np.asarray(ours[k]), expected[k], rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(ours["w"]), params["w"])
