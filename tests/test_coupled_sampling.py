"""Coupled candidates: a draft tree chosen by racing the draft under one Gumbel noise per depth, the
target picking at every node of that depth with the same noise (acceptance.py). The emitted tokens
must be distributed exactly as target-only sampling, and the coupling must keep more than
independent picks on the same kind of tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.acceptance import accept
from longspec_jax.draft import candidates_from_logits
from longspec_jax.sampling import SamplingParams, filtered_logits, gumbel_noise, pick_token, pick_with_noise
from longspec_jax.tree import expand_level_from_top, init_tree_from_top, node_depths, vocab_top_k
from tests.test_acceptance import NUM_SAMPLES, SAMPLE_VOCAB, chi_square_p, filtered_probs, first_two_tokens

WIDTHS = (2, 2)


def toy_model(seed=3):
    """Target logits after 0, 1 and 2 tokens, and a draft close to them (as a trained one is)."""
    rng = np.random.default_rng(seed)
    v = SAMPLE_VOCAB
    target = [rng.normal(size=(v,)), rng.normal(size=(v, v)), rng.normal(size=(v, v, v))]
    draft = [target[0] + rng.normal(size=(v,)), target[1] + rng.normal(size=(v, v))]
    return target, draft


def build_tree(draft, params, noise, raced=True):
    """The (2, 2) tree over NUM_SAMPLES rows: each level the candidates racing under noise[:, d]
    (raced), else the draft's likeliest."""
    rows = noise.shape[0]

    def top(logits, d):
        logits = jnp.asarray(logits, jnp.float32)
        if raced:
            return candidates_from_logits(logits, 2, params, noise[:, d])
        return vocab_top_k(jax.nn.log_softmax(filtered_logits(logits, params), -1), 2)

    best, tokens = top(np.broadcast_to(draft[0], (rows, 1, SAMPLE_VOCAB)), 0)
    tree = init_tree_from_top(jnp.zeros((rows,), jnp.int32), best[:, 0], tokens[:, 0], WIDTHS)
    best, tokens = top(draft[1][np.asarray(tree.tokens[:, 1:3])], 1)
    return expand_level_from_top(tree, 1, best, tokens)


def node_logits(target, tree):
    """The target's logits at every flat node of every row: [rows, N, V]."""
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    depths = node_depths(WIDTHS)
    rows = np.arange(tokens.shape[0])[:, None]
    first = np.where(depths[None, :] == 1, tokens, tokens[rows, np.maximum(parents, 0)])  # the depth-1 token
    out = np.where(
        (depths == 0)[None, :, None],
        target[0],
        np.where((depths == 1)[None, :, None], target[1][first], target[2][first, tokens]),
    )
    return jnp.asarray(out, jnp.float32)


def coupled_round(temperature, top_p, noise_of_depth=lambda noise, depths: noise[:, depths], seed=11):
    """A round of coupled candidates over NUM_SAMPLES rows -> (acceptance, p_root, p_after1, key
    for the next round). noise_of_depth(noise, depths) gives each node's noise (the rule: its own
    depth's)."""
    target, draft = toy_model()
    params = SamplingParams.create(temperature=temperature, top_p=top_p)
    key_round, key_next = jax.random.split(jax.random.key(seed))
    noise = gumbel_noise(key_round, (NUM_SAMPLES, len(WIDTHS) + 1, SAMPLE_VOCAB), params)
    tree = build_tree(draft, params, noise)
    picks = pick_with_noise(node_logits(target, tree), noise_of_depth(noise, node_depths(WIDTHS)), params)
    p_root = filtered_probs(target[0], temperature, top_p)
    p_after1 = filtered_probs(target[1], temperature, top_p)
    return accept(tree, picks), p_root, p_after1, key_next


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_coupled_tree_first_two_tokens_are_target_distributed(temperature, top_p):
    result, p_root, p_after1, key_next = coupled_round(temperature, top_p)
    first, second = first_two_tokens(result.emitted, result.n_emitted, p_after1, key_next)
    n = np.asarray(result.n_emitted)
    assert (n == 2).mean() > 0.1 and (n == 3).mean() > 0.3  # stops inside the tree and whole paths both occur
    assert chi_square_p(first, second, p_root, p_after1) > 1e-3


def test_chi_square_catches_one_noise_for_every_depth():
    """Picks that reuse the root's noise at depth 1 tie the second token to the first: biased."""
    result, p_root, p_after1, key_next = coupled_round(1.0, 1.0, lambda noise, depths: noise[:, :1])
    first, second = first_two_tokens(result.emitted, result.n_emitted, p_after1, key_next)
    assert chi_square_p(first, second, p_root, p_after1) < 1e-3


def test_coupling_keeps_more_than_independent_picks():
    """The same draft and tree shape: the draft's likeliest candidates with an independent pick at
    every node keep fewer tokens a round than candidates raced under the target's noise."""
    coupled, *_ = coupled_round(1.0, 1.0)
    target, draft = toy_model()
    params = SamplingParams.create(temperature=1.0)
    tree = build_tree(draft, params, jnp.zeros((NUM_SAMPLES, len(WIDTHS) + 1, SAMPLE_VOCAB)), raced=False)
    independent = accept(tree, pick_token(jax.random.key(5), node_logits(target, tree), params))
    kept_coupled = float(np.mean(coupled.n_emitted))
    kept_independent = float(np.mean(independent.n_emitted))
    assert kept_coupled > kept_independent + 0.1, (kept_coupled, kept_independent)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_race_margins_rank_the_perturbed_scores(temperature):
    """candidates_from_logits when sampling: each node's k best of logit / T + noise less its best,
    against numpy."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 2, 7)).astype(np.float32)
    noise = rng.gumbel(size=(3, 7)).astype(np.float32)
    params = SamplingParams.create(temperature=temperature)
    margins, tokens = candidates_from_logits(jnp.asarray(logits), 3, params, jnp.asarray(noise))
    perturbed = logits / np.float32(temperature) + noise[:, None, :]
    expected_tokens = np.argsort(-perturbed, axis=-1)[..., :3]
    np.testing.assert_array_equal(tokens, expected_tokens)
    expected = np.take_along_axis(perturbed, expected_tokens, -1) - perturbed.max(-1, keepdims=True)
    np.testing.assert_allclose(margins, expected, rtol=1e-6, atol=1e-6)
    assert (np.asarray(margins[..., 0]) == 0).all()


def test_greedy_candidates_are_the_log_probs_of_the_likeliest():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 3, 9)), jnp.float32)
    params = SamplingParams.create(temperature=0.0)
    best, tokens = candidates_from_logits(logits, 4, params, jnp.zeros((2, 9)))
    want_best, want_tokens = vocab_top_k(jax.nn.log_softmax(logits, -1), 4)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(best, want_best)
