"""Training pieces: anchor-offset positions, the chunked cross-entropy (values, gradients, and that
the [tokens, vocab] logits never exist whole), and draft_loss against an unchunked reference."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from longspec_jax.anchor_offset import anchor_offset_positions, anchor_offset_positions_jax
from longspec_jax.chunked_loss import chunked_next_token_loss
from longspec_jax.draft import DraftBlock, DraftConfig, draft_hidden, draft_loss
from longspec_jax.errors import UserError
from longspec_jax.target import random_target
from tests.test_speculative import sharpened_target
from tests.tiny_models import tiny_config
from train.step import StepConfig, train_step


def _check_anchor_offsets(positions, length, max_len, anchors):
    assert positions.shape[1] == length
    np.testing.assert_array_equal(
        positions[:, :anchors], np.broadcast_to(np.arange(anchors), (len(positions), anchors))
    )
    offsets = positions[:, anchors] - anchors
    np.testing.assert_array_equal(positions[:, anchors:], offsets[:, None] + np.arange(anchors, length)[None, :])
    assert offsets.min() == 0 and offsets.max() == max_len - length  # covers the whole range, never beyond
    assert positions.max() <= max_len - 1


@pytest.mark.parametrize("anchors", [4, 0, 2])
def test_anchor_offset_positions_numpy_and_jax(anchors):
    length, max_len = 12, 20
    rng = np.random.default_rng(0)
    _check_anchor_offsets(
        anchor_offset_positions(rng, length, max_len, num_anchors=anchors, batch=2000), length, max_len, anchors
    )
    got = anchor_offset_positions_jax(jax.random.key(0), length, max_len, num_anchors=anchors, batch=2000)
    assert got.dtype == jnp.int32
    _check_anchor_offsets(np.asarray(got), length, max_len, anchors)


def test_anchor_offset_rejects_sequences_longer_than_max_len():
    with pytest.raises(UserError, match="exceeds the anchor-offset max_len"):
        anchor_offset_positions(np.random.default_rng(0), 40, 32)


def _dense_loss_sums(hidden, lm_logits, tokens, label_mask):
    logits = lm_logits(hidden[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = label_mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w), jnp.sum((jnp.argmax(logits, -1) == tokens[:, 1:]) * w), jnp.sum(w)


@pytest.fixture(scope="module")
def head():
    return random_target(tiny_config(vocab_size=512), seed=0).model


def _batch(b, l, v, seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(b, l, 64)) * 3, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (b, l)), jnp.int32)
    mask = jnp.asarray(rng.random((b, l)) < 0.7)
    return hidden, tokens, mask


def test_chunked_cross_entropy_equals_unchunked_with_gradients(head):
    hidden, tokens, mask = _batch(2, 23, 512)  # 44 predictions: chunks of 8 leave a remainder
    chunked = lambda h: chunked_next_token_loss(h, head.lm_logits, tokens, mask, chunk_tokens=8)
    dense = lambda h: _dense_loss_sums(h, head.lm_logits, tokens, mask)
    for got, want in zip(chunked(hidden), dense(hidden)):
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    g_chunked = jax.grad(lambda h: chunked(h)[0])(hidden)
    g_dense = jax.grad(lambda h: dense(h)[0])(hidden)
    assert np.abs(np.asarray(g_dense)).max() > 1e-3
    np.testing.assert_allclose(np.asarray(g_chunked), np.asarray(g_dense), atol=1e-5)


def _dense_distilled_loss_and_grad(hidden, teacher, head, tokens, label_mask, distill):
    """float64 numpy reference of (1 - distill) * CE(token) + distill * H(p_teacher, q), summed over
    the labels, and its gradient in hidden (softmax(q) - (1 - distill) onehot(token) - distill p,
    through the head)."""
    w_head = np.asarray(head.embed[...] if head.lm_head is None else head.lm_head[...], np.float64)  # [V, H]
    h, t = np.asarray(hidden, np.float64)[:, :-1], np.asarray(teacher, np.float64)[:, :-1]
    y, w = np.asarray(tokens)[:, 1:], np.asarray(label_mask, np.float64)[:, 1:]

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    logits = h @ w_head.T
    q, p = softmax(logits), softmax(t @ w_head.T)
    logq = np.log(q)
    nll = -np.take_along_axis(logq, y[..., None], axis=-1)[..., 0]
    loss = np.sum(((1 - distill) * nll - distill * np.sum(p * logq, -1)) * w)
    onehot = np.eye(w_head.shape[0])[y]
    grad = np.zeros(np.shape(hidden))
    grad[:, :-1] = ((q - (1 - distill) * onehot - distill * p) * w[..., None]) @ w_head
    return loss, grad


@pytest.mark.parametrize("distill", [1.0, 0.3])
def test_distillation_equals_the_dense_float64_loss_with_gradients(head, distill):
    hidden, tokens, mask = _batch(2, 23, 512)
    teacher = _batch(2, 23, 512, seed=1)[0]

    def chunked(h, t=teacher):
        return chunked_next_token_loss(h, head.lm_logits, tokens, mask, chunk_tokens=8, teacher=t, distill=distill)[0]

    want, g_want = _dense_distilled_loss_and_grad(hidden, teacher, head, tokens, mask, distill)
    np.testing.assert_allclose(float(chunked(hidden)), want, rtol=1e-5)
    assert np.abs(g_want).max() > 1e-3
    np.testing.assert_allclose(np.asarray(jax.grad(chunked)(hidden)), g_want, atol=1e-5)
    assert float(jnp.abs(jax.grad(lambda t: chunked(hidden, t))(teacher)).max()) == 0.0  # none into the teacher
    plain = chunked_next_token_loss(hidden, head.lm_logits, tokens, mask, chunk_tokens=8)[0]
    assert abs(float(chunked(hidden)) - float(plain)) > 0.1  # the soft label changes the loss


def test_distilling_towards_the_drafts_own_distribution_leaves_only_its_entropy(head):
    # p = q: H(p, q) is q's entropy, whose gradient is not zero, but KL(p || q) = 0: the soft term's
    # value is the entropy (a check that p is the teacher's distribution, not the data's token).
    hidden, tokens, mask = _batch(1, 9, 512)
    loss = chunked_next_token_loss(hidden, head.lm_logits, tokens, mask, chunk_tokens=4, teacher=hidden, distill=1.0)[0]
    logq = jax.nn.log_softmax(head.lm_logits(hidden[:, :-1]), axis=-1)
    entropy = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
    np.testing.assert_allclose(float(loss), float(jnp.sum(entropy * mask[:, 1:])), rtol=1e-5)


def _largest_vocab_rows(jaxpr, vocab):
    """The most rows (elements / vocab) of any value with a vocab-sized axis, in every sub-jaxpr
    (scan bodies, remat) of a closed jaxpr."""
    most = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            if vocab in shape:
                most = max(most, int(np.prod(shape)) // vocab)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            most = max(most, _largest_vocab_rows(sub, vocab))
    return most


def test_chunked_cross_entropy_never_holds_all_logits(head):
    """Forward and backward: no intermediate has more than chunk_tokens rows of vocab width (the
    embedding itself has H = 64 rows per vocab entry); the dense loss, checked the same way, does."""
    b, l, v, chunk = 2, 129, 512, 32
    hidden, tokens, mask = _batch(b, l, v)
    rows = lambda f: _largest_vocab_rows(jax.make_jaxpr(jax.value_and_grad(f))(hidden).jaxpr, v)
    chunked_rows = rows(lambda h: chunked_next_token_loss(h, head.lm_logits, tokens, mask, chunk_tokens=chunk)[0])
    dense_rows = rows(lambda h: _dense_loss_sums(h, head.lm_logits, tokens, mask)[0])
    assert chunked_rows <= max(chunk, 64)
    assert dense_rows >= b * (l - 1)


def test_draft_loss_matches_dense_reference_and_trains():
    cfg = tiny_config()
    target = random_target(cfg, seed=1).model
    block = DraftBlock(cfg, DraftConfig(window=8), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    b, l = 2, 20
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, l)), jnp.int32)
    positions = jnp.asarray(anchor_offset_positions(rng, l, 200, batch=b))
    mask = jnp.asarray(rng.random((b, l)) < 0.8)
    tk = jnp.asarray(rng.normal(size=(b, l, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    tv = jnp.asarray(rng.normal(size=(b, l, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    lag = jnp.int32(2)

    @nnx.jit
    def loss_and_grad(block):
        return nnx.value_and_grad(
            lambda m: draft_loss(m, target, tokens, positions, mask, tk, tv, lag, chunk_tokens=8), has_aux=True
        )(block)

    @nnx.jit
    def dense_loss_and_grad(block):
        def loss(m):
            s, _, n = _dense_loss_sums(
                draft_hidden(m, target, tokens, positions, tk, tv, lag), target.lm_logits, tokens, mask
            )
            return s / n

        return nnx.value_and_grad(loss)(block)

    (loss, metrics), grads = loss_and_grad(block)
    want, want_grads = dense_loss_and_grad(block)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert float(metrics["tokens"]) == float(jnp.sum(mask[:, 1:]))
    flat, flat_want = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
    assert len(flat) == len(jax.tree.leaves(nnx.state(block, nnx.Param)))
    for g, w in zip(flat, flat_want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-4)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in flat)


@pytest.mark.parametrize("distill", [0.0, 1.0])
def test_the_training_step_takes_the_targets_own_distribution_as_the_soft_label(distill):
    target = sharpened_target(seed=2, vocab_size=64, eos_token_ids=())  # a peaked p, unlike random weights
    block = DraftBlock(target.config, DraftConfig(window=8), rngs=nnx.Rngs(0))
    draft_graphdef, draft_params = nnx.split(block)
    target_graphdef, target_params = nnx.split(target.model)
    params = nnx.to_pure_dict(draft_params)
    optimizer = optax.sgd(0.0)
    state = {"params": params, "opt": optimizer.init(params)}
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, (1, 2, 12), dtype=np.int32)  # [accumulation, batch, length]
    mask = (rng.random((1, 2, 12)) < 0.8).astype(np.int32)
    # No anchor offset and gamma 2: positions 0..L-1 and a lag of 1, which the reference repeats.
    sc = StepConfig(
        gamma=2,
        anchor_offset=False,
        num_anchors=4,
        max_offset=64,
        compute_dtype="float32",
        attn_impl="xla",
        loss_chunk_tokens=8,
        distill=distill,
    )
    _, metrics = train_step(
        target_graphdef,
        draft_graphdef,
        optimizer,
        sc,
        target_params,
        state,
        {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask)},
        jax.random.key(0),
    )
    x = jnp.asarray(tokens[0])
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), x.shape)
    k, v = target.model.last_layer_kv(x, positions, attn_impl="xla")
    logq = jax.nn.log_softmax(target.model.lm_logits(draft_hidden(block, target.model, x, positions, k, v, 1)), -1)
    p = jax.nn.softmax(target.model.forward_logits(x, attn_impl="xla"), -1)  # the target's own, from scratch
    soft = -jnp.sum(p[:, :-1] * logq[:, :-1], -1)  # position t predicts token t + 1
    hard = -jnp.take_along_axis(logq[:, :-1], x[:, 1:, None], -1)[..., 0]
    per_token = soft if distill else hard
    assert float(jnp.abs(soft - hard).max()) > 0.1  # the two labels differ: the test tells them apart
    w = jnp.asarray(mask[0, :, 1:], jnp.float32)
    np.testing.assert_allclose(float(metrics["loss"]), float(jnp.sum(per_token * w) / jnp.sum(w)), rtol=1e-4)
