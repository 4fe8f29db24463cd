"""Next-token cross-entropy through an LM head without materialising the [tokens, vocab] logits.

At 32k tokens and a 32k-152k vocabulary the float32 logits alone are 4-20 GB, and autodiff would
keep them for the backward pass. Here the token rows go through the head `chunk_tokens` at a time
inside a `lax.scan` whose body is rematerialised (`jax.checkpoint`): the forward keeps only
per-chunk sums, the backward recomputes one chunk's logits at a time. Peak logits memory is
[chunk_tokens, vocab].

With a teacher (distillation), each position's loss also takes the target's own next-token
distribution p as the soft label: (1 - distill) * CE(the data's token) + distill * H(p, q), where
H(p, q) = -sum_x p(x) log q(x) is forward KL(p || q) plus p's entropy (a constant of the draft).
Speculative sampling keeps a drawn token with probability sum_x min(p(x), q(x)), and the greedy rule
keeps the draft's argmax where it is the target's: both are about the whole of p, which the data's
one token samples only once. The teacher's logits are made chunk by chunk through the same head.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunked_next_token_loss(
    hidden, lm_logits: Callable, tokens, label_mask, *, chunk_tokens: int = 1024, teacher=None, distill: float = 0.0
):
    """Sums of the next-token loss -> (loss_sum, correct, count), float32 scalars.

    hidden [B,L,H]: features at each position; lm_logits: [1,C,H] -> float32[1,C,V] (the target's
    head); tokens int32[B,L]; label_mask bool[B,L]: token t is a target (predicted from t - 1) where
    label_mask[b, t]; column 0 is never a target. correct counts top-1 hits among the targets.
    teacher [B,L,H] (optional): the target's own final features, whose logits through the same head
    give the soft label, weighted by distill in [0, 1] (module doc); no gradient flows into it."""
    b, l, h = hidden.shape
    feats = hidden[:, :-1].reshape(-1, h)
    labels = tokens[:, 1:].reshape(-1).astype(jnp.int32)
    weights = label_mask[:, 1:].reshape(-1).astype(jnp.float32)
    n = feats.shape[0]
    c = max(1, min(chunk_tokens, n))
    chunks = -(-n // c)
    pad = chunks * c - n

    def chunked(x):  # [n, ...] -> [chunks, c, ...]
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(chunks, c, *x.shape[1:])

    xs = (chunked(feats), chunked(labels), chunked(weights))
    taught = teacher is not None and distill > 0
    if taught:
        xs += (chunked(jax.lax.stop_gradient(teacher[:, :-1].reshape(-1, h))),)

    @jax.checkpoint
    def chunk_sums(f, y, w, *t):
        logits = lm_logits(f[None])[0].astype(jnp.float32)  # [C, V]
        log_norm = jax.nn.logsumexp(logits, axis=-1)
        loss = log_norm - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        if taught:
            p = jax.nn.softmax(lm_logits(t[0][None])[0].astype(jnp.float32), axis=-1)
            loss = (1.0 - distill) * loss + distill * (log_norm - jnp.sum(p * logits, axis=-1))
        hits = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
        return jnp.sum(loss * w), jnp.sum(hits * w)

    def step(totals, chunk):
        loss, correct = chunk_sums(*chunk)
        return (totals[0] + loss, totals[1] + correct), None

    zero = jnp.zeros((), jnp.float32)
    (loss_sum, correct), _ = jax.lax.scan(step, (zero, zero), xs)
    return loss_sum, correct, jnp.sum(weights)
