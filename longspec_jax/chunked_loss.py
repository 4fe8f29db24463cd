"""Next-token cross-entropy through an LM head without materialising the [tokens, vocab] logits.

At 32k tokens and a 32k-152k vocabulary the float32 logits alone are 4-20 GB, and autodiff would
keep them for the backward pass. Here the token rows go through the head `chunk_tokens` at a time
inside a `lax.scan` whose body is rematerialised (`jax.checkpoint`): the forward keeps only
per-chunk sums, the backward recomputes one chunk's logits at a time. Peak logits memory is
[chunk_tokens, vocab].
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunked_next_token_loss(hidden, lm_logits: Callable, tokens, label_mask, *, chunk_tokens: int = 1024):
    """Sums of the next-token loss -> (loss_sum, correct, count), float32 scalars.

    hidden [B,L,H]: features at each position; lm_logits: [1,C,H] -> float32[1,C,V] (the target's
    head); tokens int32[B,L]; label_mask bool[B,L]: token t is a target (predicted from t - 1) where
    label_mask[b, t]; column 0 is never a target. correct counts top-1 hits among the targets."""
    b, l, h = hidden.shape
    feats = hidden[:, :-1].reshape(-1, h)
    labels = tokens[:, 1:].reshape(-1).astype(jnp.int32)
    weights = label_mask[:, 1:].reshape(-1).astype(jnp.float32)
    n = feats.shape[0]
    c = max(1, min(chunk_tokens, n))
    chunks = -(-n // c)
    pad = chunks * c - n
    feats = jnp.pad(feats, ((0, pad), (0, 0))).reshape(chunks, c, h)
    labels = jnp.pad(labels, (0, pad)).reshape(chunks, c)
    weights_chunked = jnp.pad(weights, (0, pad)).reshape(chunks, c)

    @jax.checkpoint
    def chunk_sums(f, y, w):
        logits = lm_logits(f[None])[0].astype(jnp.float32)  # [C, V]
        target_logit = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
        hits = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
        return jnp.sum(nll * w), jnp.sum(hits * w)

    def step(totals, chunk):
        loss, correct = chunk_sums(*chunk)
        return (totals[0] + loss, totals[1] + correct), None

    zero = jnp.zeros((), jnp.float32)
    (loss_sum, correct), _ = jax.lax.scan(step, (zero, zero), (feats, labels, weights_chunked))
    return loss_sum, correct, jnp.sum(weights)
