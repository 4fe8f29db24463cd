"""sampling.py against float64 numpy references of the documented rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.errors import UserError
from longspec_jax.sampling import (
    SamplingParams,
    SamplingSettings,
    filtered_log_probs,
    greedy_pick,
    pick_token,
    sample,
)


def reference_log_probs(logits, temperature, top_k, top_p):
    """float64 numpy version of the module's rules, one row at a time."""
    out = []
    for row in np.asarray(logits, np.float64).reshape(-1, logits.shape[-1]):
        if temperature == 0:
            lp = np.full_like(row, -np.inf)
            lp[int(np.argmax(row))] = 0.0
            out.append(lp)
            continue
        x = row / temperature
        keep = np.ones_like(x, bool)
        if top_k > 0:
            kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
            keep &= x >= kth
        if top_p < 1:
            p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            mass, chosen = 0.0, []
            for i in order:  # the smallest most-likely prefix reaching mass >= top_p
                chosen.append(i)
                mass += p[i]
                if mass >= top_p:
                    break
            keep &= p >= p[chosen[-1]]
        x = np.where(keep, x, -np.inf)
        out.append(x - (np.log(np.sum(np.exp(x[keep] - x[keep].max()))) + x[keep].max()))
    return np.stack(out).reshape(logits.shape)


def assert_same_distribution(got, want):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 5, 1.0),
        (1.0, 0, 0.9),
        (0.8, 7, 0.6),
        (1.0, 1, 1.0),
        (0.5, 100, 0.3),
        (0.0, 3, 0.5),
    ],
)
def test_filtered_log_probs_match_float64_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(3, 4, 37)).astype(np.float32) * 2.5
    params = SamplingParams.create(temperature=temperature, top_k=top_k, top_p=top_p)
    got = jax.jit(filtered_log_probs)(jnp.asarray(logits), params)
    assert_same_distribution(got, reference_log_probs(logits, temperature, top_k, top_p))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(probs)[None], jnp.float32)
    kept = lambda p: np.isfinite(np.asarray(filtered_log_probs(logits, SamplingParams.create(1.0, top_p=p))))[0]
    assert kept(0.45).tolist() == [True, False, False, False]
    assert kept(0.55).tolist() == [True, True, False, False]
    assert kept(0.9).tolist() == [True, True, True, False]
    assert kept(0.96).tolist() == [True, True, True, True]


def test_ties_at_the_cut_are_all_kept():
    logits = jnp.asarray([[3.0, 1.0, 2.0, 2.0, 0.0]])
    topk = np.asarray(filtered_log_probs(logits, SamplingParams.create(1.0, top_k=2)))[0]
    assert np.isfinite(topk).tolist() == [True, False, True, True, False]
    # p reached inside the tie {2, 3}: both tied tokens stay.
    p_first = float(jax.nn.softmax(logits)[0, 0])
    topp = np.asarray(filtered_log_probs(logits, SamplingParams.create(1.0, top_p=p_first + 0.01)))[0]
    assert np.isfinite(topp).tolist() == [True, False, True, True, False]


def test_greedy_pick_breaks_ties_to_lowest_id():
    logits = jnp.asarray([[0.0, 5.0, 5.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    assert greedy_pick(logits).tolist() == [1, 0]
    assert pick_token(jax.random.key(0), logits, SamplingParams.create(0.0)).tolist() == [1, 0]


def test_changing_values_does_not_recompile():
    traces = []

    @jax.jit
    def f(logits, params):
        traces.append(1)
        return filtered_log_probs(logits, params)

    logits = jnp.zeros((2, 11))
    for t, k, p in [(1.0, 3, 0.9), (0.5, 4, 0.8), (0.0, 2, 0.5), (2.0, 1, 0.3)]:  # greedy included
        f(logits, SamplingParams.create(t, top_k=k, top_p=p))
    assert len(traces) == 1


def test_greedy_and_sampling_picks_are_one_program():
    """pick_token traces once for temperature 0 and > 0; greedy picks are the argmax whatever the
    key (the noise is off), sampled ones vary with it."""
    traces = []

    @jax.jit
    def pick(key, logits, params):
        traces.append(1)
        return pick_token(key, logits, params)

    logits = jnp.asarray(np.random.default_rng(2).normal(size=(64, 9)), jnp.float32)
    greedy, sampled = SamplingParams.create(0.0), SamplingParams.create(1.0)
    keys = [jax.random.key(s) for s in range(3)]
    for key in keys:
        np.testing.assert_array_equal(pick(key, logits, greedy), greedy_pick(logits))
    assert len({tuple(np.asarray(pick(key, logits, sampled)).tolist()) for key in keys}) == 3
    assert len(traces) == 1


def test_samples_follow_the_filtered_distribution():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(9,)), jnp.float32)
    params = SamplingParams.create(0.8, top_k=6, top_p=0.9)
    log_probs = filtered_log_probs(logits, params)
    n = 20000
    draws = jax.vmap(lambda k: sample(k, log_probs))(jax.random.split(jax.random.key(3), n))
    counts = np.bincount(np.asarray(draws), minlength=9)
    p = np.exp(np.asarray(log_probs, np.float64))
    assert counts[p == 0].sum() == 0
    chi2 = np.sum((counts[p > 0] - n * p[p > 0]) ** 2 / (n * p[p > 0]))
    assert chi2 < 20.5  # the 99.9% quantile of chi-square with 5 degrees of freedom


@pytest.mark.parametrize(
    "kwargs,fix",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=2**31), "top_k"),
        (dict(top_k=1e23), "top_k"),
        (dict(top_k="5"), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_settings_raise_user_error(kwargs, fix):
    with pytest.raises(UserError, match=fix):
        SamplingParams.create(**kwargs)


def test_settings_are_host_values_that_give_the_arrays_create_gives():
    settings = SamplingSettings.checked(0.8, top_k=6, top_p=0.9)
    assert settings == SamplingSettings(0.8, 6, 0.9) and not settings.greedy
    made, created = settings.params(), SamplingParams.create(0.8, top_k=6, top_p=0.9)
    for field in ("temperature", "top_k", "top_p", "greedy"):
        assert np.asarray(getattr(made, field)) == np.asarray(getattr(created, field))
    assert (made.use_top_k, made.use_top_p) == (True, True)
    greedy = SamplingSettings.checked(0)
    assert greedy.greedy and float(greedy.params().temperature) == 1.0 and bool(greedy.params().greedy)
    with pytest.raises(UserError, match="top_p"):
        SamplingSettings.checked(1.0, top_p=0.0)
