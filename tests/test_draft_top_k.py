"""The draft's candidates under impl "pallas" (the LM head and its top-k in one kernel, interpret
mode here) equal those of the logits, their log-softmax and tree.vocab_top_k, and a speculative
decode that takes them still gives AR's greedy output."""

import functools

import jax
import numpy as np
import pytest

from longspec_jax.draft import draft_candidates, draft_top_k
from longspec_jax.draft_io import init_draft
from longspec_jax.errors import UserError
from longspec_jax.generation import generate
from longspec_jax.sampling import SamplingParams, gumbel_noise
from longspec_jax.target import Target, random_target
from tests.tiny_models import tiny_config


def test_kernel_and_xla_candidates_agree():
    target = random_target(tiny_config(vocab_size=300, hidden_size=96), seed=0, dtype="float32")
    features = jax.random.normal(jax.random.key(1), (2, 3, 96)) * 20.0  # spread-out log-probs
    for k in (1, 4, 16):
        best, ids = draft_top_k(target.model, features, k, attn_impl="pallas")
        want_best, want_ids = draft_top_k(target.model, features, k, attn_impl="xla")
        assert best.shape == ids.shape == (2, 3, k)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(best), np.asarray(want_best), rtol=1e-5, atol=1e-5)
        assert np.all(np.diff(np.asarray(best), axis=-1) <= 0)


@pytest.mark.parametrize(
    "temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.6, 1.0), (0.8, 0.9)], ids=["greedy", "T1", "T0.6", "top-p"]
)
def test_kernel_and_xla_tree_candidates_agree(temperature, top_p):
    """A tree level's candidates: the likeliest when greedy (draft_top_k's), else the race's
    closest under the noise. The kernel ranks logit + T * noise; XLA ranks logit / T + noise:
    the same tokens and margins (top-p takes the XLA path under both impls)."""
    target = random_target(tiny_config(vocab_size=300, hidden_size=96), seed=0, dtype="float32")
    features = jax.random.normal(jax.random.key(1), (2, 3, 96)) * 20.0
    sampling = SamplingParams.create(temperature=temperature, top_p=top_p)
    noise = gumbel_noise(jax.random.key(2), (2, 300), sampling)
    best, ids = draft_candidates(target.model, features, 4, sampling, noise, attn_impl="pallas")
    want_best, want_ids = draft_candidates(target.model, features, 4, sampling, noise, attn_impl="xla")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(best), np.asarray(want_best), rtol=1e-5, atol=1e-4)
    # The noise scaled by the caller (a tree's levels in one kernel): the same candidates, to the bit.
    scaled = noise * sampling.temperature
    given = draft_candidates(target.model, features, 4, sampling, noise, attn_impl="pallas", scaled_noise=scaled)
    for got, want in zip(given, (best, ids)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if temperature == 0.0:  # exactly the greedy tree's candidates under either impl
        for impl, got in (("pallas", (best, ids)), ("xla", (want_best, want_ids))):
            likeliest = draft_top_k(target.model, features, 4, attn_impl=impl)
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(likeliest[1]))
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(likeliest[0]))
    else:
        assert (np.asarray(best[..., 0]) == 0).all() and (np.asarray(best) <= 0).all()
        likeliest = draft_top_k(target.model, features, 4, attn_impl="xla")[1]
        assert (np.asarray(ids) != np.asarray(likeliest)).any()  # the noise moved the candidates


def test_a_head_the_kernel_cannot_take_is_a_user_error():
    target = random_target(tiny_config(vocab_size=300, hidden_size=72), seed=0, dtype="float32")
    features = jax.random.normal(jax.random.key(1), (1, 2, 72))
    with pytest.raises(UserError, match="attn_impl 'xla'"):
        draft_top_k(target.model, features, 4, attn_impl="pallas")
    assert draft_top_k(target.model, features, 4, attn_impl="xla")[1].shape == (1, 2, 4)


def test_pallas_longspec_greedy_output_equals_ar():
    """The whole loop with the kernels in interpret mode: draft tree from the fused head top-k,
    verified by the fused attention and the fused projections, committed in place."""
    target = random_target(tiny_config(head_dim=64), seed=1, dtype="float32")
    model = target.model.inference_layout()
    model.fused_projections = True
    target = Target(target.config, model, target.tokenizer)
    draft = init_draft(target, seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=9).tolist(), rng.integers(0, 128, size=5).tolist()]
    run = functools.partial(generate, target, prompts, max_new_tokens=8, eos_token_ids=())
    reference = run(attn_impl="xla", mode="ar").tokens
    speculative = run(attn_impl="pallas", mode="longspec", draft=draft, tree_widths=(2, 2))
    assert speculative.tokens == reference
    assert speculative.stats.rounds > 0
