"""The head a draft ranks under (draft_head.py): int8 rows with a scale a row stand for the
target's rows within half a step each; both impls rank by them; "auto" picks int8 by the head's
bytes; a draft keeps its head format through a cast and builds its head once; output stays AR's
when greedy (the sampling distribution: test_speculative's int8 cases)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.draft import draft_candidates, draft_logits
from longspec_jax.draft_head import draft_head, reads_int8
from longspec_jax.draft_io import init_draft
from longspec_jax.errors import UserError
from longspec_jax.generation import generate
from longspec_jax.int8_rows import INT8_MIN_BYTES, quantized_rows
from longspec_jax.proposers import proposer_for
from longspec_jax.sampling import SamplingParams, gumbel_noise
from longspec_jax.target import random_target
from pallas_kernels.head_top_k import LOW_STEPS
from tests.tiny_models import tiny_config

VOCAB = 300


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_config(vocab_size=VOCAB, hidden_size=96), seed=0, dtype="float32")


def test_quantised_rows_are_within_half_a_step_of_the_rows():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 64)) * rng.uniform(0.01, 3.0, size=(50, 1))
    rows[7] = 0.0  # a row of zeros: scale 1, all zeros
    q, scale = quantized_rows(jnp.asarray(rows, jnp.float32))

    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (50,)
    q64, scale64 = np.asarray(q, np.float64), np.asarray(scale, np.float64)
    assert np.abs(q64).max() <= 127
    np.testing.assert_array_equal(np.abs(q64).max(axis=1)[np.arange(50) != 7], 127)  # each row's peak
    assert scale64[7] == 1.0 and not q64[7].any()
    err = np.abs(q64 * scale64[:, None] - rows)
    assert (err <= scale64[:, None] / 2 * (1 + 1e-5) + 1e-7).all()
    np.testing.assert_allclose(scale64[np.arange(50) != 7], np.abs(rows).max(axis=1)[np.arange(50) != 7] / 127, 1e-6)


def test_auto_reads_a_large_head_as_int8_and_the_formats_override_it():
    assert reads_int8("auto", 128256, 4096, jnp.bfloat16)  # Llama-3-8B: 1.05 GB
    assert reads_int8("auto", 32000, 4096, jnp.bfloat16)  # Vicuna-7B: 0.26 GB
    assert not reads_int8("auto", 16400, 576, jnp.bfloat16)  # SmolLM2's cut head: 19 MB
    assert reads_int8("auto", INT8_MIN_BYTES // 2, 1, jnp.bfloat16) and not reads_int8(
        "auto", INT8_MIN_BYTES // 2 - 1, 1, jnp.bfloat16
    )
    assert reads_int8("int8", 10, 16, jnp.float32) and not reads_int8("target", 128256, 4096, jnp.bfloat16)
    with pytest.raises(UserError, match="choose one of auto, int8, target"):
        reads_int8("fp8", 10, 16, jnp.float32)


def dequantised(head):
    return np.asarray(head.rows, np.float64) * np.asarray(head.scale, np.float64)[:, None]


@pytest.mark.parametrize("ids", [None, np.arange(1, VOCAB, 3)])
def test_int8_logits_are_the_scaled_rows_against_float64(target, ids):
    features = jax.random.normal(jax.random.key(1), (2, 3, 96))
    head = draft_head(target.model, ids, "int8")
    assert head.rows.dtype == jnp.int8 and head.rows.shape == (VOCAB if ids is None else len(ids), 96)

    got = np.asarray(draft_logits(target.model, features, head))

    cut = dequantised(head) @ np.asarray(features, np.float64).reshape(6, 96).T
    want = np.full((VOCAB, 6), -np.inf)
    want[slice(None) if ids is None else ids] = cut
    np.testing.assert_allclose(got.reshape(6, VOCAB), want.T, rtol=1e-5, atol=1e-5)
    full = np.asarray(target.model.lm_logits(features)).reshape(6, VOCAB)  # the rounding is small
    kept = np.isfinite(want.T)
    np.testing.assert_allclose(got.reshape(6, VOCAB)[kept], full[kept], atol=0.02 * np.abs(full).max())


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_both_impls_rank_the_candidates_by_the_int8_rows(target, impl, temperature):
    features = jax.random.normal(jax.random.key(1), (2, 3, 96)) * 20.0
    sampling = SamplingParams.create(temperature=temperature)
    noise = gumbel_noise(jax.random.key(2), (2, VOCAB), sampling)
    ids = np.arange(1, VOCAB, 3)
    head = draft_head(target.model, ids, "int8")

    best, got = draft_candidates(target.model, features, 4, sampling, noise, attn_impl=impl, head=head)

    logits = np.einsum("bth,vh->btv", np.asarray(features, np.float64), dequantised(head))
    if temperature == 0.0:
        scores = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        scores -= logits.max(-1, keepdims=True)
    else:
        scores = logits / temperature + np.asarray(noise, np.float64)[:, None, ids]
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :4]
    np.testing.assert_array_equal(np.asarray(got), ids[order])
    want = np.take_along_axis(scores, order, axis=-1)
    # the Pallas pass takes the features as two int8 parts (head_top_k.int8_parts): each within
    # 1 / (127 * 2 * LOW_STEPS) of its row's largest entry, so a logit within that times the row's sum
    parts = np.abs(dequantised(head)).sum(-1).max() * np.abs(np.asarray(features)).max() / (127 * 2 * LOW_STEPS)
    atol = 1e-4 + (2 * parts / max(temperature, 1.0) if impl == "pallas" else 0.0)
    np.testing.assert_allclose(np.asarray(best), want - (want[..., :1] if temperature else 0), rtol=1e-4, atol=atol)


def test_a_draft_builds_its_head_once_and_keeps_its_format(target):
    draft = init_draft(target, seed=1)
    assert draft.head_under(target.model) is None  # a tiny float32 head under "auto": the target's own
    int8 = draft.with_head_format("int8")
    heads = [proposer_for("longspec", target, int8, w)[1].head for w in ((2, 2), (4, 1))]
    assert heads[0].rows is heads[1].rows and heads[0].rows.dtype == jnp.int8 and heads[0].ids is None
    assert int8.cast(jnp.bfloat16).head_format == "int8"
    assert draft.proposal_key() == "all" and int8.proposal_key() == "all/int8"
    with pytest.raises(UserError, match="unknown draft head format 'int4'"):
        draft.with_head_format("int4")


def test_greedy_output_with_an_int8_head_equals_ar():
    """A tree, a drawn chain and mode auto with the draft reading int8 rows, cut or whole, under
    both impls, its own block as it is or int8 too (int8_rows.py: the Pallas tree, the drawn chain
    and mode auto): the target's check keeps AR's tokens."""
    target = random_target(tiny_config(head_dim=64), seed=1, dtype="float32")
    vocab = target.config.vocab_size
    full_block = init_draft(target, seed=2).with_head_format("int8")
    draft = full_block.with_block_format("int8")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=9).tolist(), rng.integers(0, vocab, size=5).tolist()]
    reference = generate(target, prompts, mode="ar", max_new_tokens=8, eos_token_ids=(), attn_impl="xla").tokens
    run = functools.partial(generate, target, prompts, max_new_tokens=8, eos_token_ids=())
    cut = draft.with_candidate_tokens(np.arange(0, vocab, 4))
    for d, impl, widths in ((full_block, "xla", (3, 3)), (draft, "pallas", (2, 2)), (cut, "xla", (1, 1))):
        got = run(draft=d, mode="longspec", tree_widths=widths, attn_impl=impl)
        assert got.tokens == reference, (impl, widths)
    assert run(draft=draft, mode="auto").tokens == reference
